"""Trainer-side halves of the transports (the engine side is in :mod:`vllm_rlpatch.refit.worker`).

``shm``      the update's bytes are copied once into shared-memory segments (``/dev/shm`` files, one per
             bucket); every worker maps them read-only and loads straight from the mapping. Metadata
             (names, shapes, dtypes, offsets, fingerprints) travels in the RPC; tensor bytes never do.
``dist``     the trainer hosts a TCPStore and joins a fresh ``torch.distributed`` process group with every
             worker (trainer = rank 0); buckets are broadcast in order. gloo between CPU processes or hosts,
             NCCL between GPUs.
``cuda_ipc`` same GPU, other process: CUDA IPC handles of the trainer's own tensors (no copy on the
             trainer side); the workers open them and copy into the model.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import shutil
import threading
import time
import uuid
from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P

logger = logging.getLogger("vllm.rlpatch")


def shm_dir() -> str:
    from vllm_rlpatch import envs

    return envs.REFIT_SHM_DIR.get() or "/dev/shm"


# ------------------------------------------------------------------------------------------ shm
_PREFIX = "vllm-rlpatch-"


def _sweep_stale(d: str) -> None:
    """Remove segments left by trainer processes that died (their pid is in the name)."""
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        if not n.startswith(_PREFIX):
            continue
        try:
            pid = int(n[len(_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(d, n))
        except PermissionError:
            pass


class ShmPool:
    """Shared-memory segments kept across the updates of one target: after the first update the pages exist
    (no page faults, no zeroing), and the engine's workers keep them mapped. Unlinked at exit."""

    def __init__(self) -> None:
        self.dir = shm_dir()
        self.tag = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.segments: list[tuple[str, int, torch.Tensor]] = []
        self._lock = threading.Lock()
        _sweep_stale(self.dir)
        atexit.register(self.close)

    def lease(self, sizes: list[int]) -> list[tuple[str, int, torch.Tensor]]:
        """Segments of at least these sizes (created or grown as needed)."""
        with self._lock:
            need = [max(s, 1) for s in sizes]
            extra = sum(max(0, n - (self.segments[i][1] if i < len(self.segments) else 0))
                        for i, n in enumerate(need))
            try:
                free = shutil.disk_usage(self.dir).free
            except OSError as e:
                raise P.RefitError(f"shm transport: cannot use {self.dir}: {e}", kind="transport") from e
            if free < extra:
                raise P.RefitError(f"shm transport: {self.dir} has {free / 2**30:.2f} GiB free, the update needs "
                                   f"{extra / 2**30:.2f} GiB more (containers often mount a 64 MiB /dev/shm: "
                                   "enlarge it, or set VLLM_RLPATCH_REFIT_SHM_DIR to a tmpfs with room)",
                                   kind="transport")
            for i, n in enumerate(need):
                if i < len(self.segments) and self.segments[i][1] >= n:
                    continue
                if i < len(self.segments):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.segments[i][0])
                path = os.path.join(self.dir, f"{self.tag}-{i}-{uuid.uuid4().hex[:6]}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, n)
                finally:
                    os.close(fd)
                seg = (path, n, torch.from_file(path, shared=True, size=n, dtype=torch.uint8))
                if i < len(self.segments):
                    self.segments[i] = seg
                else:
                    self.segments.append(seg)
            return self.segments[:len(need)]

    def close(self) -> None:
        with self._lock:
            for path, _, _ in self.segments:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            self.segments = []


class ShmPack:
    """The update packed into shared-memory segments (from a :class:`ShmPool`: reused across updates; or
    fresh ones, unlinked when the pack is closed)."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], metas: list[P.TensorMeta], bucket_bytes: int,
                 fingerprint: bool = True, pool: ShmPool | None = None):
        self.metas = metas
        self.sizes = P.assign_buckets(metas, bucket_bytes)
        self.own = pool is None
        self.pool = pool or ShmPool()
        self.seconds_pack = 0.0
        self.seconds_fingerprint = 0.0
        t0 = time.perf_counter()
        try:
            segs = self.pool.lease(self.sizes)
            self.paths = [p for p, _, _ in segs]
            self.seg_sizes = [n for _, n, _ in segs]
            maps = [m for _, _, m in segs]
            with torch.no_grad():
                for (name, t), m in zip(tensors, metas):
                    dst = maps[m.segment][m.offset: m.offset + m.nbytes].view(t.dtype).view(t.shape)
                    dst.copy_(t)
            self.seconds_pack = time.perf_counter() - t0
            if fingerprint:
                t1 = time.perf_counter()
                fps = P.fingerprints([maps[m.segment][m.offset: m.offset + m.nbytes] for m in metas])
                for m, f in zip(metas, fps):
                    m.fingerprint = f
                self.seconds_fingerprint = time.perf_counter() - t1
        except BaseException:
            self.close()
            raise

    def spec(self) -> dict[str, Any]:
        return {"kind": "shm", "segments": [{"path": p, "size": n} for p, n in zip(self.paths, self.seg_sizes)]}

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def close(self) -> None:
        if self.own:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------ dist
def broadcast_opts(root: int = 0):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


class DistSender:
    """Rank 0 of a per-update process group; broadcasts the buckets in order from a background thread."""

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], metas: list[P.TensorMeta], bucket_bytes: int, *,
                 n_workers: int, host: str, port: int = 0, backend: str = "gloo", timeout_s: float = 120.0,
                 fingerprint: bool = True, device: torch.device | None = None):
        import torch.distributed as dist

        self.tensors, self.metas = tensors, metas
        self.sizes = P.assign_buckets(metas, bucket_bytes)
        self.backend = backend
        self.world = n_workers + 1
        self.txid = uuid.uuid4().hex
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        self.store = dist.TCPStore(host, port, self.world, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)
        self.host, self.port = host, self.store.port
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.sent_buckets = 0
        self.seconds_send = 0.0
        self.seconds_fingerprint = 0.0
        if fingerprint:
            t1 = time.perf_counter()
            for m, f in zip(metas, P.fingerprints([t for _, t in tensors])):
                m.fingerprint = f
            self.seconds_fingerprint = time.perf_counter() - t1
        self._thread: threading.Thread | None = None
        self.on_bucket = None  # test hook: called with the bucket index before it is sent

    def spec(self) -> dict[str, Any]:
        return {"kind": "dist", "host": self.host, "port": self.port, "world_size": self.world,
                "backend": self.backend, "timeout_s": self.timeout_s, "segments": list(self.sizes),
                "txid": self.txid, "rank_base": 1}

    def _bucket(self, seg: int) -> torch.Tensor:
        buf = torch.empty(self.sizes[seg], dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for (name, t), m in zip(self.tensors, self.metas):
                if m.segment == seg:
                    buf[m.offset: m.offset + m.nbytes].view(t.dtype).view(t.shape).copy_(t)
        return buf

    def _run(self) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            store = dist.PrefixStore(f"rlpatch/{self.txid}", self.store)
            if self.backend == "nccl":
                pg = dist.ProcessGroupNCCL(store, 0, self.world, dist.ProcessGroupNCCL.Options())
            else:
                pg = dist.ProcessGroupGloo(store, 0, self.world, self.timeout)
            for seg in range(len(self.sizes)):
                if self.on_bucket is not None:
                    self.on_bucket(seg)
                pg.broadcast([self._bucket(seg)], broadcast_opts()).wait()
                self.sent_buckets += 1
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e
        self.seconds_send = time.perf_counter() - t0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rlpatch-dist-send", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


# ------------------------------------------------------------------------------------------ cuda_ipc
_HANDLES: dict[int, tuple[Any, int, bytes]] = {}  # id(tensor) -> (weakref, data_ptr, pickled handle)


def ipc_handles(tensors: list[tuple[str, torch.Tensor]]) -> list[bytes]:
    """CUDA IPC handles of the trainer's tensors (no copy). Pickled: they travel to the engine's workers on
    this host inside vLLM's RPC (whose msgpack carries bytes), never over a network. A tensor object passed
    again (``model.named_parameters()`` each step) reuses its handle while it is alive and still points at
    the same memory."""
    import pickle
    import weakref

    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, t in tensors:
        if not t.is_cuda:
            raise P.RefitError(f"cuda_ipc transport: {name} is on {t.device}, not a CUDA device", kind="validation")
        key = id(t)
        hit = _HANDLES.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t.data_ptr():
            out.append(hit[2])
            continue
        h = pickle.dumps(reduce_tensor(t.detach()))
        try:
            ref = weakref.ref(t, lambda _r, k=key: _HANDLES.pop(k, None))
            _HANDLES[key] = (ref, t.data_ptr(), h)
        except TypeError:
            pass
        out.append(h)
    return out


def ipc_unpickle(handle: bytes):
    import pickle

    return pickle.loads(handle)


def ipc_open(handles: list[Any], device: torch.device) -> list[torch.Tensor]:
    out = []
    for h in handles:
        fn, args = ipc_unpickle(h) if isinstance(h, (bytes, bytearray)) else h
        args = list(args)
        # reduce_tensor records the sender's device index (arg 6); open it on this worker's device
        if device.type == "cuda" and len(args) > 6:
            args[6] = device.index if device.index is not None else torch.cuda.current_device()
        out.append(fn(*args))
    return out
