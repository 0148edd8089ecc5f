"""The engine side of a refit, run in every vLLM worker through the ``rlpatch_refit_*`` worker methods.

One update is a transaction in two RPCs (three with tensor parallelism):

``prepare(request)``
    validate the metadata against the model's schema (names, shapes, dtypes, duplicates, coverage) before
    any byte is read; open the transport's buffers; in ``atomic`` mode also receive every byte, check it
    (transport fingerprints, finite values, tied tensors equal) and snapshot the current weights.
``commit(txid, version)``
    write the weights through vLLM's own layerwise reload (which re-runs each layer's post-processing:
    CPU repacking, quantization) under :func:`vllm_rlpatch.hooks.layerwise.strict`; on success fire the
    weight-update event with the new version. ``atomic``: any failure restores the snapshot and verifies
    the old weights' fingerprint. ``direct``: bytes go straight from the transport into the model and the
    checks run afterwards; a failure leaves ``state="mixed"`` and the engine refuses to generate.
``abort(txid)``
    drop a prepared update, or roll back a committed one (another tensor-parallel rank failed).

Results are plain dicts (``ok``, ``state``, ``kind``, ``problems``, ``stages`` seconds, ``checks``...);
expected failures are reported, never raised, so the trainer side gets structured errors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from typing import Any, Iterable, Iterator

import torch

from vllm_rlpatch.refit import protocol as P

logger = logging.getLogger("vllm.rlpatch")

_REFITS: "weakref.WeakKeyDictionary[Any, WorkerRefit]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()


def for_worker(worker: Any) -> "WorkerRefit":
    with _LOCK:
        r = _REFITS.get(worker)
        if r is None:
            r = _REFITS[worker] = WorkerRefit(worker)
        return r


def model_of(worker: Any):
    runner = getattr(worker, "model_runner", None)
    get_model = getattr(runner, "get_model", None)
    if callable(get_model):
        return get_model()
    return getattr(runner, "model", None)


@contextlib.contextmanager
def vllm_config_ctx(worker: Any):
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None:
        yield
        return
    try:
        from vllm.config import set_current_vllm_config
    except ImportError:  # pragma: no cover
        yield
        return
    with set_current_vllm_config(cfg):
        yield


@contextlib.contextmanager
def lora_unwrapped(model):
    """vLLM's LoRA wrappers rename every base parameter (``x.weight`` -> ``x.base_layer.weight``), so the
    model's own ``load_weights`` cannot find checkpoint names in a LoRA engine (``There is no module or
    parameter named 'embed_tokens.weight'``). For the reload, put each wrapped base layer back in its
    parent's place; the wrappers keep referencing the same base modules, whose tensors are updated in place.
    """
    swaps = []
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            base = getattr(child, "base_layer", None)
            if isinstance(base, torch.nn.Module) and type(child).__name__.endswith("WithLoRA"):
                swaps.append((parent, child_name, child))
                parent._modules[child_name] = base
    try:
        yield len(swaps)
    finally:
        for parent, child_name, child in swaps:
            parent._modules[child_name] = child


# ------------------------------------------------------------------------------------------ snapshot
class Snapshot:
    """Everything a layer's post-processing can change: parameter/buffer data (cloned; written in place by
    the reload), the tensor objects and their ``.data`` (re-pointed by some processing), and the module's
    plain attributes (e.g. the CPU GEMM closure over a repacked weight). Restoring it gives back exactly
    the engine that was there, including state the fingerprint cannot see."""

    def __init__(self, model, device: str = "same"):
        self.names = []
        seen = set()
        for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
            if id(t) in seen or t.is_meta:
                continue
            seen.add(id(t))
            self.names.append((n, t))
        self.modules = []
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.nbytes = 0
        for mod in model.modules():
            attrs = {k: v for k, v in mod.__dict__.items()
                     if k not in ("_parameters", "_buffers", "_modules")}
            self.modules.append((mod, attrs, dict(mod._parameters), dict(mod._buffers),
                                 set(getattr(mod, "_non_persistent_buffers_set", ()))))
            for t in list(mod._parameters.values()) + list(mod._buffers.values()):
                if t is None or id(t) in self.data:
                    continue
                d = t.data
                if d.is_meta:
                    continue
                target = "cpu" if device == "cpu" else d.device
                self.data[id(t)] = (t, d, d.detach().to(target, copy=True))
                self.nbytes += d.numel() * d.element_size()

    def fingerprint(self) -> str:
        """The fingerprint :func:`weights_fingerprint` gave the model when the snapshot was taken."""
        named = []
        for n, t in self.names:
            rec = self.data.get(id(t))
            if rec is not None:
                named.append((n, rec[2]))
        named.sort(key=lambda x: x[0])
        fps = P.fingerprints([t for _, t in named])
        return P.combine(f"{n}={f}" for (n, _), f in zip(named, fps))

    def restore(self) -> None:
        for mod, attrs, params, buffers, nonpersistent in self.modules:
            for k in [k for k in mod.__dict__ if k not in attrs and k not in ("_parameters", "_buffers", "_modules")]:
                del mod.__dict__[k]
            mod.__dict__.update(attrs)
            mod._parameters.clear()
            mod._parameters.update(params)
            mod._buffers.clear()
            mod._buffers.update(buffers)
            if hasattr(mod, "_non_persistent_buffers_set"):
                mod._non_persistent_buffers_set.clear()
                mod._non_persistent_buffers_set.update(nonpersistent)
        with torch.no_grad():
            for t, d, saved in self.data.values():
                if t.data is not d:
                    t.data = d
                d.copy_(saved)


def _backup_place(model, dev: torch.device, want: str) -> str:
    """Where an atomic update keeps the old weights: on the device when it has room (a device-to-device
    copy), else in host memory; ``backup="cpu"``/``"device"`` force it."""
    if dev.type != "cuda" or want == "cpu":
        return "cpu" if dev.type == "cuda" else "same"
    if want == "device":
        return "same"
    need = sum(t.numel() * t.element_size() for t in model.parameters())
    free, _ = torch.cuda.mem_get_info(dev)
    return "same" if free > need * 1.2 + (1 << 30) else "cpu"


def weights_fingerprint(model) -> tuple[str, dict[str, str]]:
    named = []
    seen = set()
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        named.append((n, t))
    named.sort(key=lambda x: x[0])
    fps = P.fingerprints([t for _, t in named])
    per = dict(zip([n for n, _ in named], fps))
    return P.combine(f"{n}={f}" for n, f in per.items()), per


# ------------------------------------------------------------------------------------------ transports (receive side)
class Source:
    """Where an update's bytes are in this worker: ``tensors()`` yields ``(meta, tensor)`` in update order."""

    streaming = False
    extra_host_bytes = 0

    def open(self) -> None: ...

    def tensors(self) -> Iterator[tuple[P.TensorMeta, torch.Tensor]]:
        raise NotImplementedError

    def close(self) -> None: ...


