"""``vllm-rlpatch kv-pin``: the largest ``kv_cache_memory_bytes`` that survives sleep -> trainer -> wake.

In colocated RL the engine sleeps while the trainer runs and wakes for rollouts; at wake-up vLLM maps its
weights and KV cache again while the trainer still holds part of the GPU. Without a pin the KV cache is
sized from ``gpu_memory_utilization`` when the engine starts (with the GPU to itself), and the wake-up fails
with ``CUDA Error: out of memory at cumem_allocator.cpp``. This command measures instead of guessing:

1. **Measure.** Start the engine once with sleep mode and a small KV probe; run a warm-up batch (the
   activation peak stays in PyTorch's cache); read the device and vLLM's sleep-mode pools by tag
   (``weights``, ``kv_cache``, and in 0.32 ``runtime``/``cudagraph``) in the worker.
2. **Derive.** ``pin = total - used by others - trainer reserve - margin - (engine peak - KV probe)``, rounded
   down to 256 MiB: everything the awake engine needs besides its KV cache, measured, plus what the
   trainer keeps while the engine is awake.
3. **Verify.** Start the engine with the pin, generate, ``sleep(level)``, allocate the trainer reserve on
   the same GPU, ``wake_up()``, generate again (greedy outputs must match). If the wake fails, step down
   once (by the margin, at least 10 %) and verify again.

The result (pin, KV capacity in tokens, the line to use) is cached per model, engine args, vLLM version, GPU
and reserve, so a second call is instant. The sizing runs against a :class:`Backend`; :class:`CudaBackend`
drives real vLLM. Sleep mode is CUDA/ROCm only, so on CPU the command explains that and exits 2 (the
sizing logic is tested on CPU against a simulated allocator, ``tests/test_kv_pin.py``).

    vllm-rlpatch kv-pin --model PATH [--trainer-reserve-gib N] [--margin-gib M] [--level 1|2]
                        [--rollout-tokens N | --max-concurrent-seqs S --seq-len L] [--json OUT]
                        [--refresh] [engine args ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from vllm_rlpatch import envs
from vllm_rlpatch.patches.kv_cache_pin import check_rollout
from vllm_rlpatch.tools import options, usermodel
from vllm_rlpatch.tools.doctor import engine_parser
from vllm_rlpatch.versions import vllm_info

GiB = 1 << 30
ALIGN = 256 << 20  # pins are rounded down to 256 MiB
PROBE_KV = 2 * GiB  # KV cache of the measuring engine
DEFAULT_MARGIN_GIB = 2.0
PROMPTS = ["The quick brown fox", "Once upon a time", "In a distant galaxy", "The capital of France is"]


class KvPinError(RuntimeError):
    """The pin cannot be sized or verified (a message for the user, exit code 1)."""


class UsageError(ValueError):
    """Bad input (exit code 2)."""


# ---------------------------------------------------------------------------------------------------------
# What a backend provides: the real GPU (CudaBackend) or, in tests, a simulated allocator.
class Engine(Protocol):
    def memory(self) -> dict[str, Any]: ...  # worker view: pools {tag: bytes}, kv_bytes, kv_tokens, ...
    def generate(self, max_tokens: int) -> tuple[list[list[int]], float]: ...  # greedy token ids, seconds
    def sleep(self, level: int) -> None: ...
    def wake_up(self) -> None: ...  # raises when the wake-up fails
    def shutdown(self) -> None: ...


class Backend(Protocol):
    def device(self) -> dict[str, Any]: ...  # {"name", "total"}
    def used(self) -> int: ...  # device-wide bytes in use now
    def start(self, kv_bytes: int) -> Engine: ...  # an engine with sleep mode and this KV pin
    def hold(self, nbytes: int) -> Any: ...  # the trainer's reserve, allocated on the same device
    def release(self, handle: Any) -> None: ...
    def identity(self) -> dict[str, Any]: ...  # what the cached result depends on (model, args, versions)


@dataclasses.dataclass
class Measurement:
    device: str
    total: int
    baseline_used: int  # device bytes in use before the engine started (other processes, this one's context)
    kv_probe: int  # KV bytes vLLM allocated for the probe
    peak: int  # the engine's device bytes after start + warm-up (weights, KV probe, context, activations, graphs)
    pools: dict[str, int]  # sleep-mode pools by tag
    asleep: int  # the engine's device bytes while asleep
    tokens_per_byte: float  # KV capacity per byte (from the probe)

    @property
    def non_kv(self) -> int:
        return self.peak - self.kv_probe


def derive(m: Measurement, reserve: int, margin: int) -> dict[str, Any]:
    """The pin and its budget: at wake-up and while generating, with the trainer's reserve held,
    ``baseline + (engine peak - KV probe) + pin + reserve + margin <= total``."""
    room = m.total - m.baseline_used - m.non_kv - reserve - margin
    pin = (room // ALIGN) * ALIGN
    budget = {"total": m.total, "used_by_others": m.baseline_used, "engine_without_kv": m.non_kv,
              "trainer_reserve": reserve, "margin": margin, "room_for_kv": room, "pin": pin}
    if pin < ALIGN:
        raise KvPinError(
            f"no room for a KV cache: {envs.format_size(m.total)} on {m.device} = "
            f"{envs.format_size(m.baseline_used)} used by others + {envs.format_size(m.non_kv)} engine without KV "
            f"(weights {envs.format_size(m.pools.get('weights', 0))}) + trainer reserve {envs.format_size(reserve)} "
            f"+ margin {envs.format_size(margin)} leaves {envs.format_size(max(room, 0))}; lower the reserve "
            "or the margin, or shard the model (tensor parallel)")
    return budget


def _log(progress: bool, t0: float, msg: str) -> None:
    if progress:
        print(f"[kv-pin {time.time() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def measure(backend: Backend, *, progress: bool = True, t0: float | None = None) -> Measurement:
    t0 = time.time() if t0 is None else t0
    dev = backend.device()
    baseline = backend.used()
    _log(progress, t0, f"{dev['name']}: {envs.format_size(dev['total'])}, {envs.format_size(baseline)} in use "
                       f"before the engine; starting the measuring engine (sleep mode, KV probe "
                       f"{envs.format_size(PROBE_KV)})")
    try:
        eng = backend.start(PROBE_KV)
    except Exception as e:
        raise KvPinError(f"the measuring engine did not start: {type(e).__name__}: {str(e).splitlines()[0][:500]} "
                         "(engine arguments go after the kv-pin options, e.g. --gpu-memory-utilization when the GPU "
                         "is shared)") from e
    try:
        eng.generate(32)  # warm-up: the activation peak stays in PyTorch's cache
        mem = eng.memory()
        peak = backend.used() - baseline
        pools = dict(mem.get("pools") or {})
        kv = int(pools.get("kv_cache") or mem.get("kv_bytes") or PROBE_KV)
        _log(progress, t0, f"awake: engine {envs.format_size(peak)} (weights {envs.format_size(pools.get('weights', 0))}, "
                           f"KV probe {envs.format_size(kv)}, {mem.get('kv_tokens', 0):,} tokens); sleeping")
        eng.sleep(1)
        asleep = backend.used() - baseline
        _log(progress, t0, f"asleep: engine {envs.format_size(asleep)}")
        eng.wake_up()
    finally:
        eng.shutdown()
    tokens = int(mem.get("kv_tokens") or 0)
    return Measurement(device=dev["name"], total=int(dev["total"]), baseline_used=int(baseline), kv_probe=kv,
                       peak=int(peak), pools=pools, asleep=int(asleep),
                       tokens_per_byte=(tokens / kv) if kv else 0.0)


def verify(backend: Backend, pin: int, reserve: int, level: int, *, progress: bool = True,
           t0: float | None = None) -> dict[str, Any]:
    """One real cycle at ``pin``: generate, sleep, allocate the reserve, wake, generate again."""
    t0 = time.time() if t0 is None else t0
    _log(progress, t0, f"verifying {envs.format_size(pin)}: start, generate, sleep({level}), hold the trainer "
                       f"reserve {envs.format_size(reserve)}, wake")
    res: dict[str, Any] = {"pin": pin, "ok": False}
    eng = None
    held = None
    try:
        eng = backend.start(pin)
        before, gen_s = eng.generate(64)
        mem = eng.memory()
        res.update(kv_tokens=int(mem.get("kv_tokens") or 0), kv_bytes=int(mem.get("kv_bytes") or 0),
                   num_blocks=mem.get("kv_num_blocks"), block_size=mem.get("kv_block_size"))
        res["tokens_per_s_before"] = round(sum(len(t) for t in before) / gen_s, 1) if gen_s else None
        t = time.time()
        eng.sleep(level)
        res["sleep_s"] = round(time.time() - t, 2)
        held = backend.hold(reserve) if reserve else None
        res["free_while_trainer_holds_reserve"] = int(backend.device()["total"] - backend.used())
        t = time.time()
        try:
            eng.wake_up()
        except Exception as e:  # the wake-up OOM this command exists to prevent
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            _log(progress, t0, f"wake-up FAILED at {envs.format_size(pin)}: {res['error']}")
            return res
        res["wake_s"] = round(time.time() - t, 2)
        if level == 2:  # weights were discarded: a trainer pushes new ones before generating
            res["outputs_identical"] = None
        else:
            after, _ = eng.generate(64)
            res["outputs_identical"] = after == before
        res["ok"] = res["outputs_identical"] in (True, None)
        if not res["ok"]:
            res["error"] = "greedy outputs changed across sleep/wake"
        _log(progress, t0, f"wake-up ok in {res['wake_s']} s; outputs identical: {res['outputs_identical']}")
        return res
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        _log(progress, t0, f"verification at {envs.format_size(pin)} failed: {res['error']}")
        return res
    finally:
        if held is not None:
            backend.release(held)
        if eng is not None:
            try:
                eng.shutdown()
            except Exception:
                pass


def step_down(pin: int, margin: int) -> int:
    return max(0, ((pin - max(margin, pin // 10)) // ALIGN) * ALIGN)


def size_pin(backend: Backend, *, reserve: int, margin: int, level: int = 1, rollout_tokens: int | None = None,
             progress: bool = True) -> dict[str, Any]:
    """Measure, derive, verify (and step down once). Raises :class:`KvPinError` if no pin wakes."""
    t0 = time.time()
    m = measure(backend, progress=progress, t0=t0)
    budget = derive(m, reserve, margin)
    attempts = [verify(backend, budget["pin"], reserve, level, progress=progress, t0=t0)]
    if not attempts[-1]["ok"]:
        lower = step_down(budget["pin"], margin)
        if lower >= ALIGN:
            _log(progress, t0, f"stepping down once to {envs.format_size(lower)}")
            attempts.append(verify(backend, lower, reserve, level, progress=progress, t0=t0))
    ok = attempts[-1]
    result: dict[str, Any] = {
        "measurement": dataclasses.asdict(m), "budget": budget, "attempts": attempts, "level": level,
        "trainer_reserve": reserve, "margin": margin, "rollout_tokens": rollout_tokens,
        "seconds": round(time.time() - t0, 1), "identity": backend.identity(),
    }
    if not ok["ok"]:
        result["pin"] = None
        raise KvPinError(
            "no verified pin: the wake-up failed at " + " and ".join(envs.format_size(a["pin"]) for a in attempts)
            + f" ({ok.get('error')}); something else allocates at wake-up or the trainer reserve is larger than "
            "declared: raise --margin-gib or --trainer-reserve-gib", result)
    result["pin"] = ok["pin"]
    result["kv_tokens"] = ok.get("kv_tokens")
    result["too_small"] = _too_small(ok.get("kv_tokens"), rollout_tokens)
    return result


def _too_small(tokens: int | None, rollout: int | None) -> str | None:
    return check_rollout(int(tokens), rollout) if tokens else None


# ---------------------------------------------------------------------------------------------------------
# Cache of results
def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-rlpatch" / "kv-pin"


def cache_key(identity: dict[str, Any], reserve: int, margin: int, level: int) -> str:
    blob = json.dumps({"identity": identity, "reserve": reserve, "margin": margin, "level": level}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


# ---------------------------------------------------------------------------------------------------------
# The worker side (worker extension ``rlpatch_memory``)
# ---------------------------------------------------------------------------------------------------------
# Real vLLM on a CUDA GPU
class CudaBackend:
    """Engines are ``vllm.LLM`` in this process (the engine core and worker in their own processes, as in
    colocated RL); the trainer reserve is a tensor this process allocates on the same GPU."""

    def __init__(self, model: str, engine_argv: list[str]) -> None:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("kv-pin needs a CUDA GPU: vLLM's sleep mode (what a colocated trainer uses) is CUDA/ROCm "
                             "only. On this machine set VLLM_RLPATCH_KV_CACHE_BYTES yourself (doctor shows the "
                             "capacity it gives)")
        self.torch = torch
        self.model, self.engine_argv = model, list(engine_argv)
        self._kwargs: dict[str, Any] | None = None  # parsed when an engine starts: a cached result needs none
        torch.cuda.init()
        torch.cuda.mem_get_info()  # this process's CUDA context belongs to the baseline

    @staticmethod
    def _llm_kwargs(model: str, engine_argv: list[str]) -> dict[str, Any]:
        from vllm.engine.arg_utils import EngineArgs

        parser = EngineArgs.add_cli_args(engine_parser())
        ea = EngineArgs.from_cli_args(parser.parse_args(["--model", model, *engine_argv]))
        stock = EngineArgs.from_cli_args(parser.parse_args(["--model", model]))  # the CLI's own defaults
        kw = {f.name: getattr(ea, f.name) for f in dataclasses.fields(ea)
              if f.init and getattr(ea, f.name) != getattr(stock, f.name)}
        kw["model"] = model
        for bad in ("kv_cache_memory_bytes", "enable_sleep_mode"):
            if bad in kw:
                raise UsageError(f"--{bad.replace('_', '-')} is what kv-pin sets; leave it out of the engine args")
        return kw

    def device(self) -> dict[str, Any]:
        free, total = self.torch.cuda.mem_get_info()
        return {"name": self.torch.cuda.get_device_name(), "total": int(total)}

    def used(self) -> int:
        self.torch.cuda.synchronize()
        free, total = self.torch.cuda.mem_get_info()
        return int(total - free)

    def start(self, kv_bytes: int) -> "_CudaEngine":
        from vllm import LLM

        if self._kwargs is None:
            self._kwargs = self._llm_kwargs(self.model, self.engine_argv)
        llm = LLM(**self._kwargs, enable_sleep_mode=True, kv_cache_memory_bytes=int(kv_bytes))
        return _CudaEngine(llm)

    def hold(self, nbytes: int) -> Any:
        return self.torch.empty(int(nbytes), dtype=self.torch.uint8, device="cuda")

    def release(self, handle: Any) -> None:
        del handle
        self.torch.cuda.empty_cache()

    def identity(self) -> dict[str, Any]:
        cfg = Path(self.model) / "config.json"
        return {"model": os.path.realpath(self.model) if os.path.exists(self.model) else self.model,
                "model_config_sha": hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else None,
                "engine_args": self.engine_argv, "vllm": vllm_info().raw_version, "torch": self.torch.__version__,
                "gpu": self.device()}


class _CudaEngine:
    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def memory(self) -> dict[str, Any]:
        return self.llm.collective_rpc("rlpatch_memory")[0]

    def generate(self, max_tokens: int) -> tuple[list[list[int]], float]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.time()
        outs = self.llm.generate(PROMPTS * 8, sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.time() - t

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        import gc

        llm, self.llm = self.llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        gc.collect()
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------------
# Command line
def _gib(name: str):
    def parse(raw: str) -> float:
        try:
            v = float(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of GiB, got {raw!r}") from None
        if v < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {raw!r}")
        return v

    return parse


def _tokens(raw: str) -> int:
    try:
        return envs.parse_token_count(raw, "--rollout-tokens")
    except envs.EnvError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(name: str):
    def parse(raw: str) -> int:
        try:
            v = int(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {raw!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be > 0, got {raw!r}")
        return v

    return parse


def parser() -> argparse.ArgumentParser:
    ap = options.parser(
        "vllm-rlpatch kv-pin",
        "Measure the largest kv_cache_memory_bytes that survives sleep -> trainer reserve -> wake on "
                    "this GPU; print it with its KV capacity in tokens. Unknown options are vLLM engine args.")
    usermodel.add_model_options(ap, required=True)
    ap.add_argument("--trainer-reserve-gib", type=_gib("--trainer-reserve-gib"), default=0.0,
                    help="GiB the trainer keeps on this GPU while vLLM is awake (allocated during the check)")
    ap.add_argument("--margin-gib", type=_gib("--margin-gib"), default=DEFAULT_MARGIN_GIB,
                    help="headroom kept free besides the reserve")
    ap.add_argument("--level", type=int, choices=(1, 2), default=1, help="sleep level the trainer loop uses")
    ap.add_argument("--rollout-tokens", type=_tokens, default=None,
                    help="tokens the rollout keeps in flight (262144, 256k, or 256x4096)")
    ap.add_argument("--max-concurrent-seqs", type=_positive_int("--max-concurrent-seqs"), default=None,
                    help="with --seq-len: rollout tokens = sequences x (prompt + generation) length")
    ap.add_argument("--seq-len", type=_positive_int("--seq-len"), default=None,
                    help="prompt + generation tokens of one rollout sequence")
    ap.add_argument("--json", metavar="OUT", help="write the full result (measurement, budget, attempts) here")
    ap.add_argument("--refresh", action="store_true", help="ignore a cached result and measure again")
    options.add_log_options(ap)
    return ap


def _report(r: dict[str, Any], cached: bool) -> str:
    pin = r["pin"]
    ok = r["attempts"][-1]
    lines = [f"KV-cache pin: {envs.format_size(pin)} ({pin} bytes) -> {ok.get('kv_tokens') or 0:,} tokens"
             + (" (cached result)" if cached else ""),
             f"verified: sleep(level={r['level']}) -> trainer reserve {envs.format_size(r['trainer_reserve'])} held "
             f"-> wake_up ok in {ok.get('wake_s')} s; greedy outputs identical: {ok.get('outputs_identical')}"]
    if len(r["attempts"]) > 1:
        lines.append(f"  (first try at {envs.format_size(r['attempts'][0]['pin'])} failed to wake: "
                     f"{r['attempts'][0].get('error')}; stepped down once)")
    b = r["budget"]
    lines.append(f"budget: {envs.format_size(b['total'])} = others {envs.format_size(b['used_by_others'])} + engine "
                 f"without KV {envs.format_size(b['engine_without_kv'])} + KV + reserve "
                 f"{envs.format_size(b['trainer_reserve'])} + margin {envs.format_size(b['margin'])}")
    if r.get("too_small"):
        lines.append("WARNING: " + r["too_small"])
    lines.append(f"use: VLLM_RLPATCH_KV_CACHE_BYTES={pin}   (or kv_cache_memory_bytes={pin})")
    if r.get("rollout_tokens"):
        lines.append(f"     VLLM_RLPATCH_ROLLOUT_TOKENS={r['rollout_tokens']}   (start-up WARNs if a pin holds fewer)")
    return "\n".join(lines)


@options.scoped_log_level
def main(argv: list[str] | None = None, backend: Backend | None = None) -> int:
    ap = parser()
    args, engine_argv = ap.parse_known_args(argv)
    options.apply_log_options(args)
    if (args.max_concurrent_seqs is None) != (args.seq_len is None):
        ap.error("--max-concurrent-seqs and --seq-len go together")
    if args.max_concurrent_seqs is not None:
        if args.rollout_tokens is not None:
            ap.error("give --rollout-tokens or --max-concurrent-seqs/--seq-len, not both")
        args.rollout_tokens = args.max_concurrent_seqs * args.seq_len
    if backend is None:
        try:
            args.model = usermodel.resolve_for(args, "kv-pin")
        except usermodel.ToolError as e:
            print(f"vllm-rlpatch kv-pin: {e}", file=sys.stderr)
            return 2
    reserve, margin = int(args.trainer_reserve_gib * GiB), int(args.margin_gib * GiB)
    try:
        be = backend if backend is not None else CudaBackend(args.model, engine_argv)
        key = cache_key(be.identity(), reserve, margin, args.level)
        path = cache_dir() / f"{key}.json"
        cached = path.exists() and not args.refresh
        if not cached and isinstance(be, CudaBackend):
            be._kwargs = be._llm_kwargs(be.model, be.engine_argv)  # bad engine args fail before any engine starts
        if cached:
            result = json.loads(path.read_text())
            result["rollout_tokens"] = args.rollout_tokens
            result["too_small"] = _too_small(result.get("kv_tokens"), args.rollout_tokens)
        else:
            result = size_pin(be, reserve=reserve, margin=margin, level=args.level,
                              rollout_tokens=args.rollout_tokens, progress=not args.quiet)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            tmp.replace(path)
    except (UsageError, usermodel.ToolError) as e:  # ToolError: vLLM refused an engine argument
        print(f"vllm-rlpatch kv-pin: {e}", file=sys.stderr)
        return 2
    except KvPinError as e:
        print(f"vllm-rlpatch kv-pin: {e.args[0]}", file=sys.stderr)
        if args.json and len(e.args) > 1:
            Path(args.json).write_text(json.dumps(e.args[1], indent=1))
        return 1
    result["cached"] = cached
    result["cache_file"] = str(path)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(_report(result, cached))
    return 0
