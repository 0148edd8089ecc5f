"""Backups for the ``rollback`` guarantee: everything an update will overwrite, kept until it commits.

Memory comes from a :class:`BackupArena` per worker, reused across updates: fixed-size chunks allocated once
(pinned host memory next to a CUDA model, so device-to-host copies are asynchronous and run at PCIe speed;
plain host memory for a CPU model; device memory when the device has room). Slots are carved from the chunks
for one transaction and given back when it ends; the chunks stay for the next update. The arena never grows
past its cap (:func:`host_cap`): a backup that does not fit is refused before anything is written, never
spilled to pageable memory.

Two kinds of backup:

* :class:`WindowBackup` (the copy-plan path): the destination windows of the update's tensors. On CUDA each
  window's backup copy runs on a side stream and the write of that window waits only for its own backup, so
  backing up and writing overlap.
* :class:`StateBackup` (vLLM's layerwise reload, whose post-processing re-creates tensors and module
  attributes): parameter and buffer bytes, the tensor objects and their ``.data``, and the modules' plain
  attributes (e.g. a CPU GEMM closure over a repacked weight), so a restore gives back exactly the engine that
  was there, including state no checksum can see.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import torch

from vllm_rlpatch import envs

logger = logging.getLogger("vllm.rlpatch")

CHUNK_BYTES = 64 << 20
_ALIGN = 256


def _available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_cap() -> int:
    """The most host memory a backup may take: ``VLLM_RLPATCH_BACKUP_HOST_BYTES``, else half of the host's
    available memory (read when the arena is sized)."""
    v = envs.BACKUP_HOST_BYTES.get()
    if v is not None:
        return int(v)
    avail = _available_host_bytes()
    return int(avail * 0.5) if avail is not None else 8 << 30


class BackupArena:
    """Reused backup memory of one kind (``pinned``, ``host`` or ``device``) for one worker."""

    def __init__(self, kind: str, device: torch.device):
        self.kind, self.device = kind, device
        self.chunks: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._cursor = (0, 0)  # (chunk, offset) of the next free byte in this transaction
        self.peak = 0

    @property
    def capacity(self) -> int:
        return sum(c.numel() for c in self.chunks)

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        if self.kind == "device":
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.kind == "pinned")

    def reserve(self, nbytes: int, slots: int = 1) -> None:
        """Make sure ``slots`` slots of ``nbytes`` in all fit, carved in order; allocates now (before the update
        writes anything), so a failure to allocate leaves the weights untouched. The arena is one chunk (a slot
        never straddles two), replaced by a larger one when it is too small."""
        need = nbytes + slots * _ALIGN
        with self._lock:
            if self.chunks and self.chunks[0].numel() >= need:
                return
            self.chunks = []
            if self.kind == "device":
                torch.cuda.empty_cache()
            self.chunks.append(self._new_chunk(max(need, CHUNK_BYTES)))

    def grow(self, nbytes: int) -> None:
        """One more chunk for ``nbytes`` (a later part of a session: the earlier parts' slots stay)."""
        with self._lock:
            self.chunks.append(self._new_chunk(max(nbytes + _ALIGN, CHUNK_BYTES)))

    def begin(self) -> None:
        self._cursor = (0, 0)

    def slot(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of backup memory (a uint8 view of one chunk)."""
        with self._lock:
            ci, off = self._cursor
            while True:
                if ci >= len(self.chunks):
                    self.chunks.append(self._new_chunk(max(CHUNK_BYTES, nbytes)))
                c = self.chunks[ci]
                if off + nbytes <= c.numel():
                    view = c[off: off + nbytes]
                    self._cursor = (ci, (off + nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
                    self.peak = max(self.peak, sum(x.numel() for x in self.chunks[:ci]) + off + nbytes)
                    return view
                ci, off = ci + 1, 0

    def release(self, keep: bool = True) -> None:
        self._cursor = (0, 0)
        if not keep:
            self.chunks = []


def arena_kind(device: torch.device, want: str) -> str:
    if device.type == "cuda":
        return "device" if want == "device" else "pinned"
    return "host"


def fits(nbytes: int, kind: str, device: torch.device, have: int = 0) -> tuple[bool, str]:
    """Can a backup of ``nbytes`` (``have`` already held by the arena) live in ``kind`` memory?"""
    extra = max(0, nbytes - have)
    if kind == "device":
        free, _ = torch.cuda.mem_get_info(device)
        margin = 1 << 30
        ok = free >= extra + margin
        return ok, f"device has {free / 2**30:.2f} GiB free, the backup needs {extra / 2**30:.2f} GiB more + 1 GiB margin"
    cap = host_cap()
    ok = nbytes <= cap
    return ok, (f"host backup cap {cap / 2**30:.2f} GiB (VLLM_RLPATCH_BACKUP_HOST_BYTES, default half the available "
                f"memory), the backup needs {nbytes / 2**30:.2f} GiB")


class BackupPool:
    """A worker's arenas, one per kind, reused across its updates; device memory goes back to the trainer as
    soon as an update ends (:meth:`end_update`)."""

    def __init__(self) -> None:
        self.arenas: dict[str, BackupArena] = {}

    def arena(self, kind: str, device: torch.device) -> BackupArena:
        a = self.arenas.get(kind)
        if a is None:
            a = self.arenas[kind] = BackupArena(kind, device)
        return a

    def reserve(self, kind: str, nbytes: int, slots: int, device: torch.device) -> tuple[bool, str]:
        """Room for a backup of ``nbytes`` in ``slots`` slots of ``kind`` memory, allocated now: (ok, why not)."""
        arena = self.arena(kind, device)
        ok, why = fits(nbytes, kind, device, arena.capacity)
        if not ok:
            return False, why
        try:
            arena.reserve(nbytes, slots)
        except Exception as e:  # noqa: BLE001 - out of memory while reserving: nothing written
            return False, f"reserving {nbytes / 2**30:.2f} GiB of {kind} memory failed: {type(e).__name__}: {e}"
        return True, ""

    def grow_for_part(self, kind: str, nbytes: int, held: int, device: torch.device) -> tuple[bool, str]:
        """Room for one more part's backup (``held`` bytes already taken by the earlier parts): a session's parts
        share one arena, which a later part grows by a chunk."""
        arena = self.arena(kind, device)
        have = arena.capacity - held
        ok, why = fits(nbytes, kind, device, max(0, have))
        if ok and have < nbytes:
            arena.grow(nbytes)
        return ok, why

    def end_update(self, device: torch.device) -> None:
        """An update ended: host arenas stay for the next one; device memory goes back to the trainer at once."""
        for kind, a in list(self.arenas.items()):
            held = kind == "device" and bool(a.chunks)
            a.release(keep=kind != "device")
            if kind == "device" and device.type == "cuda":
                del self.arenas[kind]
                if held:  # the allocator's cache only holds something when the arena did
                    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ window backup
class WindowBackup:
    """Backups of destination windows (views into parameters), written overlapped with the update's copies."""

    def __init__(self, arena: BackupArena):
        self.arena = arena
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # (window view, backup slot)
        self.bytes = 0
        self.seconds = 0.0
        self._stream = None

    def save_then(self, windows: Iterable[torch.Tensor], write: Callable[[int], None]) -> None:
        """For each window ``i``: back it up, then ``write(i)`` once (and only once) its backup is done."""
        t0 = time.perf_counter()
        windows = list(windows)
        cuda = bool(windows) and windows[0].is_cuda
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=windows[0].device)
            main = torch.cuda.current_stream(windows[0].device)
            self._stream.wait_stream(main)
        with torch.no_grad():
            for i, w in enumerate(windows):
                nbytes = w.numel() * w.element_size()
                slot = self.arena.slot(nbytes).view(w.dtype)[: w.numel()].view(w.shape)
                if cuda:
                    with torch.cuda.stream(self._stream):
                        slot.copy_(w, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self._stream)
                    main.wait_event(ev)
                else:
                    slot.copy_(w)
                self.saved.append((w, slot))
                self.bytes += nbytes
                write(i)
        self.seconds += time.perf_counter() - t0

    def restore(self) -> None:
        with torch.no_grad():
            for w, slot in self.saved:
                w.copy_(slot, non_blocking=True)
        if self.saved and self.saved[0][0].is_cuda:
            torch.cuda.synchronize(self.saved[0][0].device)

    def drop(self) -> None:
        self.saved = []


# ------------------------------------------------------------------------------------------ state backup
class StateBackup:
    """Everything a layer's post-processing can change (see module doc). Bytes go to ``arena`` slots (copied
    asynchronously on CUDA with pinned memory), objects and attributes are kept by reference."""

    def __init__(self, model, arena: BackupArena | None):
        t0 = time.perf_counter()
        self.names = []
        seen = set()
        for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
            if id(t) in seen or t.is_meta:
                continue
            seen.add(id(t))
            self.names.append((n, t))
        self.modules = []
        self.data: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.bytes = 0
        cuda_dev = None
        with torch.no_grad():
            for mod in model.modules():
                attrs = {k: v for k, v in mod.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}
                self.modules.append((mod, attrs, dict(mod._parameters), dict(mod._buffers),
                                     set(getattr(mod, "_non_persistent_buffers_set", ()))))
                for t in list(mod._parameters.values()) + list(mod._buffers.values()):
                    if t is None or id(t) in self.data:
                        continue
                    d = t.data
                    if d.is_meta or d.numel() == 0:
                        self.data[id(t)] = (t, d, d)
                        continue
                    nbytes = d.numel() * d.element_size()
                    if arena is not None:
                        slot = arena.slot(nbytes).view(d.dtype)[: d.numel()].view(d.shape)
                        slot.copy_(d, non_blocking=d.is_cuda)
                    else:
                        slot = d.detach().clone()
                    if d.is_cuda:
                        cuda_dev = d.device
                    self.data[id(t)] = (t, d, slot)
                    self.bytes += nbytes
        if cuda_dev is not None:
            torch.cuda.synchronize(cuda_dev)
        self.seconds = time.perf_counter() - t0

    def saved_named(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for n, t in self.names:
            rec = self.data.get(id(t))
            if rec is not None:
                out.append((n, rec[2]))
        return sorted(out, key=lambda x: x[0])

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
        cuda_dev = None
        with torch.no_grad():
            for t, d, saved in self.data.values():
                if t.data is not d:
                    t.data = d
                if saved is not d:
                    d.copy_(saved, non_blocking=d.is_cuda)
                    if d.is_cuda:
                        cuda_dev = d.device
        if cuda_dev is not None:
            torch.cuda.synchronize(cuda_dev)


def state_count(model) -> int:
    seen = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            seen.add(id(t))
    return len(seen)


def state_bytes(model) -> int:
    seen = set()
    n = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        n += t.numel() * t.element_size()
    return n