_SHM_MAPS: dict[tuple, torch.Tensor] = {}  # the last update's mapped segments


class ShmSource(Source):
    def __init__(self, metas: list[P.TensorMeta], segments: list[dict[str, Any]]):
        self.metas, self.segments = metas, segments
        self.maps: list[torch.Tensor] = []

    def open(self) -> None:
        keep = {}
        for seg in self.segments:
            path, size = seg["path"], int(seg["size"])
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise P.RefitError(f"shared-memory segment {path} does not exist in the engine's worker (the trainer "
                                   "and the engine must share /dev/shm: same host, same container)",
                                   kind="transport") from None
            if st.st_size < size:
                raise P.RefitError(f"shared-memory segment {path} holds {st.st_size} bytes, {size} expected "
                                   "(truncated: did the sender die?)", kind="transport")
            key = (path, st.st_ino, size)
            m = _SHM_MAPS.get(key)
            if m is None:  # the trainer reuses its segments: keep them mapped (no page faults next time)
                m = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            keep[key] = m
            self.maps.append(m)
        _SHM_MAPS.clear()
        _SHM_MAPS.update(keep)

    def tensors(self):
        for m in self.metas:
            buf = self.maps[m.segment][m.offset: m.offset + m.nbytes]
            yield m, buf.view(P.dtype_of(m.dtype)).view(m.shape)

    def close(self) -> None:
        self.maps.clear()


