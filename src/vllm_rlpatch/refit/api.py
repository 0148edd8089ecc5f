"""``push_weights`` / ``weight_version``: one weight-update API for every vLLM the plugin supports.

The work splits in two halves that run where the data and the engine are:

* the **sender** (always in the caller's process): turns ``named_tensors`` into metadata and moves the
  bytes with the chosen transport (shared memory, a ``torch.distributed`` broadcast, CUDA IPC handles);
* the **coordinator** (in the process that owns the engine's front end: the caller's for a ``vllm.LLM`` or
  ``AsyncLLM``, the actor's for a Ray handle, the API server's for a URL): runs the worker RPCs
  ``rlpatch_refit_prepare`` -> ``rlpatch_refit_commit`` (-> ``abort``/``release`` with tensor parallelism),
  decides what the engine holds afterwards and keeps the engine from generating with mixed weights.

The coordinator is written once, as a generator that yields RPCs (:func:`coordinate`), and driven either
synchronously (``LLM.collective_rpc``) or asynchronously (``AsyncLLM.collective_rpc``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Generator, Iterable

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import transports as T

logger = logging.getLogger("vllm.rlpatch")

MODES = ("atomic", "direct")
INFLIGHT = ("refuse", "abort", "keep", "recompute")
TRANSPORTS = ("auto", "shm", "dist", "cuda_ipc")


@dataclasses.dataclass
class RefitReport:
    """What one ``push_weights`` did. ``seconds`` is wall time in the caller; ``gbps`` = bytes / seconds."""

    ok: bool
    state: str  # committed | unchanged | restored | mixed
    version: int | None
    transport: str
    mode: str
    bytes: int
    tensors: int
    seconds: float
    gbps: float
    stages: dict[str, float]
    checks: list[str]
    peak_extra_device_bytes: int
    peak_extra_host_bytes: int
    aborted_requests: list[str]
    recomputed_requests: int
    workers: list[dict[str, Any]]
    message: str = ""
    buckets: int = 0  # shared-memory segments / broadcast buckets (a tensor larger than a bucket has its own)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ poison (front end)
_POISON: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def poison(front: Any, reason: str) -> None:
    try:
        _POISON[front] = reason
    except TypeError:
        pass
    logger.error("vllm-rlpatch: this engine refuses to generate until a good weight update lands: %s", reason)


def clear_poison(front: Any) -> None:
    try:
        _POISON.pop(front, None)
    except TypeError:
        pass


def poisoned(front: Any) -> str | None:
    try:
        return _POISON.get(front)
    except TypeError:
        return None


# ------------------------------------------------------------------------------------------ coordinator
Rpc = tuple[str, tuple, dict]


def coordinate(req: dict[str, Any]) -> Generator[Rpc, list, dict[str, Any]]:
    """Yield ``(method, args, kwargs)`` worker RPCs; receive their per-worker results; return the outcome."""
    t0 = time.perf_counter()
    rpc_kw = {"inflight": req.get("inflight")}
    if req.get("workers") == 1 and req.get("mode") == "direct":
        # one worker, nothing to agree on across ranks: prepare and commit in a single round trip
        res = yield ("rlpatch_refit_commit", (req["txid"],),
                     {"version": req.get("version"), "release": True, "request": req, **rpc_kw})
        out: dict[str, Any] = {"workers": res, "seconds_commit": time.perf_counter() - t0}
        bad = [r for r in res if not r.get("ok")]
        if not bad:
            out.update(ok=True, state="committed", version=max((r.get("version") or 0) for r in res))
            return out
        r0 = bad[0]
        out.update(ok=False, state=r0.get("state", "unchanged"), kind=r0.get("kind", "commit"),
                   message=r0.get("message"), problems=r0.get("problems", []))
        return out
    prep = yield ("rlpatch_refit_prepare", (req,), dict(rpc_kw))
    t_prep = time.perf_counter() - t0
    bad = [r for r in prep if not r.get("ok")]
    if bad:
        yield ("rlpatch_refit_abort", (req["txid"],), {})
        r0 = bad[0]
        return {"ok": False, "state": "unchanged", "kind": r0.get("kind", "validation"), "message": r0.get("message"),
                "problems": r0.get("problems", []), "workers": prep, "seconds_prepare": t_prep}
    n = len(prep)
    t1 = time.perf_counter()
    res = yield ("rlpatch_refit_commit", (req["txid"],), {"version": req.get("version"), "release": n == 1, **rpc_kw})
    t_commit = time.perf_counter() - t1
    failed = [r for r in res if not r.get("ok")]
    out: dict[str, Any] = {"workers_prepare": prep, "workers": res, "seconds_prepare": t_prep,
                           "seconds_commit": t_commit}
    if not failed:
        if n > 1:
            yield ("rlpatch_refit_release", (req["txid"],), {})
        out.update(ok=True, state="committed", version=max((r.get("version") or 0) for r in res))
        return out
    states = {r.get("state") for r in failed}
    if n > 1:
        rb = yield ("rlpatch_refit_abort", (req["txid"],), {})
        out["workers_abort"] = rb
        states |= {r.get("state") for r in rb if r.get("state") not in ("unchanged", None)}
    state = "mixed" if "mixed" in states else ("restored" if "restored" in states else "unchanged")
    r0 = failed[0]
    out.update(ok=False, state=state, kind=r0.get("kind", "commit"), message=r0.get("message"),
               problems=r0.get("problems", []))
    return out


def run_sync(gen: Generator, rpc: Callable[[str, tuple, dict], list]) -> Any:
    try:
        call = next(gen)
        while True:
            method, args, kwargs = call
            call = gen.send(rpc(method, args, kwargs))
    except StopIteration as stop:
        return stop.value


async def run_async(gen: Generator, rpc) -> Any:
    try:
        call = next(gen)
        while True:
            method, args, kwargs = call
            call = gen.send(await rpc(method, args, kwargs))
    except StopIteration as stop:
        return stop.value


# ------------------------------------------------------------------------------------------ targets
class _Target:
    kind = "?"
    front: Any = None

    def same_host(self) -> bool:
        return True

    def describe(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def version(self) -> int:
        raise NotImplementedError


def _rpc_error_to_refit(e: BaseException, what: str) -> P.RefitError:
    msg = str(e)
    if "asleep" in msg:
        return P.RefitError(msg.split("\n")[0], kind="refused")
    if "refused" in msg:
        return P.RefitError(msg.split("\n")[0], kind="refused")
    if "has no attribute 'rlpatch_" in msg or "rlpatch_refit" in msg and "AttributeError" in msg:
        return P.RefitError(f"{what}: the engine's workers have no rlpatch_* methods: vllm-rlpatch is not active in "
                            "the engine's processes (not installed there, VLLM_PLUGINS excludes 'rlpatch', or "
                            "VLLM_RLPATCH_ENABLED=0 / VLLM_RLPATCH_WORKER_EXTENSION=0)", kind="refused")
    return P.RefitError(f"{what}: {type(e).__name__}: {msg}", kind="commit")


class LocalTarget(_Target):
    """A ``vllm.LLM``/``LLMEngine`` in this process (synchronous RPCs)."""

    kind = "llm"

    def __init__(self, obj: Any):
        self.obj = obj
        self.front = getattr(obj, "llm_engine", obj)

    def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        return self.front.collective_rpc(method, args=args, kwargs=kwargs)

    def call(self, method: str) -> list:
        return self.rpc(method, (), {})

    def describe(self) -> list[dict[str, Any]]:
        try:
            return self.rpc("rlpatch_refit_describe", (), {})
        except Exception as e:  # noqa: BLE001
            raise _rpc_error_to_refit(e, "describe") from e

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return coordinate_on(self.front, req, lambda g: run_sync(g, self.rpc))

    def version(self) -> int:
        return max(int(v) for v in self.rpc("rlpatch_weight_version", (), {}))


class AsyncTarget(_Target):
    """A ``vllm.v1.engine.async_llm.AsyncLLM``: RPCs are coroutines on its event loop."""

    kind = "async_llm"

    def __init__(self, obj: Any):
        self.obj = self.front = obj

    async def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        return await self.obj.collective_rpc(method, args=args, kwargs=kwargs)

    def _loop(self) -> asyncio.AbstractEventLoop:
        for attr in ("output_handler", "_output_handler"):
            task = getattr(self.obj, attr, None)
            if task is not None and hasattr(task, "get_loop"):
                return task.get_loop()
        loop = getattr(self.obj, "_rlpatch_loop", None)
        if loop is not None:
            return loop
        raise P.RefitError("push_weights(AsyncLLM) from synchronous code needs the engine's event loop; none found "
                           "(it starts with the first request). Call `await push_weights_async(...)` from the "
                           "engine's loop instead", kind="validation")

    def _sync(self, coro):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self._loop()
        if running is loop:
            coro.close()
            raise P.RefitError("push_weights() called on the AsyncLLM's own event loop would block it: use "
                               "`await vllm_rlpatch.refit.push_weights_async(...)`", kind="validation")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def call(self, method: str) -> list:
        return self._sync(self.rpc(method, (), {}))

    def describe(self) -> list[dict[str, Any]]:
        return self._sync(self.describe_async())

    async def describe_async(self) -> list[dict[str, Any]]:
        try:
            return await self.rpc("rlpatch_refit_describe", (), {})
        except Exception as e:  # noqa: BLE001
            raise _rpc_error_to_refit(e, "describe") from e

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._sync(self.run_async(req))

    async def run_async(self, req: dict[str, Any]) -> dict[str, Any]:
        return await coordinate_on_async(self.front, req, lambda g: run_async(g, self.rpc))

    def version(self) -> int:
        return self._sync(self.version_async())

    async def version_async(self) -> int:
        return max(int(v) for v in await self.rpc("rlpatch_weight_version", (), {}))


def _is_async_llm(obj: Any) -> bool:
    return type(obj).__name__ in ("AsyncLLM", "AsyncLLMEngine") and hasattr(obj, "collective_rpc")


def _is_ray_handle(obj: Any) -> bool:
    return type(obj).__name__ == "ActorHandle" and type(obj).__module__.startswith("ray")


def resolve(target: Any) -> _Target:
    if isinstance(target, _Target):
        return target
    if isinstance(target, str):
        if target.startswith(("http://", "https://")):
            from vllm_rlpatch.refit.http import HttpTarget

            return HttpTarget(target)
        raise P.RefitError(f"target {target!r}: a string target must be the base URL of `vllm serve` "
                           "(http://host:port)", kind="validation")
    if _is_ray_handle(target):
        from vllm_rlpatch.refit.ray import RayTarget

        return RayTarget(target)
    if _is_async_llm(target):
        return AsyncTarget(target)
    if hasattr(target, "collective_rpc") and (hasattr(target, "llm_engine") or hasattr(target, "engine_core")):
        return LocalTarget(target)
    raise P.RefitError(f"unsupported target {type(target).__name__}: pass a vllm.LLM, an AsyncLLM, a Ray actor "
                       "handle hosting one, or the base URL of `vllm serve`", kind="validation")


# ------------------------------------------------------------------------------------------ coordinator wrappers
def _finish(front: Any, req: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    from vllm_rlpatch.hooks import weights
    from vllm_rlpatch.hooks.layerwise import MIXED_MARK

    if out.get("ok"):
        clear_poison(front)
        weights.fire(front, "rlpatch_refit", "frontend", version=out.get("version"))
    elif out.get("state") == "mixed":
        msg = out.get("message") or ""
        poison(front, msg if MIXED_MARK in msg else f"{MIXED_MARK} {msg}")
    return out


def coordinate_on(front: Any, req: dict[str, Any], drive: Callable[[Generator], dict]) -> dict[str, Any]:
    try:
        out = drive(coordinate(req))
    except Exception as e:  # noqa: BLE001 - an RPC raised (engine-core refusal, dead worker, ...)
        err = _rpc_error_to_refit(e, "refit")
        return {"ok": False, "state": "unchanged", "kind": err.kind, "message": str(err), "problems": []}
    return _finish(front, req, out)


async def coordinate_on_async(front: Any, req: dict[str, Any], drive) -> dict[str, Any]:
    try:
        out = await drive(coordinate(req))
    except Exception as e:  # noqa: BLE001
        err = _rpc_error_to_refit(e, "refit")
        return {"ok": False, "state": "unchanged", "kind": err.kind, "message": str(err), "problems": []}
    return _finish(front, req, out)


# ------------------------------------------------------------------------------------------ zero-pack
class EngineLayout:
    """Trainer tensors that already live in the engine's layout: one CUDA buffer shaped like the engine's
    parameters (fused qkv/gate_up included), with a view per trainer tensor name. Put your model's
    parameters in the views (``param.data = layout.views[name]``) or copy into them; ``push_weights(target,
    layout)`` then sends one IPC handle and the engine copies the buffer into its parameters: no packing,
    no per-tensor handles. Needs the same GPU, tensor parallel 1, and a copy plan the engine verified on an
    earlier complete update (the first ``push_weights`` of ordinary tensors records it)."""

    def __init__(self, target: Any, device: Any = None):
        tgt = resolve(target)
        if tgt.kind == "http":
            raise P.RefitError("EngineLayout needs CUDA IPC, which is not offered over HTTP", kind="validation")
        descs = tgt.call("rlpatch_refit_layout")
        if len(descs) != 1:
            raise P.RefitError(f"EngineLayout needs tensor parallel 1 (the engine has {len(descs)} workers)",
                               kind="validation")
        d = descs[0]
        if not d.get("ok"):
            raise P.RefitError(f"no engine layout: {d.get('message')} (push one complete update of ordinary "
                               "tensors first: it records and verifies the copy plan)", kind="validation")
        dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.dtype = P.dtype_of(d["dtype"])
        self.buffer = torch.zeros(int(d["numel"]), dtype=self.dtype, device=dev)
        self.spec_views = {n: tuple(v) for n, v in d["views"].items()}
        self.views = {n: self.buffer.as_strided(size, stride, off) for n, (size, stride, off) in
                      self.spec_views.items()}
        self._handle = None

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return sorted(self.views.items())

    def copy_from(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in (named_tensors.items() if isinstance(named_tensors, dict) else named_tensors):
            self.views[name].copy_(t)

    def handle(self):
        if self._handle is None:
            self._handle = T.ipc_handles([("buffer", self.buffer)])[0]
        return self._handle


# ------------------------------------------------------------------------------------------ sender
def _collect(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, dict):
        items = list(named_tensors.items())
    else:
        items = list(named_tensors)
    out = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise P.RefitError(f"named_tensors[{i}] is a {type(item).__name__}, not a (name, tensor) pair",
                               kind="validation")
        name, t = item
        if not isinstance(name, str):
            raise P.RefitError(f"named_tensors[{i}]: name {name!r} is not a string", kind="validation")
        if not isinstance(t, torch.Tensor):
            raise P.RefitError(f"{name}: a {type(t).__name__}, not a torch.Tensor", kind="validation")
        if getattr(t, "is_meta", False):
            raise P.RefitError(f"{name}: a meta tensor has no data", kind="validation")
        if type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor"):
            raise P.RefitError(f"{name}: a DTensor/FSDP shard; gather the full tensor (full_tensor()) first",
                               kind="validation")
        out.append((name, t))  # the object itself: a CUDA IPC handle is reused while it lives
    return out


def _metas(tensors: list[tuple[str, torch.Tensor]]) -> list[P.TensorMeta]:
    return [P.TensorMeta(n, P.dtype_name(t.dtype), list(t.shape), t.numel() * t.element_size()) for n, t in tensors]


_SCHEMAS: "weakref.WeakKeyDictionary[Any, P.Schema]" = weakref.WeakKeyDictionary()
_POOLS: dict[Any, T.ShmPool] = {}  # per target: shared-memory segments reused across its updates


def _pool_for(tgt: "_Target") -> T.ShmPool:
    key = id(tgt.front) if tgt.front is not None else getattr(tgt, "url", None) or id(getattr(tgt, "handle", tgt))
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = T.ShmPool()
    return pool


def _pick_transport(transport: str, tensors, target: _Target) -> str:
    if transport not in TRANSPORTS:
        raise P.RefitError(f"transport={transport!r}: use one of {', '.join(TRANSPORTS)}", kind="validation")
    if transport != "auto":
        return transport
    on_cuda = any(t.is_cuda for _, t in tensors)
    if target.same_host():
        return "cuda_ipc" if on_cuda and target.kind != "http" else "shm"
    return "dist"


def _report(out: dict[str, Any], *, transport: str, mode: str, nbytes: int, n: int, seconds: float,
            stages: dict[str, float], host_extra: int) -> RefitReport:
    workers = out.get("workers") or []
    checks: list[str] = []
    for w in (out.get("workers_prepare") or []) + workers:
        for c in w.get("checks", []):
            if c not in checks:
                checks.append(c)
    w_stages: dict[str, float] = {}
    for w in (out.get("workers_prepare") or []) + workers:
        for k, v in (w.get("stages") or {}).items():
            w_stages[k] = max(w_stages.get(k, 0.0), float(v))
    st = dict(stages)
    st.update({f"worker_{k}": v for k, v in w_stages.items()})
    for k in ("seconds_prepare", "seconds_commit"):
        if k in out:
            st[k.removeprefix("seconds_") + "_rpc"] = out[k]
    ec = {}
    for w in workers:
        if isinstance(w.get("engine_core"), dict):
            ec = w["engine_core"]
    return RefitReport(
        ok=bool(out.get("ok")), state=out.get("state", "unchanged"), version=out.get("version"), transport=transport,
        mode=mode, bytes=nbytes, tensors=n, seconds=seconds, gbps=(nbytes / seconds / 1e9) if seconds > 0 else 0.0,
        stages=st, checks=checks,
        peak_extra_device_bytes=max([int(w.get("extra_device_bytes") or 0) for w in workers] or [0]),
        peak_extra_host_bytes=host_extra + sum(int(w.get("extra_host_bytes") or 0) for w in workers),
        aborted_requests=list(ec.get("aborted", [])), recomputed_requests=int(ec.get("recomputed", 0)),
        workers=workers or list(out.get("workers_prepare") or []), message=out.get("message") or "")


def _validate_args(mode: str, inflight: str | None, version: Any) -> None:
    if mode not in MODES:
        raise P.RefitError(f"mode={mode!r}: use 'atomic' (default: staged, validated, rolled back on failure) or "
                           "'direct' (written straight into the model, checked after)", kind="validation")
    if inflight is not None and inflight not in INFLIGHT:
        raise P.RefitError(f"inflight={inflight!r}: use one of {', '.join(INFLIGHT)} (or None for the engine's "
                           "VLLM_RLPATCH_INFLIGHT)", kind="validation")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
        raise P.RefitError(f"version={version!r}: a positive int greater than the engine's current version",
                           kind="validation")


def push_weights(target: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *, transport: str = "auto",
                 mode: str = "atomic", inflight: str | None = None, version: int | None = None,
                 partial: bool = False, allow_cast: bool = False, bucket_bytes: int | None = None,
                 verify: bool = True, dist_host: str | None = None, dist_port: int = 0, dist_backend: str | None = None,
                 timeout_s: float = 300.0, raise_on_error: bool = True) -> RefitReport:
    """Push new weights (trainer/Hugging Face naming) into a vLLM engine.

    ``target``: a ``vllm.LLM``, an ``AsyncLLM`` (from another thread than its loop; on the loop use
    :func:`push_weights_async`), a Ray actor handle hosting one, or ``"http://host:port"`` of ``vllm serve``
    started with the plugin. ``mode``: ``atomic`` (staged, validated, rolled back on any failure with the old
    weights' fingerprint verified) or ``direct`` (written straight in, checked after; on failure the engine
    refuses to generate until a good update lands). ``inflight``: what happens to requests running at the
    update (``refuse``, ``abort``, ``keep``, ``recompute``; default the engine's ``VLLM_RLPATCH_INFLIGHT``).
    ``version``: the weight version the engine reports afterwards (default: previous + 1). ``partial``:
    allow a subset of whole layers. Raises :class:`RefitError` (``raise_on_error``) when the update did not
    land; the report is on the exception.
    """
    t0 = time.perf_counter()
    _validate_args(mode, inflight, version)
    tgt = resolve(target)
    layout = named_tensors if isinstance(named_tensors, EngineLayout) else None
    tensors = _collect(layout.named_tensors() if layout is not None else named_tensors)
    if not tensors:
        raise P.RefitError("the update contains no tensors", kind="validation")
    tr = "cuda_ipc_layout" if layout is not None else _pick_transport(transport, tensors, tgt)
    metas = _metas(tensors)
    stages: dict[str, float] = {}
    # metadata checked here first (no byte moves for a bad update); the workers check again
    t1 = time.perf_counter()
    schema = _schema_for(tgt)
    probs = P.validate_metadata(metas, schema, partial=partial, allow_cast=allow_cast)
    stages["validate_metadata"] = time.perf_counter() - t1
    if probs:
        out = {"ok": False, "state": "unchanged", "kind": "validation", "message": P.summarize(probs),
               "problems": probs}
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, 0, raise_on_error)
    req = {"txid": uuid.uuid4().hex, "mode": mode, "partial": partial, "allow_cast": allow_cast,
           "version": version, "inflight": inflight, "tensors": None, "transport": None, "verify": verify,
           "workers": _workers_of(tgt)}
    bucket = int(bucket_bytes or P.DEFAULT_BUCKET_BYTES)
    if tr == "shm":
        if not tgt.same_host():
            raise P.RefitError("transport='shm' needs the trainer and the engine on one host; this target is on "
                               "another host: use transport='dist' (or 'auto')", kind="validation")
        with T.ShmPack(tensors, metas, bucket, fingerprint=verify, pool=_pool_for(tgt)) as pack:
            stages["pack"] = pack.seconds_pack
            stages["fingerprint"] = pack.seconds_fingerprint
            req["tensors"] = [m.as_dict() for m in metas]
            req["transport"] = pack.spec()
            t2 = time.perf_counter()
            out = tgt.run(req)
            stages["engine"] = time.perf_counter() - t2
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, pack.nbytes, raise_on_error)
    if tr == "dist":
        n_workers = len(tgt.describe())
        host = dist_host or "127.0.0.1"
        backend = dist_backend or ("nccl" if any(t.is_cuda for _, t in tensors) else "gloo")
        sender = T.DistSender(tensors, metas, bucket, n_workers=n_workers, host=host, port=dist_port,
                              backend=backend, timeout_s=timeout_s, fingerprint=verify)
        stages["fingerprint"] = sender.seconds_fingerprint
        req["tensors"] = [m.as_dict() for m in metas]
        req["transport"] = sender.spec()
        sender.start()
        t2 = time.perf_counter()
        out = tgt.run(req)
        stages["engine"] = time.perf_counter() - t2
        sender.join(timeout=10)
        stages["send"] = sender.seconds_send
        if out.get("ok") and sender.error is not None:
            logger.warning("vllm-rlpatch: dist sender reported %r after a committed update", sender.error)
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, 0, raise_on_error)
    if tr == "cuda_ipc_layout":
        t1 = time.perf_counter()
        if verify:
            for m, f in zip(metas, P.fingerprints([t for _, t in tensors])):
                m.fingerprint = f
        stages["fingerprint"] = time.perf_counter() - t1
        req["tensors"] = [m.as_dict() for m in metas]
        req["transport"] = {"kind": "cuda_ipc_layout", "handle": layout.handle(),
                            "views": {n: list(v) for n, v in layout.spec_views.items()}}
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out = tgt.run(req)
        stages["engine"] = time.perf_counter() - t2
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, 0, raise_on_error)
    if tr == "cuda_ipc":
        if tgt.kind == "http":
            raise P.RefitError("transport='cuda_ipc' is not offered over HTTP (IPC handles would need pickle): use "
                               "shm or dist with a URL target, or cuda_ipc with a vllm.LLM/AsyncLLM/Ray target",
                               kind="validation")
        t1 = time.perf_counter()
        if verify:
            for m, f in zip(metas, P.fingerprints([t for _, t in tensors])):
                m.fingerprint = f
        stages["fingerprint"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        handles = T.ipc_handles(tensors)
        stages["ipc_handles"] = time.perf_counter() - t1
        req["tensors"] = [m.as_dict() for m in metas]
        req["transport"] = {"kind": "cuda_ipc", "handles": handles}
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out = tgt.run(req)
        stages["engine"] = time.perf_counter() - t2
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, 0, raise_on_error)
    raise P.RefitError(f"transport {tr!r} is not available for a {tgt.kind} target", kind="validation")


def _schema_for(tgt: _Target) -> P.Schema:
    key = tgt.front if tgt.front is not None else tgt
    try:
        s = _SCHEMAS.get(key)
    except TypeError:
        s = None
    if s is None:
        desc = tgt.describe()
        s = P.Schema.from_dict(desc[0]["schema"])
        s.workers = len(desc)  # type: ignore[attr-defined]
        try:
            _SCHEMAS[key] = s
        except TypeError:
            pass
    return s


def _workers_of(tgt: _Target) -> int | None:
    return getattr(_schema_for(tgt), "workers", None)


def _raise_or_report(out, tr, mode, tensors, metas, t0, stages, host_extra, raise_on_error) -> RefitReport:
    nbytes = sum(m.nbytes for m in metas)
    rep = _report(out, transport=tr, mode=mode, nbytes=nbytes, n=len(metas), seconds=time.perf_counter() - t0,
                  stages=stages, host_extra=host_extra)
    if tr in ("shm", "dist"):
        rep.buckets = len({m.segment for m in metas})
    if not rep.ok and raise_on_error:
        raise P.RefitError(f"weight update not applied ({rep.state}): {out.get('message')}", kind=out.get("kind",
                           "commit"), state=rep.state, problems=out.get("problems", []), report=rep)
    if rep.ok:
        logger.info("vllm-rlpatch: pushed %d tensors (%.1f MB) via %s/%s in %.3f s (%.2f GB/s) -> weight version %s",
                    rep.tensors, rep.bytes / 1e6, tr, mode, rep.seconds, rep.gbps, rep.version)
    return rep


async def push_weights_async(target: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], **kw) -> RefitReport:
    """:func:`push_weights` for an ``AsyncLLM`` from its own event loop (other targets run in a thread)."""
    if not _is_async_llm(target):
        return await asyncio.to_thread(push_weights, target, named_tensors, **kw)
    tgt = AsyncTarget(target)
    transport = kw.pop("transport", "auto")
    mode = kw.pop("mode", "atomic")
    inflight = kw.pop("inflight", None)
    version = kw.pop("version", None)
    partial = kw.pop("partial", False)
    allow_cast = kw.pop("allow_cast", False)
    bucket = int(kw.pop("bucket_bytes", None) or P.DEFAULT_BUCKET_BYTES)
    verify = kw.pop("verify", True)
    raise_on_error = kw.pop("raise_on_error", True)
    if kw:
        raise TypeError(f"push_weights_async: unsupported argument(s) {sorted(kw)} for an AsyncLLM on its loop")
    t0 = time.perf_counter()
    _validate_args(mode, inflight, version)
    tensors = _collect(named_tensors)
    tr = _pick_transport(transport, tensors, tgt)
    if tr != "shm":
        raise P.RefitError(f"push_weights_async on the engine's loop supports transport='shm' (got {tr!r})",
                           kind="validation")
    metas = _metas(tensors)
    stages: dict[str, float] = {}
    key = tgt.front
    schema = _SCHEMAS.get(key)
    if schema is None:
        schema = _SCHEMAS[key] = P.Schema.from_dict((await tgt.describe_async())[0]["schema"])
    probs = P.validate_metadata(metas, schema, partial=partial, allow_cast=allow_cast)
    if probs:
        out = {"ok": False, "state": "unchanged", "kind": "validation", "message": P.summarize(probs),
               "problems": probs}
        return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, 0, raise_on_error)
    req = {"txid": uuid.uuid4().hex, "mode": mode, "partial": partial, "allow_cast": allow_cast, "version": version,
           "inflight": inflight, "verify": verify}
    pack = await asyncio.to_thread(T.ShmPack, tensors, metas, bucket, verify, _pool_for(tgt))
    try:
        stages["pack"] = pack.seconds_pack
        stages["fingerprint"] = pack.seconds_fingerprint
        req["tensors"] = [m.as_dict() for m in metas]
        req["transport"] = pack.spec()
        t2 = time.perf_counter()
        out = await tgt.run_async(req)
        stages["engine"] = time.perf_counter() - t2
    finally:
        pack.close()
    return _raise_or_report(out, tr, mode, tensors, metas, t0, stages, pack.nbytes, raise_on_error)


def weight_version(target: Any) -> int:
    """The engine's current weight version (0 = the weights it started with), read from its workers."""
    return resolve(target).version()
