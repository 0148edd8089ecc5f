"""An asynchronous RL loop over HTTP: streaming clients on ``vllm serve`` while a trainer pushes weights.

    python benchmarks/serve_rl_loop.py [--clients 8] [--updates 5] [--duration 60] [--rounds 1]
                                       [--max-tokens 64] [--modes recompute,keep,abort] [--out FILE.json]

Starts ``python -m vllm.entrypoints.openai.api_server`` with the plugin (the embedded llama-tiny; CPU sizing:
bfloat16, max_model_len 256, 64 MiB of KV cache, enforce_eager) and a trainer process, warms up, then runs
``--rounds`` rounds of these phases of ``--duration`` seconds each on that one server:

* ``baseline``: ``--clients`` concurrent streaming clients (the first with 4 x ``--max-tokens``), alternating ``/v1/completions`` and
  ``/v1/chat/completions`` (``return_tokens_as_token_ids``, ``return_token_ids``, logprobs, a seed per request,
  T=0.9, ``ignore_eos``), one request after another, and no update;
* one phase per in-flight mode (``recompute``, ``keep``, ``abort``): the same load while the trainer pushes
  new weights over HTTP (``push_weights("http://...", transport="shm", inflight=mode)``, the
  ``/rlpatch/v1/refit`` route), ``--updates`` pushes per mode over the rounds, evenly spaced in each phase.
  Every push is llama-tiny with its own seeded perturbation, so every version has different weights.

In every phase an extra client opens a long stream and closes its connection as each push starts (in the
baseline at the same moments, with nothing pushed). Checked for every request after the run:

* lost / failed: no ``[DONE]``, an HTTP error, or a finish other than ``length`` (an ``abort`` finish counts
  apart in the ``abort`` phase, where the update asks for it);
* dropped / doubled tokens: the chunks' logprob tokens equal their ``token_ids``, their count the usage's
  ``completion_tokens`` (and ``max_tokens`` for a finished request); a sample of the baseline's seeded
  requests is sent again, not streamed, and the token ids compared (reported only: a different batch may
  change a bf16 logit);
* version spans: each chunk's ``rlpatch_weight_versions`` (in its own token coordinates), concatenated, cover
  the output; each span's logprobs are compared with a float32 transformers reference of its own version. A span
  sampled by version v on KV of an older version (``keep``) is compared with that mixture: each position's KV
  computed by the version that processed it, then version v on top (transformers' KV cache carried from one
  version's model to the next). A span is wrong (:func:`wrong_label`) if its reference fits nothing, or fits
  worse than bf16 noise while another label's reference fits as well; ``wrong_label_check`` applies the same
  rule to the same spans labelled with another version, to show what it catches;
* leaks: after each phase, ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` of ``/metrics``
  return to 0 (the cancelled streams included);
* stall: the gaps between a stream's consecutive token chunks as the client reads them, all and those
  overlapping a push (from its start to its return in the trainer), p50 / p99 / max; the server's own
  inter-token latency histogram per phase; the ``keep`` bound is the largest push's ``seconds`` + 2 decode
  steps (the server's mean inter-token latency in the baseline), reported, never asserted;
* tokens/s per phase.

Timing depends on the host and its load; the rounds interleave the phases so that they see the same drift.
Prints progress lines; writes JSON (default ``benchmarks/results/serve_rl_loop-vllm<version>-cpu.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODES = ("recompute", "keep", "abort")
PROMPTS = ["the quick cat sees", "12 + 7 =", "a dog and a bird", "one two three four", "the sun is",
           "water boils at", "if it rains then", "she opened the door and"]
TEMPERATURE = 0.9
TOKEN_TOLERANCE = 0.02  # mean |logprob - reference| over a span, nats, within bf16 noise (see wrong_label)
SPAN_TOLERANCE = 1.02  # token_mult_prob_error of a span of >= 8 tokens against that reference (reported)


def log(msg: str) -> None:
    print(f"[serve_rl_loop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path() -> str:
    from vllm_rlpatch.models import path

    return path("llama-tiny")


def start_server(workdir: Path, env: dict[str, str] | None = None, timeout_s: float = 420) -> tuple:
    """(process, url, log path) of a healthy ``vllm serve`` with the plugin; raises RuntimeError otherwise."""
    port = free_port()
    template = workdir / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    log_path = workdir / "server.log"
    fh = open(log_path, "w")
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("VLLM_RLPATCH_")}
    p = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(),
                          "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
                          "256", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
                          "--gpu-memory-utilization", "0.5", "--chat-template", str(template)],
                         stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if p.poll() is not None:
            raise RuntimeError("vllm serve exited: " + log_path.read_text()[-5000:])
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return p, url, log_path
        except OSError:
            time.sleep(1)
    stop_server(p)
    raise RuntimeError("vllm serve did not become healthy: " + log_path.read_text()[-5000:])


def stop_server(p) -> None:
    try:
        os.killpg(p.pid, 15)
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass


def metrics(url: str) -> dict:
    """The server's /metrics: running and waiting counts, and the inter-token latency histogram
    (``vllm:inter_token_latency_seconds``, measured by the server per output) as {le: cumulative count}."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    got = {"running": 0.0, "waiting": 0.0, "itl": {}}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            got[names[name]] += float(line.rsplit(" ", 1)[1])
        elif name == "vllm:inter_token_latency_seconds_sum":
            got["itl"]["sum"] = got["itl"].get("sum", 0.0) + float(line.rsplit(" ", 1)[1])
        elif name == "vllm:inter_token_latency_seconds_bucket":
            le = float(line.split('le="', 1)[1].split('"', 1)[0])
            got["itl"][le] = got["itl"].get(le, 0.0) + float(line.rsplit(" ", 1)[1])
    return got