class DistSource(Source):
    """Buckets broadcast by the trainer (rank 0) over a ``torch.distributed`` process group of its own
    (gloo between CPU processes/hosts, NCCL between GPUs), created for this update from a TCPStore the
    trainer hosts. Received into this worker's memory, bucket by bucket."""

    def __init__(self, metas, spec: dict[str, Any], rank: int, device: torch.device):
        self.metas, self.spec, self.rank, self.device = metas, spec, rank, device
        self.pg = None
        self.buffers: dict[int, torch.Tensor] = {}
        self.received = 0

    def open(self) -> None:
        import datetime

        import torch.distributed as dist

        s = self.spec
        timeout = datetime.timedelta(seconds=float(s.get("timeout_s", 120)))
        store = dist.TCPStore(s["host"], int(s["port"]), int(s["world_size"]), is_master=False, timeout=timeout)
        store = dist.PrefixStore(f"rlpatch/{s['txid']}", store)
        if s.get("backend", "gloo") == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            self.pg = dist.ProcessGroupNCCL(store, self.rank, int(s["world_size"]), opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, self.rank, int(s["world_size"]), timeout)

    def _receive(self, seg: int) -> torch.Tensor:
        size = int(self.spec["segments"][seg])
        dev = self.device if self.spec.get("backend") == "nccl" else torch.device("cpu")
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        try:
            from vllm_rlpatch.refit.transports import broadcast_opts

            self.pg.broadcast([buf], broadcast_opts()).wait()
        except Exception as e:
            raise P.RefitError(f"dist transport: bucket {seg + 1}/{len(self.spec['segments'])} did not arrive "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the sender "
                               "died or the network failed", kind="transport") from e
        self.received += 1
        self.extra_host_bytes += size if dev.type == "cpu" else 0
        return buf

    def receive_all(self) -> None:
        for seg in range(len(self.spec["segments"])):
            if seg not in self.buffers:
                self.buffers[seg] = self._receive(seg)

    def tensors(self):
        for m in self.metas:
            if m.segment not in self.buffers:
                # streaming: buckets arrive in order; drop the ones fully consumed
                for s in [s for s in self.buffers if s < m.segment and self.streaming]:
                    del self.buffers[s]
                self.buffers[m.segment] = self._receive(m.segment)
            buf = self.buffers[m.segment][m.offset: m.offset + m.nbytes]
            yield m, buf.view(P.dtype_of(m.dtype)).view(m.shape)

    def close(self) -> None:
        self.buffers.clear()
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                shutdown = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
                if shutdown is not None:
                    shutdown()
            except Exception:
                pass


# the last update's opened handles, per kind of source (reused while the trainer keeps its tensors)
_IPC_OPEN: dict[bytes, torch.Tensor] = {}
_IPC_LAYOUT: dict[bytes, torch.Tensor] = {}


def _ipc_key(handle) -> bytes | None:
    try:
        from vllm_rlpatch.refit.transports import ipc_unpickle

        # torch's reduce_tensor for CUDA: (type, size, stride, offset, storage type, dtype, device, handle,
        # storage size, storage offset, requires_grad, ref counter handle/offset, event handle, sync flag)
        fn, args = ipc_unpickle(handle) if isinstance(handle, (bytes, bytearray)) else handle
        return bytes(args[7]) + str(args[9]).encode() + str(tuple(args[1])).encode() + str(tuple(args[2])).encode() \
            + str(args[3]).encode()
    except Exception:
        return None


class IpcSource(Source):
    """CUDA IPC: the trainer's own tensors (same GPU, other process), opened by handle; no copy. Handles the
    previous update used are kept open (a trainer that updates its tensors in place sends the same ones)."""

    def __init__(self, metas, handles: list[Any], device: torch.device):
        self.metas, self.handles, self.device = metas, handles, device
        self.views: list[torch.Tensor] = []
        self.reused = 0

    def open(self) -> None:
        from vllm_rlpatch.refit import transports

        keep: dict[bytes, torch.Tensor] = {}
        views = []
        for h in self.handles:
            k = _ipc_key(h)
            t = _IPC_OPEN.get(k) if k is not None else None
            if t is None:
                t = transports.ipc_open([h], self.device)[0]
            else:
                self.reused += 1
            if k is not None:
                keep[k] = t
            views.append(t)
        _IPC_OPEN.clear()
        _IPC_OPEN.update(keep)
        self.views = views

    def tensors(self):
        for m, t in zip(self.metas, self.views):
            yield m, t

    def close(self) -> None:
        self.views = []


