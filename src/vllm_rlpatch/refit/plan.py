"""A precomputed name -> destination plan: a refit as slice copies straight into vLLM's parameters.

vLLM loads a checkpoint tensor through Python weight loaders: fused layers (qkv, gate_up) and tensor
parallelism turn one trainer tensor into a slice copy into a larger parameter. Where post-processing leaves
parameters in checkpoint layout (unquantized models on GPU), every update repeats exactly the same copies,
so they can be recorded once and replayed as plain ``copy_`` calls: no Python loader, no layer
materialisation, no per-layer processing.

Recording: the model's own ``load_weights`` runs once per name on a *meta* tensor of the trainer's shape,
under a dispatch mode that intercepts every ``copy_`` into a parameter and records where it lands (the
parameter, and the strided window inside its storage) and which window of the source it reads. A loader
that does anything but views and copies on the source (a concatenation, arithmetic) makes the plan
unusable, as does a copy into anything that is not a parameter or buffer of the model.

Trust: a plan is used only after it was verified against a real update that went through vLLM's own
layerwise reload: every recorded destination window must hold exactly the source window it names. It stays
trusted only while every destination is still the model's live storage (:meth:`CopyPlan.live`: a
``data_ptr`` check before each use, and the model's modules still hold tensors on those storages: a parameter
replaced by a new object elsewhere would leave the plan writing where the model no longer reads); anything that
re-points a parameter (a reload, sleep level 2, a LoRA change) invalidates it, and the next complete layerwise
update captures a new one.

With a plan, a write is plain copies that cannot fail part-way once validated, which is what the
``validate-then-write`` guarantee needs (:meth:`CopyPlan.preconditions`), and its destination windows can be
compared with the sources' digests after the write.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import operator
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger("vllm.rlpatch")


@dataclasses.dataclass
class Entry:
    name: str
    dst: torch.Tensor  # the parameter/buffer (its storage is the destination)
    dst_geom: tuple[tuple[int, ...], tuple[int, ...], int]  # size, stride, absolute storage offset
    src_geom: tuple[tuple[int, ...], tuple[int, ...], int]  # relative to a contiguous source tensor
    dst_ptr: int = 0  # the storage's data_ptr when the plan was captured (liveness)
    src_numel: int = 0  # elements of the whole source tensor

    @property
    def whole_source(self) -> bool:
        """Does the window read the whole source tensor in order (no tensor-parallel slice)?"""
        size, stride, off = self.src_geom
        return off == 0 and _numel(size) == self.src_numel and _contiguous(size, stride)


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= d
    return n


def _contiguous(size, stride) -> bool:
    expect = 1
    for d, st in zip(reversed(list(size)), reversed(list(stride))):
        if d != 1 and st != expect:
            return False
        expect *= d
    return True


class PlanError(RuntimeError):
    pass


def _storage_address(t: torch.Tensor | None) -> int:
    """The address of a tensor's storage; -1 for none, a meta tensor, or one whose storage cannot be read."""
    try:
        return -1 if t is None or t.is_meta else t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return -1


class _Capture(TorchDispatchMode):
    def __init__(self, origin: torch.Tensor, storages: dict[int, torch.Tensor]):
        super().__init__()
        self.origin = origin
        self.storages = storages
        self.records: list[tuple[torch.Tensor, tuple, tuple]] = []
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default and isinstance(args[1], torch.Tensor) and args[1].is_meta:
            dst, src = args[0], args[1]
            base = src if src._base is None else src._base
            if base is not self.origin:
                self.problem = "the loader transforms the source before copying it"
            elif dst.is_meta:
                self.problem = "the loader copies into a tensor that is not materialised"
            else:
                owner = self.storages.get(dst.untyped_storage().data_ptr())
                if owner is None:
                    self.problem = "the loader copies into a tensor that is not a parameter of the model"
                else:
                    self.records.append((owner, (tuple(dst.shape), tuple(dst.stride()), dst.storage_offset()),
                                         (tuple(src.shape), tuple(src.stride()), src.storage_offset())))
            return dst
        return func(*args, **kwargs)