def queue_depth(url: str) -> tuple[float, float]:
    """(running, waiting) from the server's /metrics."""
    m = metrics(url)
    return m["running"], m["waiting"]


def itl_stats(before: dict, after: dict) -> dict:
    """The server's inter-token latencies between two reads of /metrics: count, and the bucket bounds that hold
    the median, the 99th percentile and the largest (upper bounds, seconds)."""
    delta = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = delta.pop("sum", 0.0)
    les = sorted(delta)
    n = delta[les[-1]] if les else 0.0

    def q(x):
        return next((le for le in les if delta[le] >= x * n), None) if n else None

    return {"n": int(n), "mean_s": total / n if n else None, "p50_le_s": q(0.5), "p99_le_s": q(0.99),
            "max_le_s": q(1.0)}


async def drained(url: str, timeout_s: float = 30.0) -> dict:
    """Wait until the engine has no running or waiting request; what /metrics said, and after how long."""
    t0 = time.time()
    while True:
        running, waiting = await asyncio.to_thread(queue_depth, url)
        if (running == 0 and waiting == 0) or time.time() - t0 > timeout_s:
            return {"running": running, "waiting": waiting, "seconds": round(time.time() - t0, 2),
                    "leaked": running + waiting > 0}
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------ trainer
def make_weights(workdir: Path, n: int) -> list[str]:
    from support import reference as R

    return [R.perturbed_copy(model_path(), str(workdir / f"w{i}"), scale=1.0, seed=100 + i) for i in range(n)]


def trainer_child() -> None:
    """The trainer process: one JSON command a line on stdin ({"url", "weights", "inflight"}); per push it prints
    ``START <t>`` then ``DONE <json>`` (wall-clock times, comparable with the clients' on the same host)."""
    from safetensors.torch import load_file

    from vllm_rlpatch.refit import RefitError, push_weights

    for line in sys.stdin:
        cmd = json.loads(line)
        sd = sorted(load_file(os.path.join(cmd["weights"], "model.safetensors")).items())
        t0 = time.time()
        print(f"START {t0}", flush=True)
        try:
            rep = push_weights(cmd["url"], sd, transport="shm", inflight=cmd["inflight"]).as_dict()
            out = {"ok": True, "version": rep["version"], "seconds": rep["seconds"],
                   "aborted": len(rep.get("aborted_requests") or ()), "recomputed": rep.get("recomputed_requests"),
                   "transport": rep["transport"]}
        except RefitError as e:
            out = {"ok": False, "kind": e.kind, "message": str(e)}
        out.update(t_start=t0, t_end=time.time(), inflight=cmd["inflight"], weights=cmd["weights"])
        print("DONE " + json.dumps(out, default=str), flush=True)