class LayoutSource(Source):
    """Zero-pack CUDA IPC: one buffer laid out like the engine's parameters (``refit.EngineLayout``); the
    trainer's tensors are views into it. One handle, opened once and kept while the trainer keeps it."""

    def __init__(self, metas, spec: dict[str, Any], device: torch.device):
        self.metas, self.spec, self.device = metas, spec, device
        self.buf: torch.Tensor | None = None
        self.reused = 0

    def open(self) -> None:
        from vllm_rlpatch.refit import transports

        h = self.spec["handle"]
        k = _ipc_key(h)
        t = _IPC_LAYOUT.get(k) if k is not None else None
        if t is None:
            t = transports.ipc_open([h], self.device)[0]
            _IPC_LAYOUT.clear()
            if k is not None:
                _IPC_LAYOUT[k] = t
        else:
            self.reused = 1
        self.buf = t

    def tensors(self):
        for m in self.metas:
            size, stride, off = self.spec["views"][m.name]
            yield m, self.buf.view(P.dtype_of(m.dtype)).as_strided(size, stride, off)

    def close(self) -> None:
        self.buf = None


def make_source(req: dict[str, Any], metas: list[P.TensorMeta], worker: Any) -> Source:
    tr = req["transport"]
    kind = tr["kind"]
    if kind == "shm":
        return ShmSource(metas, tr["segments"])
    if kind == "dist":
        rank = int(tr.get("rank_base", 1)) + int(getattr(worker, "rank", 0) or 0)
        return DistSource(metas, tr, rank, _device_of(worker))
    if kind == "cuda_ipc":
        return IpcSource(metas, tr["handles"], _device_of(worker))
    if kind == "cuda_ipc_layout":
        return LayoutSource(metas, tr, _device_of(worker))
    raise P.RefitError(f"unknown transport {kind!r}", kind="validation")


def _device_of(worker) -> torch.device:
    dev = getattr(worker, "device", None)
    if isinstance(dev, torch.device):
        return dev
    try:
        return next(model_of(worker).parameters()).device
    except Exception:
        return torch.device("cpu")


# ------------------------------------------------------------------------------------------ transaction
class _Tx:
    def __init__(self, req: dict[str, Any], metas: list[P.TensorMeta], source: Source):
        self.req, self.metas, self.source = req, metas, source
        self.txid: str = req["txid"]
        self.mode: str = req.get("mode", "atomic")
        self.partial = bool(req.get("partial", False))
        self.snapshot: Snapshot | None = None
        self.fp_before: str | None = None
        self.staged: dict[str, torch.Tensor] | None = None
        self.committed = False
        self.stages: dict[str, float] = {}
        self.checks: list[str] = []
        self.extra_host = 0
        self.extra_device = 0


def _now() -> float:
    return time.perf_counter()