class CopyPlan:
    def __init__(self, entries: list[Entry], names: list[str], seconds: float,
                 holders: list[tuple[str, dict, str, int]] | None = None):
        self.entries = entries
        self.names = frozenset(names)
        self.verified = False
        self.capture_seconds = seconds
        self.copies = len(entries)
        # every place on the model that holds a destination storage: (qualified name, the module's
        # ``_parameters``/``_buffers`` dict, the attribute, the storage's address at capture). The plan writes
        # through its own references; the model computes with what these hold, so :meth:`live` checks both
        self.holders = holders or []
        # what :meth:`live` reads on every update, derived once: one entry per parameter (not per window), the
        # parameters, and the holders' dicts and keys
        uniq: dict[int, Entry] = {}
        for e in entries:
            uniq.setdefault(id(e.dst), e)
        self._uniq = list(uniq.values())
        self._uniq_dst = [e.dst for e in self._uniq]
        self._h_dicts = [h[1] for h in self.holders]
        self._h_attrs = [h[2] for h in self.holders]
        # (parameter addresses, storage offsets, held objects) at the last full check that passed
        self._live_ptrs: tuple[list, list, list] | None = None
        self._windows: dict[int, torch.Tensor] = {}  # entry id -> its destination view
        self._window_bytes: int | None = None

    # -------------------------------------------------------------- build
    @classmethod
    def capture(cls, model: Any, metas: list[Any], skip: set[str]) -> "CopyPlan":
        """``metas``: (name, shape, torch dtype) of a complete update in trainer naming."""
        t0 = time.perf_counter()
        storages: dict[int, torch.Tensor] = {}
        for _, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
            if t is not None and not t.is_meta and t.numel() > 0:
                storages.setdefault(t.untyped_storage().data_ptr(), t)
        load = type(model).load_weights  # the class method: no plugin wrapper, no event
        entries: list[Entry] = []
        names = []
        for name, shape, dtype in metas:
            if name in skip:
                continue
            origin = torch.empty(shape, dtype=dtype, device="meta")
            cap = _Capture(origin, storages)
            try:
                with torch.no_grad(), cap:
                    load(model, [(name, origin)])
            except Exception as e:  # noqa: BLE001 - a loader that needs real data
                raise PlanError(f"{name}: the loader does not run on a shape-only tensor ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
            if cap.problem:
                raise PlanError(f"{name}: {cap.problem}")
            if not cap.records:
                raise PlanError(f"{name}: the loader copied nothing (a skipped or tied name)")
            for owner, dg, sg in cap.records:
                entries.append(Entry(name, owner, dg, sg, owner.data.untyped_storage().data_ptr(), origin.numel()))
            names.append(name)
        targets = {e.dst_ptr for e in entries}
        holders = []
        for mname, mod in model.named_modules(remove_duplicate=False):
            for d in (mod._parameters, mod._buffers):
                for attr, t in d.items():
                    if t is not None and not t.is_meta and t.numel() > 0:
                        ptr = t.untyped_storage().data_ptr()
                        if ptr in targets:
                            holders.append((f"{mname}.{attr}" if mname else attr, d, attr, ptr))
        return cls(entries, names, time.perf_counter() - t0, holders)

    # -------------------------------------------------------------- use
    @staticmethod
    def _src_view(src: torch.Tensor, geom) -> torch.Tensor:
        size, stride, off = geom
        if not src.is_contiguous():
            src = src.contiguous()
        return src.as_strided(size, stride, off + src.storage_offset())

    @staticmethod
    def _dst_view(dst: torch.Tensor, geom) -> torch.Tensor:
        size, stride, off = geom
        return dst.data.as_strided(size, stride, off)

    def verify(self, sources: dict[str, torch.Tensor]) -> str | None:
        """After a real (layerwise) update with ``sources``: does every window hold its source? None = yes."""
        with torch.no_grad():
            for e in self.entries:
                src = self._src_view(sources[e.name], e.src_geom)
                dst = self._dst_view(e.dst, e.dst_geom)
                # the sources may be on the host (shm, dist on CPU) while the parameters are on a GPU: one
                # window at a time is brought to the parameter's device
                if not torch.equal(dst, src.to(device=dst.device, dtype=dst.dtype)):
                    return f"{e.name}: the window the plan records does not hold the loaded tensor"
        self.verified = True
        return None

    def covers(self, names: set[str]) -> bool:
        return names == self.names

    def covers_part(self, names: set[str]) -> bool:
        """Every name of a part of an update (a multi-call session) has its windows in the plan."""
        return names <= self.names

    def live(self) -> str | None:
        """None if every destination is still the model's storage the plan was captured on, else why not."""
        # vLLM's parameter classes override __torch_function__: reading a storage through them runs Python per
        # call; the subclass dispatch is off for these reads (plain tensor semantics, the same storage)
        with torch._C.DisableTorchFunctionSubclass():
            if self._unchanged_since_last_check():
                return None
            for e in self._uniq:
                # the parameter's own storage (no .data alias to build); a meta tensor's is at 0
                if _storage_address(e.dst) != e.dst_ptr or e.dst.is_meta:
                    self._live_ptrs = None
                    return f"{e.name}: its parameter no longer lives where the plan recorded it (re-pointed by a " \
                           "reload, a sleep or a LoRA change)"
            for qual, d, attr, ptr in self.holders:
                if _storage_address(d.get(attr)) != ptr:
                    self._live_ptrs = None
                    return f"{qual}: the model's tensor there was replaced (the model no longer computes with the " \
                           "storage the plan writes: a reload, a LoRA change or user code re-registered it)"
            try:
                self._live_ptrs = self._snapshot()
            except (RuntimeError, NotImplementedError):
                self._live_ptrs = None
        return None

    def _snapshot(self) -> tuple[list, list, list]:
        """The parameters' own addresses and storage offsets (so their storages' addresses), and the tensors the
        model holds in their places: two C-level passes and an identity map."""
        return (list(map(torch.Tensor.data_ptr, self._uniq_dst)),
                list(map(torch.Tensor.storage_offset, self._uniq_dst)),
                list(map(dict.get, self._h_dicts, self._h_attrs)))

    def _unchanged_since_last_check(self) -> bool:
        """Every update asks: the same addresses, offsets and held objects (identity) as at the last full check
        that passed (a moved or meta parameter differs: the full check then says which, by its storage)."""
        seen = self._live_ptrs
        if seen is None:
            return False
        try:
            return list(map(torch.Tensor.data_ptr, self._uniq_dst)) == seen[0] \
                and list(map(torch.Tensor.storage_offset, self._uniq_dst)) == seen[1] \
                and all(map(operator.is_, map(dict.get, self._h_dicts, self._h_attrs), seen[2]))
        except (RuntimeError, NotImplementedError):
            return False

    def window_bytes(self) -> int:
        """Bytes of every destination window (what a backup of a whole update holds)."""
        if self._window_bytes is None:
            self._window_bytes = sum(e.dst.element_size() * _numel(e.dst_geom[0]) for e in self.entries)
        return self._window_bytes

    def entries_for(self, names: set[str] | None = None) -> list[Entry]:
        return [e for e in self.entries if names is None or e.name in names]

    def windows(self, entries: list[Entry]) -> list[torch.Tensor]:
        """The destination windows (views into the parameters; cached per entry while the plan is live)."""
        cache = self._windows
        out = []
        for e in entries:
            w = cache.get(id(e))
            if w is None:
                w = cache[id(e)] = self._dst_view(e.dst, e.dst_geom)
            out.append(w)
        return out

    def preconditions(self, entries: list[Entry], sources: dict[str, torch.Tensor], allow_cast: bool) -> str | None:
        """What ``validate-then-write`` proves before the first write (None: all hold): every source is
        resident on the destination's device and contiguous (the copy allocates nothing), its dtype is the
        destination's or castable in the copy, no source overlaps a destination window, and every destination
        is still live storage."""
        why = self.live()
        if why:
            return why
        spans: dict[int, int] = {}
        for e in entries:  # the destination storages, as sorted address intervals
            st = e.dst.data.untyped_storage()
            spans[st.data_ptr()] = st.nbytes()
        starts = sorted(spans)
        for e in entries:
            src = sources.get(e.name)
            if src is None:
                return f"{e.name}: no source tensor"
            if src.device != e.dst.device:
                return f"{e.name}: the source is on {src.device}, the parameter on {e.dst.device} (not resident)"
            if not src.is_contiguous():
                return f"{e.name}: the source is not contiguous (copying it would allocate)"
            if src.dtype != e.dst.dtype and not (allow_cast and src.is_floating_point() and e.dst.is_floating_point()):
                return f"{e.name}: dtype {src.dtype} != {e.dst.dtype}"
            st = src.untyped_storage()
            lo, hi = st.data_ptr(), st.data_ptr() + st.nbytes()
            i = bisect.bisect_right(starts, hi - 1) - 1  # the last destination starting below the source's end
            if i >= 0 and starts[i] + spans[starts[i]] > lo:
                return f"{e.name}: the source overlaps the model's parameters"
        return None

    def source_windows(self, entries: list[Entry], sources: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for e in entries:
            src = sources[e.name]
            if e.whole_source and src.is_contiguous() and list(src.shape) == list(e.dst_geom[0]):
                out.append(src)  # the window takes the whole tensor as it is: no view to build
            else:
                out.append(self._src_view(src, e.src_geom))
        return out

    def copy(self, entries: list[Entry], sources: dict[str, torch.Tensor]) -> None:
        """The write: one ``copy_`` per window (a contiguous same-dtype copy is a device memcpy)."""
        dst = self.windows(entries)
        src = self.source_windows(entries, sources)
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