class Trainer:
    """The trainer process, driven from the event loop."""

    def __init__(self, proc):
        self.proc = proc

    @classmethod
    async def start(cls) -> "Trainer":
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
        proc = await asyncio.create_subprocess_exec(sys.executable, str(Path(__file__).resolve()), "--trainer-child",
                                                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                    env=env)
        return cls(proc)

    async def push(self, url: str, weights: str, inflight: str, started: asyncio.Event) -> dict:
        """One push; ``started`` is set when the trainer starts sending."""
        self.proc.stdin.write((json.dumps({"url": url, "weights": weights, "inflight": inflight}) + "\n").encode())
        await self.proc.stdin.drain()
        while True:
            line = (await self.proc.stdout.readline()).decode()
            if not line:
                raise RuntimeError("the trainer process exited")
            if line.startswith("START "):
                started.set()
            elif line.startswith("DONE "):
                return json.loads(line[5:])

    async def close(self) -> None:
        self.proc.stdin.close()
        await self.proc.wait()


# ------------------------------------------------------------------------------------------ clients
def request_body(kind: str, prompt: str, seed: int, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model_path(), "max_tokens": max_tokens, "temperature": TEMPERATURE, "seed": seed,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    if kind == "completions":
        return "/v1/completions", {**body, "prompt": prompt, "logprobs": 0}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}], "logprobs": True,
                                    "top_logprobs": 0}


def _chunk_tokens(kind: str, ch: dict) -> tuple[list[int], list[float]]:
    lp = ch.get("logprobs") or {}
    if kind == "completions":
        return [int(t.split(":")[1]) for t in lp.get("tokens") or ()], list(lp.get("token_logprobs") or ())
    items = lp.get("content") or ()
    return [int(t["token"].split(":")[1]) for t in items], [t["logprob"] for t in items]


def _add_chunk(rec: dict, kind: str, chunk: dict, now: float) -> None:
    if chunk.get("prompt_token_ids") is not None:
        rec["prompt_ids"] = chunk["prompt_token_ids"]
    if chunk.get("usage"):
        rec["usage_tokens"] = chunk["usage"].get("completion_tokens")
    for ch in chunk.get("choices") or ():
        if ch.get("prompt_token_ids") is not None:
            rec["prompt_ids"] = ch["prompt_token_ids"]
        toks, lps = _chunk_tokens(kind, ch)
        ids = ch.get("token_ids") or []
        if ch.get("finish_reason"):
            rec["finish"] = ch["finish_reason"]
        if not toks and not ids:
            continue
        spans = ch.get("rlpatch_weight_versions") or []
        ok = (spans and spans[0][0] == 0 and spans[-1][1] == len(toks)
              and all(a[1] == b[0] for a, b in zip(spans, spans[1:])))
        rec["bad_chunk_spans"] += 0 if ok else 1
        off = len(rec["tokens"])
        for s, e, v, kv in spans:
            if rec["spans"] and rec["spans"][-1][1] == s + off and rec["spans"][-1][2:] == [v, kv]:
                rec["spans"][-1][1] = e + off
            else:
                rec["spans"].append([s + off, e + off, v, kv])
        rec["tokens"] += toks
        rec["token_ids"] += ids
        rec["logprobs"] += lps
        rec["times"].append(now)