class WorkerRefit:
    def __init__(self, worker: Any):
        self.worker_ref = weakref.ref(worker)
        self._schema: P.Schema | None = None
        self.txs: dict[str, _Tx] = {}
        self.plan = None  # a verified CopyPlan (None: not tried yet; False: not usable here)
        self.plan_note = "not captured yet (the first complete update captures and verifies it)"

    @property
    def worker(self):
        return self.worker_ref()

    @property
    def model(self):
        return model_of(self.worker)

    # --------------------------------------------------------------- schema
    def schema(self) -> P.Schema:
        if self._schema is None:
            mc = self.worker.model_config
            dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else getattr(torch, str(mc.dtype))
            errors = []
            # the checkpoint's own names are what vLLM's loader consumes; a model built from its config in
            # transformers (meta device) stands in where there is no checkpoint (load_format=dummy)
            try:
                self._schema = P.schema_from_checkpoint(str(mc.model), mc.hf_config, dtype)
            except Exception as e:  # noqa: BLE001 - fall back, report both if both fail
                errors.append(f"checkpoint: {type(e).__name__}: {e}")
                try:
                    self._schema = P.schema_from_hf_config(mc.hf_config, dtype,
                                                           getattr(mc, "trust_remote_code", False))
                except Exception as e2:  # noqa: BLE001
                    errors.append(f"transformers: {type(e2).__name__}: {e2}")
                    raise P.RefitError("cannot determine the tensors this model expects (" + "; ".join(errors) + ")",
                                       kind="validation") from e2
            logger.info("vllm-rlpatch: refit schema of %s: %d tensors (+%d tied aliases), %.1f MB, from %s",
                        type(self.model).__name__, len(self._schema.tensors), len(self._schema.aliases),
                        self._schema.nbytes / 1e6, self._schema.source)
        return self._schema

    def describe(self) -> dict[str, Any]:
        s = self.schema()
        model = self.model
        dev = _device_of(self.worker)
        return {"schema": s.as_dict(), "device": str(dev), "rank": int(getattr(self.worker, "rank", 0) or 0),
                "pid": os.getpid(), "quantization": getattr(self.worker.model_config, "quantization", None),
                "lora": getattr(self.worker, "lora_config", None) is not None
                or getattr(getattr(self.worker, "vllm_config", None), "lora_config", None) is not None,
                "model_class": type(model).__name__}

    # --------------------------------------------------------------- prepare
    def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = _now()
        txid = req["txid"]
        self._drop(txid)
        metas = [P.TensorMeta.from_dict(d) for d in req["tensors"]]
        stages: dict[str, float] = {}
        checks: list[str] = []
        try:
            unsupported = self._unsupported()
            if unsupported:
                return _fail("refused", "unchanged", unsupported, stages, checks)
            schema = self.schema()
            probs = P.validate_metadata(metas, schema, partial=bool(req.get("partial")),
                                        allow_cast=bool(req.get("allow_cast")))
            checks.append("metadata")
            stages["validate"] = _now() - t0
            if probs:
                return _fail("validation", "unchanged", P.summarize(probs), stages, checks, probs)
            version = req.get("version")
            if version is not None:
                from vllm_rlpatch.hooks import weights

                cur = weights.weight_version(self.worker)
                if int(version) <= cur:
                    return _fail("validation", "unchanged", f"version {version} is not greater than the engine's "
                                 f"current weight version {cur}", stages, checks)
            source = make_source(req, metas, self.worker)
            tx = _Tx(req, metas, source)
            tx.stages, tx.checks = stages, checks
            t1 = _now()
            source.open()
            stages["open"] = _now() - t1
            if tx.mode == "atomic":
                t1 = _now()
                if isinstance(source, DistSource):
                    source.receive_all()
                tx.staged = {m.name: t for m, t in source.tensors()}
                stages["receive"] = _now() - t1
                probs = self._check_data(tx, tx.staged)
                if probs:
                    source.close()
                    kind = "transport" if any(p["kind"] == "fingerprint" for p in probs) else "validation"
                    return _fail(kind, "unchanged", P.summarize(probs), stages, checks, probs)
                t1 = _now()
                model = self.model
                dev = _device_of(self.worker)
                where = _backup_place(model, dev, req.get("backup", "auto"))
                tx.snapshot = Snapshot(model, device=where)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                stages["backup"] = _now() - t1
                if where == "cpu" or dev.type == "cpu":
                    tx.extra_host += tx.snapshot.nbytes
                else:
                    tx.extra_device += tx.snapshot.nbytes
                checks.append(f"backup_{'host' if where == 'cpu' or dev.type == 'cpu' else 'device'}")
            self.txs[txid] = tx
            stages["prepare_total"] = _now() - t0
            return {"ok": True, "state": "unchanged", "stages": stages, "checks": list(checks), "pid": os.getpid(),
                    "rank": int(getattr(self.worker, "rank", 0) or 0)}
        except P.RefitError as e:
            return _fail(e.kind, "unchanged", str(e), stages, checks, e.problems)
        except Exception as e:  # noqa: BLE001 - an unexpected failure is still a structured, unchanged failure
            logger.exception("vllm-rlpatch: refit prepare failed")
            return _fail("transport" if "transport" in str(e) else "validation", "unchanged",
                         f"{type(e).__name__}: {e}", stages, checks)

    def _unsupported(self) -> str | None:
        w = self.worker
        vc = getattr(w, "vllm_config", None)
        if vc is not None and getattr(vc, "lora_config", None) is not None:
            return None  # base weights of a LoRA engine can be refit; adapters are separate (documented)
        return None

    def _check_data(self, tx: _Tx, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
        probs: list[dict[str, Any]] = []
        t1 = _now()
        want = {m.name: m.fingerprint for m in tx.metas if m.fingerprint}
        if want:
            names = [n for n in want if n in tensors]
            got = P.fingerprints([tensors[n] for n in names])
            for n, g in zip(names, got):
                if g != want[n]:
                    probs.append(P.problem("fingerprint", n, f"{n}: the bytes received differ from the bytes sent "
                                                             f"(fingerprint {g} != {want[n]})"))
            tx.checks.append("transport_fingerprint")
            tx.stages["check_fingerprint"] = _now() - t1
        if tx.mode == "atomic" or tx.req.get("verify", True):
            t1 = _now()
            names = list(tensors)
            counts = P.nonfinite_counts([tensors[n] for n in names])
            for n, nf in zip(names, counts):
                if nf:
                    probs.append(P.problem("nonfinite", n, f"{n}: {nf} of {tensors[n].numel()} values are NaN or "
                                                           "infinite"))
            tx.checks.append("finite")
            tx.stages["check_finite"] = _now() - t1
        schema = self.schema()
        for alias, target in schema.aliases.items():
            if alias in tensors and target in tensors:
                if not torch.equal(tensors[alias], tensors[target]):
                    probs.append(P.problem("tied", alias, f"{alias} differs from {target}, but the engine's model "
                                                          "ties them (one tensor): send equal tensors, or untie the "
                                                          "model on both sides"))
        if schema.aliases:
            tx.checks.append("tied_equal")
        return probs

    # --------------------------------------------------------------- commit
    def _iter_for_load(self, tx: _Tx) -> Iterator[tuple[str, torch.Tensor]]:
        aliases = self.schema().aliases
        if tx.staged is not None:
            for m in tx.metas:
                if m.name not in aliases:
                    yield m.name, tx.staged[m.name]
            return
        for m, t in tx.source.tensors():
            if m.name not in aliases:
                yield m.name, t

    def commit(self, txid: str, version: int | None = None, release: bool = True,
               request: dict[str, Any] | None = None) -> dict[str, Any]:
        """``request``: prepare and commit in one RPC (a single worker: nothing to agree on across ranks)."""
        from vllm_rlpatch.hooks import layerwise, weights

        if request is not None:
            prep = self.prepare(request)
            if not prep.get("ok"):
                return prep
        tx = self.txs.get(txid)
        if tx is None:
            return _fail("validation", "unchanged", f"no prepared update {txid!r} in this worker", {}, [])
        t0 = _now()
        worker, model = self.worker, self.model
        dev = _device_of(worker)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base_alloc = torch.cuda.memory_allocated(dev)
        if isinstance(tx.source, DistSource) and tx.staged is None:
            tx.source.streaming = True
        findings = None
        error: BaseException | None = None
        aliases = self.schema().aliases
        names = {m.name for m in tx.metas if m.name not in aliases}
        use_plan = bool(getattr(self.plan, "verified", False)) and self.plan.covers(names)
        try:
            if use_plan:
                tx.checks.append("plan_copy")
                if tx.staged is not None:
                    self.plan.apply({n: t for n, t in tx.staged.items() if n in names})
                else:
                    for m, t in tx.source.tensors():
                        if m.name in names:
                            self.plan.apply_one(m.name, t)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            else:
                with layerwise.strict(require_full=not tx.partial) as pol, weights.suppressed(), \
                        vllm_config_ctx(worker), lora_unwrapped(model):
                    try:
                        worker.reload_weights(weights_iterator=self._iter_for_load(tx))
                    finally:
                        findings = pol.findings
                        if layerwise.reload_active(model):  # the load raised half-way: put every layer back
                            abort_open_reload(worker)
                tx.checks.append("strict_reload")
            tx.stages["write"] = _now() - t0
            if tx.mode == "direct":
                t1 = _now()
                received = {m.name: t for m, t in tx.source.tensors()} if not isinstance(tx.source, DistSource) else None
                if received is not None:
                    probs = self._check_data(tx, received)
                    if probs:
                        raise P.RefitError(P.summarize(probs), kind="transport" if any(
                            p["kind"] == "fingerprint" for p in probs) else "validation", problems=probs)
                tx.stages["check_after"] = _now() - t1
            if not use_plan and self.plan is None and not tx.partial:
                t1 = _now()
                self._capture_plan(tx, names)
                tx.stages["plan_capture"] = _now() - t1
        except BaseException as e:  # noqa: BLE001 - everything below decides what the engine holds now
            error = e
        tx.stages["commit_total"] = _now() - t0
        if dev.type == "cuda":
            tx.extra_device = max(tx.extra_device, torch.cuda.max_memory_allocated(dev) - base_alloc)
        if error is None:
            tx.committed = True
            ev = weights.fire(worker, "rlpatch_refit", "worker", version=version)
            out = {"ok": True, "state": "committed", "version": ev.version, "stages": tx.stages, "checks": tx.checks,
                   "path": "plan" if use_plan else "layerwise", "plan": self.plan_note,
                   "findings": findings.as_dict() if findings else None, "extra_host_bytes": tx.extra_host,
                   "extra_device_bytes": tx.extra_device, "pid": os.getpid(),
                   "rank": int(getattr(worker, "rank", 0) or 0)}
            if release:
                self._drop(txid)
            return out
        return self._failed_commit(tx, error, findings)

    def _capture_plan(self, tx: _Tx, names: set[str]) -> None:
        """Record and verify the copy plan after a complete layerwise update (GPU, unquantized, no LoRA)."""
        from vllm_rlpatch.refit.plan import CopyPlan, PlanError

        w = self.worker
        if getattr(w.model_config, "quantization", None) is not None:
            self.plan_note = "not used: quantized model (post-processing changes the weights)"
            self.plan = False
            return
        if any(type(m).__name__.endswith("WithLoRA") for m in self.model.modules()):
            self.plan_note = "not used: LoRA engine"
            self.plan = False
            return
        sources = tx.staged if tx.staged is not None else (
            {m.name: t for m, t in tx.source.tensors()} if not isinstance(tx.source, DistSource) else None)
        if sources is None:
            self.plan_note = "not captured yet (needs a non-streamed update to verify against)"
            return
        metas = [(m.name, m.shape, P.dtype_of(m.dtype)) for m in tx.metas if m.name in names]
        try:
            plan = CopyPlan.capture(self.model, metas, skip=set(self.schema().aliases))
            why = plan.verify({n: sources[n] for n in names})
        except PlanError as e:
            self.plan, self.plan_note = False, f"not usable: {e}"
            logger.info("vllm-rlpatch: refit copy plan not usable for this model: %s", e)
            return
        if why is not None:
            self.plan, self.plan_note = False, f"not usable: {why}"
            logger.warning("vllm-rlpatch: refit copy plan failed verification: %s", why)
            return
        self.plan = plan
        self.plan_note = f"verified: {plan.copies} slice copies for {len(plan.names)} tensors"
        tx.checks.append("plan_verified")
        logger.info("vllm-rlpatch: refit copy plan recorded and verified (%d copies, %.2f s); later complete "
                    "updates are slice copies", plan.copies, plan.capture_seconds)

    def _failed_commit(self, tx: _Tx, error: BaseException, findings) -> dict[str, Any]:
        kind = error.kind if isinstance(error, P.RefitError) else (
            "transport" if "transport" in str(error) else "commit")
        msg = str(error) if isinstance(error, P.RefitError) else f"{type(error).__name__}: {error}"
        probs = error.problems if isinstance(error, P.RefitError) else []
        if tx.snapshot is not None:
            t1 = _now()
            state, note = self._restore(tx)
            tx.stages["restore"] = _now() - t1
            msg = f"{msg} ({note})"
        else:
            state = "mixed" if (findings is None or findings.processed > 0 or tx.mode == "direct") else "unchanged"
            if state == "mixed":
                from vllm_rlpatch.hooks.layerwise import MIXED_MARK

                if MIXED_MARK not in msg:
                    msg = f"{MIXED_MARK} {msg}"
        logger.error("vllm-rlpatch: refit %s failed (%s mode): %s -> engine state %s", tx.txid, tx.mode, msg, state)
        self._drop(tx.txid)
        return _fail(kind, state, msg, tx.stages, tx.checks, probs,
                     findings=findings.as_dict() if findings else None)

    def _restore(self, tx: _Tx) -> tuple[str, str]:
        model = self.model
        try:
            tx.snapshot.restore()
            fp = weights_fingerprint(model)[0]
            before = tx.snapshot.fingerprint()  # the bit-exact copy of the old weights, taken before the update
        except Exception as e:  # noqa: BLE001
            logger.exception("vllm-rlpatch: restoring the old weights failed")
            return "mixed", f"restoring the old weights failed: {type(e).__name__}: {e}"
        tx.checks.append("restore_fingerprint")
        if fp != before:
            return "mixed", f"restored weights' fingerprint {fp} != {before} before the update"
        from vllm_rlpatch.hooks import layerwise

        layerwise.clear_mixed()
        return "restored", f"old weights restored, fingerprint {fp} verified"

    def abort(self, txid: str) -> dict[str, Any]:
        from vllm_rlpatch.hooks import weights

        tx = self.txs.get(txid)
        if tx is None:
            return {"ok": True, "state": "unchanged", "note": "nothing to abort"}
        if not tx.committed:
            self._drop(txid)
            return {"ok": True, "state": "unchanged"}
        if tx.snapshot is None:
            self._drop(txid)
            return {"ok": False, "state": "mixed", "message": "direct-mode update committed here and cannot be "
                                                              "rolled back"}
        state, note = self._restore(tx)
        weights.fire(self.worker, "rlpatch_refit_rollback", "worker")
        self._drop(txid)
        return {"ok": state == "restored", "state": state, "message": note}

    def release(self, txid: str) -> dict[str, Any]:
        self._drop(txid)
        return {"ok": True}

    def _drop(self, txid: str) -> None:
        tx = self.txs.pop(txid, None)
        if tx is not None:
            tx.staged = None
            tx.snapshot = None
            try:
                tx.source.close()
            except Exception:
                pass

    def layout(self) -> dict[str, Any]:
        """The engine layout a zero-pack trainer buffer uses (needs a verified copy plan): where every trainer
        tensor sits, as a strided view, in one buffer of this worker's dtype."""
        plan = self.plan
        if not getattr(plan, "verified", False):
            return {"ok": False, "message": f"no verified copy plan in this worker ({self.plan_note})"}
        by_name: dict[str, list] = {}
        for e in plan.entries:
            by_name.setdefault(e.name, []).append(e)
        params: list[torch.Tensor] = []
        index: dict[int, int] = {}
        views: dict[str, list] = {}
        offset = 0  # in elements of the common dtype
        dtype = None
        starts: dict[int, int] = {}
        for name in sorted(by_name):
            es = by_name[name]
            if len(es) != 1:
                return {"ok": False, "message": f"{name} lands in {len(es)} windows (tensor parallel?)"}
            e = es[0]
            size, stride, off = e.src_geom
            if off != 0 or list(size) != list(e.dst_geom[0]):
                return {"ok": False, "message": f"{name}: the engine takes a part of it (sharded)"}
            p = e.dst.data
            dtype = dtype or p.dtype
            if p.dtype != dtype or not p.is_contiguous():
                return {"ok": False, "message": f"{name}: parameter dtype/layout differs"}
            key = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
            if key not in index:
                index[key] = len(params)
                params.append(p)
                starts[key] = offset
                offset += (p.numel() + 31) // 32 * 32  # 64-byte aligned for bf16
            dsize, dstride, doff = e.dst_geom
            views[name] = [list(dsize), list(dstride), starts[key] + (doff - p.storage_offset())]
        return {"ok": True, "dtype": P.dtype_name(dtype), "numel": offset, "views": views,
                "params": len(params)}

    def fingerprint(self) -> dict[str, Any]:
        fp, per = weights_fingerprint(self.model)
        return {"fingerprint": fp, "tensors": len(per), "rank": int(getattr(self.worker, "rank", 0) or 0)}


def _fail(kind: str, state: str, message: str, stages: dict, checks: list, problems: list | None = None,
          **extra) -> dict[str, Any]:
    return {"ok": False, "kind": kind, "state": state, "message": message, "problems": problems or [],
            "stages": stages, "checks": list(checks), "pid": os.getpid(), **extra}


def abort_open_reload(worker: Any) -> None:
    """A load raised in the middle of a layerwise reload: every layer not yet processed gets its previous
    tensors back (vLLM would otherwise leave them on the meta device)."""
    from vllm_rlpatch.hooks import layerwise

    lw = layerwise._lw()
    model = model_of(worker)
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load():
            info.load_numel = 0
            info.loaded_weights.clear()
    with layerwise.strict(require_full=False, raise_errors=False), vllm_config_ctx(worker):
        lw.finalize_layerwise_processing(model, worker.model_config)
