"""The ``shm`` transport: the update's bytes in shared-memory segments (``/dev/shm`` files, one per bucket).

Sender (trainer side, :class:`ShmSender`): copies every tensor into a segment of a :class:`ShmPool` (segments
reused across the updates of one target, so after the first update there are no page faults and the engine's
workers keep them mapped) and, in the same trip through memory, digests what it wrote
(:func:`vllm_rlpatch.refit.checks.pack_and_digest`: checksum and finite check chunk by chunk, while the chunk
is in the cache). A tensor with NaN/inf is refused right there, before any RPC.

Source (worker side, :class:`ShmSource`): maps the segments and yields views; no copy. It does not hash the
pages again: they are the very pages the trainer digested (same host, same memory).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import threading
import time
import uuid
from typing import Any, Iterator

import torch

from vllm_rlpatch import envs
from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.sender import Sender, SendJob
from vllm_rlpatch.refit.source import Source

_PREFIX = "vllm-rlpatch-"


def shm_dir() -> str:
    return envs.REFIT_SHM_DIR.get() or "/dev/shm"


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
    """Shared-memory segments kept across the updates of one target. Unlinked at exit."""

    def __init__(self) -> None:
        self.dir = shm_dir()
        self.tag = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.segments: list[tuple[str, int, torch.Tensor]] = []
        self._lock = threading.Lock()
        _sweep_stale(self.dir)
        atexit.register(self.close)

    def lease(self, sizes: list[int], first: int = 0) -> list[tuple[str, int, torch.Tensor]]:
        """Segments ``first .. first+len(sizes)-1`` of at least these sizes (created or grown as needed). A
        multi-call update leases further segments for each part (``first``): parts do not overwrite each other
        while the engine may still hold views of an earlier one."""
        with self._lock:
            need = [max(s, 1) for s in sizes]
            extra = 0
            for k, n in enumerate(need):
                i = first + k
                extra += max(0, n - (self.segments[i][1] if i < len(self.segments) else 0))
            try:
                free = shutil.disk_usage(self.dir).free
            except OSError as e:
                raise P.RefitError(f"shm transport: cannot use {self.dir}: {e}", kind="transport") from e
            if free < extra:
                raise P.RefitError(f"shm transport: {self.dir} has {free / 2**30:.2f} GiB free, the update needs "
                                   f"{extra / 2**30:.2f} GiB more (containers often mount a 64 MiB /dev/shm: "
                                   "enlarge it, or set VLLM_RLPATCH_REFIT_SHM_DIR to a tmpfs with room)",
                                   kind="transport")
            for k, n in enumerate(need):
                i = first + k
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
                while len(self.segments) < i:  # a gap (never in practice: parts lease in order)
                    self.segments.append(("", 0, torch.empty(0, dtype=torch.uint8)))
                if i < len(self.segments):
                    self.segments[i] = seg
                else:
                    self.segments.append(seg)
            return self.segments[first:first + len(need)]

    def close(self) -> None:
        with self._lock:
            for path, _, _ in self.segments:
                if path:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
            self.segments = []


class ShmSender(Sender):
    """The update packed into shared-memory segments, digested in the same pass (``verify``)."""

    kind = "shm"
    packs_segments = True
    offered_over_http = True

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], metas: list[P.TensorMeta], bucket_bytes: int, *,
                 verify: bool = True, pool: ShmPool | None = None, first_segment: int = 0):
        self.metas = metas
        self.sizes = P.assign_buckets(metas, bucket_bytes)
        self.own = pool is None
        self.pool = pool or ShmPool()
        self.seconds_pack = 0.0
        t0 = time.perf_counter()
        try:
            segs = self.pool.lease(self.sizes, first_segment)
            self.paths = [p for p, _, _ in segs]
            self.seg_sizes = [n for _, n, _ in segs]
            maps = [m for _, _, m in segs]
            pairs = [(t, maps[m.segment][m.offset: m.offset + m.nbytes]) for (_, t), m in zip(tensors, metas)]
            ds = checks.pack_and_digest(pairs, check=verify)
            for m, d in zip(metas, ds):
                if d is not None:
                    m.fingerprint, m.nonfinite = d.key, d.nonfinite
            self.seconds_pack = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise

    @classmethod
    def build(cls, job: SendJob) -> "ShmSender":
        if not job.target.same_host():
            raise P.RefitError("transport='shm' needs the trainer and the engine on one host; this target is on "
                               "another host: use transport='dist' (or 'auto')", kind="validation")
        return cls(job.tensors, job.metas, job.bucket_bytes, verify=job.verify, pool=job.pool(),
                   first_segment=job.first_segment)

    def spec(self) -> dict[str, Any]:
        return {"kind": "shm", "segments": [{"path": p, "size": n} for p, n in zip(self.paths, self.seg_sizes)],
                "digested": any(m.fingerprint for m in self.metas)}

    @property
    def stages(self) -> dict[str, float]:
        return {"pack": self.seconds_pack}

    @property
    def host_bytes(self) -> int:
        return self.nbytes

    @property
    def segments(self) -> int:
        return len(self.sizes)

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


_SHM_MAPS: dict[tuple, torch.Tensor] = {}  # the last update's mapped segments (kept: no page faults next time)


class ShmSource(Source):
    """Views into the trainer's segments. ``trusted_digests``: the trainer digested these very pages while
    packing them, so the worker does not read them again to check."""

    kind = "shm"

    def __init__(self, metas: list[P.TensorMeta], spec: dict[str, Any]):
        self.metas, self.segments = metas, spec["segments"]
        self.trusted_digests = bool(spec.get("digested"))
        self.maps: list[torch.Tensor] = []

    @classmethod
    def for_rank(cls, metas: list[P.TensorMeta], spec: dict[str, Any], worker_rank: int,
                 device: torch.device) -> "ShmSource":
        return cls(metas, spec)

    def open(self) -> None:
        keep = {}
        for seg in self.segments:
            path, size = seg["path"], int(seg["size"])
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise P.TransportError(f"shared-memory segment {path} does not exist in the engine's worker (the "
                                       "trainer and the engine must share /dev/shm: same host, same container)") \
                    from None
            if st.st_size < size:
                raise P.TransportError(f"shared-memory segment {path} holds {st.st_size} bytes, {size} expected "
                                       "(truncated: did the sender die?)")
            key = (path, st.st_ino, size)
            m = _SHM_MAPS.get(key)
            if m is None:
                try:
                    m = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                except (OSError, RuntimeError) as e:
                    raise P.TransportError(f"shared-memory segment {path} could not be mapped: {e}") from e
            keep[key] = m
            self.maps.append(m)
        _SHM_MAPS.clear()  # views an open transaction still holds keep their segments mapped themselves
        _SHM_MAPS.update(keep)

    def tensors(self) -> Iterator[tuple[P.TensorMeta, torch.Tensor]]:
        for m in self.metas:
            buf = self.maps[m.segment][m.offset: m.offset + m.nbytes]
            yield m, buf.view(P.dtype_of(m.dtype)).view(m.shape)

    def close(self) -> None:
        self.maps = []