async def stream_one(session, url: str, kind: str, prompt: str, seed: int, max_tokens: int,
                     cancel: asyncio.Event | None = None) -> dict:
    """One streamed request; ``cancel``: close the connection mid-stream once it is set."""
    path, body = request_body(kind, prompt, seed, max_tokens)
    rec = {"kind": kind, "prompt": prompt, "seed": seed, "max_tokens": max_tokens, "tokens": [], "token_ids": [],
           "logprobs": [], "spans": [], "times": [], "finish": None, "done": False, "error": None,
           "bad_chunk_spans": 0, "usage_tokens": None, "cancelled": False, "t_start": time.time()}
    try:
        async with session.post(url + path, json={**body, "stream": True}) as resp:
            if resp.status != 200:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    rec["done"] = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        rec["error"] = str(chunk["error"])[:300]
                    _add_chunk(rec, kind, chunk, time.time())
                if cancel is not None and cancel.is_set() and rec["tokens"]:
                    rec["cancelled"] = True
                    rec["t_cancel"] = time.time()
                    resp.close()
                    break
    except Exception as e:  # noqa: BLE001 - every failure of a request is a finding, recorded
        rec["error"] = f"{type(e).__name__}: {e}"[:300]
    rec["t_end"] = time.time()
    return rec


async def client_loop(session, url: str, idx: int, stop: asyncio.Event, max_tokens: int, seeds,
                      out: list) -> None:
    """One client's requests, one after another; client 0 runs long ones (4 x ``max_tokens``, at most 200): a
    long rollout among short ones, running when most updates land."""
    i = 0
    n = min(200, 4 * max_tokens) if idx == 0 else max_tokens
    while not stop.is_set():
        kind = "completions" if (idx + i) % 2 == 0 else "chat"
        out.append(await stream_one(session, url, kind, PROMPTS[(idx * 3 + i) % len(PROMPTS)], next(seeds), n))
        i += 1


async def canceller(session, url: str, started: asyncio.Event, stop: asyncio.Event, seeds, out: list) -> None:
    """Open a long stream, close it as soon as a push starts; again until the phase stops."""
    while not stop.is_set():
        started.clear()
        out.append(await stream_one(session, url, "completions", PROMPTS[0], next(seeds), 200, cancel=started))


async def run_phase(url: str, name: str, clients: int, duration: float, max_tokens: int, seeds,
                    trainer: Trainer | None = None, weights: list[str] = (), inflight: str | None = None) -> dict:
    """``clients`` streaming clients for ``duration`` seconds and a client that cancels its stream at evenly spaced
    moments; with a trainer, one push of each of ``weights`` at each of those moments (without, as many moments
    as ``weights`` has entries, and nothing pushed: the same load)."""
    import aiohttp

    stop = asyncio.Event()
    reqs: list[dict] = []
    cancelled: list[dict] = []
    pushes: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)
    started = asyncio.Event()
    itl0 = (await asyncio.to_thread(metrics, url))["itl"]
    load0, t0 = os.getloadavg(), time.time()
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(client_loop(session, url, i, stop, max_tokens, seeds, reqs))
                 for i in range(clients)]
        tasks.append(asyncio.create_task(canceller(session, url, started, stop, seeds, cancelled)))
        for k, w in enumerate(weights):
            await asyncio.sleep(max(0.0, t0 + duration * (k + 1) / (len(weights) + 1) - time.time()))
            if trainer is None:
                started.set()
                continue
            pushes.append(await trainer.push(url, w, inflight, started))
            log(f"{name}: push {k + 1}/{len(weights)}: " + json.dumps(
                {k: pushes[-1].get(k) for k in ("ok", "version", "seconds", "aborted", "recomputed")}))
        await asyncio.sleep(max(0.0, t0 + duration - time.time()))
        stop.set()
        started.set()  # the canceller's open stream ends now
        await asyncio.gather(*tasks)
    t1 = time.time()
    queue = await drained(url)
    itl = itl_stats(itl0, (await asyncio.to_thread(metrics, url))["itl"])
    log(f"{name}: {len(reqs)} requests, {len(cancelled)} cancelled streams, queue after: {queue}")
    return {"name": name, "inflight": inflight, "t0": t0, "t1": t1, "requests": reqs, "cancelled": cancelled,
            "pushes": pushes, "queue_after": queue, "server_itl": itl, "loadavg": [round(load0[0], 2), round(os.getloadavg()[0], 2)]}


# ------------------------------------------------------------------------------------------ checks
class References:
    """Float32 transformers references per weight version (tests/support/reference.py)."""

    def __init__(self, paths: dict[int, str]):
        self.paths = paths
        self.cache: dict = {}

    def model(self, v: int):
        from support import reference as R

        return R.load(self.paths[v])

    def full(self, v: int, prompt: list[int], out: list[int]) -> list[float]:
        key = (v, tuple(prompt), tuple(out))
        if key not in self.cache:
            from support import reference as R

            self.cache[key] = R.token_logprobs(self.model(v), prompt, out, temperature=TEMPERATURE)
        return self.cache[key]

    def mixed(self, prompt: list[int], out: list[int], spans: list, end: int) -> list[float]:
        """Logprobs of out[:end] when each position's KV was computed by the version that processed it: the
        prompt by the version of token 0, the input of token j (token j-1) by token j's version."""
        import torch

        from support import reference as R

        ids = torch.tensor([prompt + out[:end]])
        cache, rows, pos = None, [], 0
        with torch.no_grad():
            for s, e, v, _ in spans:
                if s >= end:
                    break
                stop = len(prompt) + min(e, end) - 1
                r = self.model(v)(ids[:, pos:stop], past_key_values=cache, use_cache=True)
                cache, pos = r.past_key_values, stop
                rows.append(r.logits[0].float())
        logits = torch.cat(rows)[len(prompt) - 1:]
        lp = R.processed_logprobs(logits, TEMPERATURE)
        return lp[torch.arange(end), torch.tensor(out[:end])].tolist()


def check_request(rec: dict, refs: References) -> dict:
    """Dropped/doubled tokens and per-span versions of one streamed request."""
    from support import reference as R

    n = len(rec["tokens"])
    out = {"tokens": n, "dropped_or_doubled": 0, "spans_cover": True, "wrong_version_tokens": 0, "span_errors": [],
           "diffs": [], "alt_spans": []}
    finished = rec["finish"] == "length"
    if rec["tokens"] != rec["token_ids"] or (rec["usage_tokens"] is not None and rec["usage_tokens"] != n) or (
            finished and n != rec["max_tokens"]):
        out["dropped_or_doubled"] = max(1, abs(n - (rec["usage_tokens"] or n)))
    spans = rec["spans"]
    out["spans_cover"] = (n == 0 or (spans[0][0] == 0 and spans[-1][1] == n and rec["bad_chunk_spans"] == 0
                                     and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))))
    if not n or "prompt_ids" not in rec:
        return out
    for s, e, v, kv in spans:
        if v not in refs.paths:
            out["wrong_version_tokens"] += e - s
            out["span_errors"].append([s, e, v, kv, None])
            continue
        ref = (refs.full(v, rec["prompt_ids"], rec["tokens"]) if v == kv
               else refs.mixed(rec["prompt_ids"], rec["tokens"], spans, e))
        err = R.mismatch(rec["logprobs"][s:e], ref[s:e])["token_mult_prob_error"]
        out["span_errors"].append([s, e, v, kv, round(err, 5)])
        diffs = [abs(a - b) for a, b in zip(rec["logprobs"][s:e], ref[s:e])]
        out["diffs"] += diffs
        # another label: the previous (else the next) version's weights; on older KV, the KV recomputed
        w = v - 1 if v - 1 in refs.paths else v + 1
        alt = (refs.full(v, rec["prompt_ids"], rec["tokens"]) if v != kv else
               refs.full(w, rec["prompt_ids"], rec["tokens"]) if w in refs.paths else None)
        alt_diffs = None if alt is None else [abs(a - b) for a, b in zip(rec["logprobs"][s:e], alt[s:e])]
        if wrong_label(diffs, alt_diffs):
            out["wrong_version_tokens"] += e - s
        if alt_diffs is not None:
            out["alt_spans"].append([e - s, wrong_label(alt_diffs, diffs)])
    return out


def wrong_label(own: list[float], other: list[float] | None) -> bool:
    """A span's label is wrong when its reference fits nothing (mean |logprob difference| > 0.3 nats), or fits
    worse than bf16 noise (0.02 nats) while another version's fits as well or better."""
    m = sum(own) / len(own)
    if not m <= 0.3:  # (NaN: wrong)
        return True
    return m > TOKEN_TOLERANCE and other is not None and sum(other) / len(other) <= m


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def gaps(phase: dict, windows: list[tuple[float, float]] | None = None, where: bool = False) -> list:
    """Gaps between consecutive token chunks of every stream (only those overlapping one of ``windows``);
    ``where``: (gap, seconds from the start of the nearest push to the gap's start, None if none within 5 s)."""
    out = []
    starts = [p["t_start"] for p in phase["pushes"]]
    for rec in phase["requests"]:
        for a, b in zip(rec["times"], rec["times"][1:]):
            if windows is None or any(a < w1 and b > w0 for w0, w1 in windows):
                near = min(starts, key=lambda t: abs(a - t), default=None)
                out.append((b - a, None if near is None or abs(a - near) > 5 else round(a - near, 2)) if where
                           else b - a)
    return out


def merge(phases: list[dict]) -> dict:
    """The rounds of one phase as one."""
    return {"name": phases[0]["name"], "inflight": phases[0]["inflight"],
            "seconds": sum(p["t1"] - p["t0"] for p in phases),
            **{k: [x for p in phases for x in p[k]] for k in ("requests", "cancelled", "pushes")},
            "queue_after": {"leaked": any(p["queue_after"]["leaked"] for p in phases),
                            "running": max(p["queue_after"]["running"] for p in phases),
                            "waiting": max(p["queue_after"]["waiting"] for p in phases),
                            "seconds": max(p["queue_after"]["seconds"] for p in phases)},
            "server_itl": [p["server_itl"] for p in phases], "loadavg": [p["loadavg"] for p in phases]}


def gap_stats(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_s": pct(xs, 0.5), "p99_s": pct(xs, 0.99), "max_s": max(xs) if xs else None}


def summarize_phase(phase: dict, refs: References, step: float | None) -> dict:
    """The figures of one phase; ``step``: the baseline's decode step (the keep bound's unit)."""
    reqs = phase["requests"]
    checks = [check_request(r, refs) for r in reqs + phase["cancelled"]]
    diffs = [d for c in checks for d in c["diffs"]]
    aborted = [r for r in reqs + phase["cancelled"] if r["finish"] == "abort" and r["error"] is None]
    asked = phase["inflight"] == "abort"
    failed = [r for r in reqs if not (r["done"] and r["error"] is None and (
        r["finish"] == "length" or (asked and r["finish"] == "abort")))]
    cancel_bad = [r for r in phase["cancelled"] if r["error"] is not None]
    windows = [(p["t_start"], p["t_end"]) for p in phase["pushes"]]
    tokens = sum(len(r["tokens"]) for r in reqs)
    seconds = phase["seconds"]
    out = {
        "inflight": phase["inflight"], "requests": len(reqs), "finished": sum(r["finish"] == "length" for r in reqs),
        "lost_or_failed": len(failed) + len(cancel_bad),
        "failures": [{k: r[k] for k in ("kind", "finish", "done", "error")} for r in (failed + cancel_bad)[:5]],
        "aborted_by_update": len(aborted) if asked else 0,
        "aborted_reported_by_pushes": sum(p.get("aborted", 0) for p in phase["pushes"]),
        "tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
        "stream_s_per_token_p50": decode_step(phase),
        "dropped_or_doubled": sum(c["dropped_or_doubled"] for c in checks),
        "spans_not_covering": sum(not c["spans_cover"] for c in checks),
        "tokens_checked": sum(sum(e - s for s, e, *_ in c["span_errors"]) for c in checks),
        "wrong_version_tokens": sum(c["wrong_version_tokens"] for c in checks),
        "span_kinds": {}, "token_abs_diff": {"p50": pct(diffs, 0.5), "p999": pct(diffs, 0.999),
                                             "max": max(diffs, default=None)},
        "long_spans_over_span_tolerance": sum(x[4] is None or x[4] > SPAN_TOLERANCE for c in checks
                                              for x in c["span_errors"] if x[1] - x[0] >= 8),
        "requests_spanning_versions": sum(len({s[2] for s in r["spans"]}) > 1 for r in reqs),
        "gaps_all": gap_stats(gaps(phase)),
        "cancelled_streams": len(phase["cancelled"]),
        "cancelled_mid_stream_during_push": sum(
            r["cancelled"] and any(w0 <= r["t_cancel"] <= w1 + 1.0 for w0, w1 in windows) for r in phase["cancelled"]),
        "queue_after": phase["queue_after"], "loadavg_1min_start_end": phase["loadavg"],
        "server_itl_per_round": phase["server_itl"],
        "largest_gaps_s_and_from_push_s": [[round(g, 3), t] for g, t in sorted(
            gaps(phase, where=True), key=lambda x: x[0])[-5:]],
        "pushes": [{**{k: p.get(k) for k in ("ok", "version", "seconds", "aborted", "recomputed")},
                    # the client's view: its streams open over the whole push, and those with a token during it
                    "streams_open_across": sum(r["t_start"] < p["t_start"] and r["t_end"] > p["t_end"] for r in reqs),
                    "streams_with_a_token_during": sum(any(p["t_start"] <= t <= p["t_end"] for t in r["times"])
                                                       for r in reqs)} for p in phase["pushes"]],
    }
    alts = [a for c in checks for a in c["alt_spans"]]
    out["wrong_label_check"] = {  # the same spans labelled with another version: what the check flags
        "spans": len(alts), "tokens": sum(n for n, _ in alts), "tokens_flagged": sum(n for n, bad in alts if bad)}
    for c in checks:
        for s, e, v, kv, _ in c["span_errors"]:
            key = "same" if v == kv else "sampled_on_older_kv"
            out["span_kinds"][key] = out["span_kinds"].get(key, 0) + e - s
    if windows:
        out["gaps_during_push"] = gap_stats(gaps(phase, windows))
        push_max = max(p.get("seconds") or 0.0 for p in phase["pushes"])
        if step is not None and out["gaps_during_push"]["p99_s"] is not None:
            bound = push_max + 2 * step
            out["stall_bound_s"] = round(bound, 4)
            out["p99_gap_within_bound"] = out["gaps_during_push"]["p99_s"] <= bound
    return out


async def replay(url: str, reqs: list[dict], n: int) -> dict:
    """Send ``n`` finished seeded requests again, not streamed; compare the token ids."""
    import aiohttp

    same = tried = 0
    async with aiohttp.ClientSession() as session:
        for rec in [r for r in reqs if r["finish"] == "length"][:n]:
            path, body = request_body(rec["kind"], rec["prompt"], rec["seed"], rec["max_tokens"])
            body.pop("stream_options")
            async with session.post(url + path, json=body) as resp:
                ch = (await resp.json())["choices"][0]
            tried += 1
            same += ch.get("token_ids") == rec["tokens"]
    return {"replayed": tried, "same_tokens": same}


def decode_step(phase: dict) -> float | None:
    """The median over a phase's finished streams of (last token's arrival - first's) / (tokens - 1)."""
    per = [(r["times"][-1] - r["times"][0]) / (len(r["tokens"]) - 1) for r in phase["requests"]
           if r["finish"] == "length" and len(r["tokens"]) > 1 and len(r["times"]) > 1]
    return statistics.median(per) if per else None


async def run_rounds(args, url: str, trainer: Trainer, weights: list[str], seeds) -> tuple[list, dict]:
    """``args.rounds`` rounds of: the baseline, then each mode; a mode's pushes spread over the rounds."""
    names = ["baseline", *args.modes]
    per_round = {m: [weights[i * args.updates:(i + 1) * args.updates][r::args.rounds] for r in range(args.rounds)]
                 for i, m in enumerate(args.modes)}
    runs: dict[str, list] = {n: [] for n in names}
    replayed = None
    for r in range(args.rounds):
        for name in names:
            ws = per_round[name][r] if name in per_round else [None] * len(per_round[args.modes[0]][r])
            log(f"round {r + 1}/{args.rounds}, phase {name}: {args.clients} clients, {args.duration:.0f} s, "
                + (f"{len(ws)} pushes (inflight={name})" if name != "baseline" else "no update"))
            runs[name].append(await run_phase(url, name, args.clients, args.duration, args.max_tokens, seeds,
                                              None if name == "baseline" else trainer, ws,
                                              None if name == "baseline" else name))
            if replayed is None:
                replayed = await replay(url, runs["baseline"][0]["requests"], 8)
    return [merge(runs[n]) for n in names], replayed


async def run_all(args, workdir: Path) -> dict:
    """Start the server and the trainer, run the phases, check every request; the summary per phase."""
    import itertools

    seeds = itertools.count(1000)
    weights = make_weights(workdir, args.updates * len(args.modes))
    log("starting vllm serve (llama-tiny, CPU)")
    proc, url, _ = await asyncio.to_thread(start_server, workdir)
    trainer = await Trainer.start()
    try:
        log(f"server at {url}; warm-up")
        await run_phase(url, "warm-up", args.clients, min(5.0, args.duration), args.max_tokens, seeds)
        phases, replayed = await run_rounds(args, url, trainer, weights, seeds)
    finally:
        await trainer.close()
        await asyncio.to_thread(stop_server, proc)
    paths = {0: model_path()}
    for ph in phases:
        paths.update({p["version"]: p["weights"] for p in ph["pushes"] if p.get("ok")})
    log(f"checking {sum(len(p['requests']) for p in phases)} requests against {len(paths)} reference versions")
    refs = References(paths)
    itl = [x for x in phases[0]["server_itl"] if x["n"]]
    step = sum(x["mean_s"] * x["n"] for x in itl) / sum(x["n"] for x in itl) if itl else None
    out = {p["name"]: summarize_phase(p, refs, step) for p in phases}
    out["baseline"]["replayed_not_streamed"] = replayed
    out["decode_step_s"] = step  # the server's mean inter-token latency in the baseline
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        print(f"serve_rl_loop: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None):
    ap = _Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--updates", type=int, default=5, help="pushes per in-flight mode")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="rounds of (baseline, each mode), interleaved")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--trainer-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    why = (f"--modes: unknown {', '.join(bad)} (use {', '.join(MODES)})" if bad else
           "--clients must be >= 1" if args.clients < 1 else
           "--updates must be >= 1" if args.updates < 1 else
           "--rounds must be 1..--updates" if not 1 <= args.rounds <= args.updates else
           "--duration must be > 0" if not args.duration > 0 else
           "--max-tokens must be 2..200" if not 2 <= args.max_tokens <= 200 else None)
    if why:
        print(f"serve_rl_loop: {why}", file=sys.stderr)
        sys.exit(2)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.trainer_child:
        trainer_child()
        return
    import vllm

    with tempfile.TemporaryDirectory(prefix="serve_rl_loop-") as d:
        results = asyncio.run(run_all(args, Path(d)))
    with open("/proc/cpuinfo") as fh:
        cpu = fh.read()
    out = {"benchmark": "serve_rl_loop", "vllm": vllm.__version__, "host": {
        "cpus": os.cpu_count(), "amx": "amx_tile" in cpu, "machine": platform.machine(),
        "loadavg_end": os.getloadavg()}, "config": {k: v for k, v in vars(args).items() if k != "trainer_child"},
        "transport": "shm", "model": "llama-tiny (embedded)", **results}
    path = args.out or str(ROOT / "benchmarks" / "results" / f"serve_rl_loop-vllm{vllm.__version__}-cpu.json")
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    for name in ["baseline", *args.modes]:
        r = results[name]
        log(f"{name}: lost/failed {r['lost_or_failed']}, aborted by update {r['aborted_by_update']}, dropped/doubled "
            f"{r['dropped_or_doubled']}, wrong-version tokens {r['wrong_version_tokens']}/{r['tokens_checked']}, "
            f"leak {r['queue_after']['leaked']}, {r['tokens_per_s']} tok/s, gaps p99 {r['gaps_all']['p99_s']}"
            + (f", during push p99 {r['gaps_during_push']['p99_s']} max {r['gaps_during_push']['max_s']}"
               if "gaps_during_push" in r else ""))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
