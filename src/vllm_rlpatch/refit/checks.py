"""Verification of an update's bytes in one pass: a sum checksum and the count of non-finite values.

A :class:`Digest` of a tensor's bytes (viewed as little-endian int32 words; a tail of 1-3 bytes is one more
word, zero-padded) is

* ``s``: the sum of the words modulo 2**32;
* ``p``: the sum over 16 KiB blocks of (block index + 1) x (the block's word sum), modulo 2**32: moved,
  truncated or stale blocks change it;
* ``nonfinite``: how many elements are NaN or infinite (floating dtypes; from the exponent bits);
* ``nbytes``.

Integer sums modulo 2**32 do not depend on the order of the additions, so every implementation gives the same
digest: the GPU kernel (Triton: one launch per dtype class over *all* tensors of an update, a pointer table
and a work list of 16 KiB blocks, three atomic adds per block), the torch reduction (CPU, or a GPU without
Triton), and :func:`pack_and_digest`, which copies tensors into a byte buffer (the ``shm`` transport's
segments) chunk by chunk and digests each chunk while it is still in the cache (one trip through memory
instead of three: copy, checksum, finite check).

The checksum detects corrupt, truncated, stale or misplaced bytes, not an adversary. "Unchanged" in the tests
is ``torch.equal`` against a copy, never a checksum.

A pass over CPU tensors runs with torch's intra-op threads lowered to the CPUs that no other process's runnable
task holds at its start (:func:`bounded_threads`), and restored after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
from typing import Iterable, Sequence

import torch

BLOCK_WORDS = 4096  # 16 KiB per checksum block
# Launch configurations measured on an H200 over the 291 tensors of a Llama-3-8B shape (16.06 GB;
# benchmarks/gpu/check_kernels.py, benchmarks/results/check_kernels-h200.json): checksum blocks per program and
# warps. The digest kernel: 4 blocks x 4 warps 4.54 ms (2 x 8: 4.81 ms; a device copy of the bytes 7.66 ms).
# The copy-and-check kernel: 1 block x 8 warps 10.8 ms (2 x 8: 14.6 ms; per-tensor copies then a digest pass:
# 14.0 ms). Neither changes the digest's definition.
GROUP = 4
DIGEST_WARPS = 4
COPY_GROUP = 1
COPY_WARPS = 8
_MASK32 = 0xFFFFFFFF
# exponent masks of the floating formats whose non-finite values the kernel reads from the bits
_HALF_MASKS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
_WORD_MASKS = {torch.float32: 0x7F800000}


@dataclasses.dataclass(frozen=True)
class Digest:
    s: int
    p: int
    nonfinite: int
    nbytes: int

    @property
    def key(self) -> str:
        """The checksum as one string (what crosses process boundaries and is compared)."""
        return f"{self.s & _MASK32:08x}{self.p & _MASK32:08x}:{self.nbytes}"

    def same_bytes(self, other: "Digest") -> bool:
        return self.key == other.key


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    b = t.reshape(-1)
    return b.view(torch.uint8) if b.dtype != torch.bool else b.to(torch.uint8)


def _words(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(int32 view of the whole words, the zero-padded tail word or None)."""
    n = b.numel()
    nw = n // 4
    head = b[: nw * 4]
    try:
        w = head.view(torch.int32)
    except RuntimeError:  # a view at an offset that is not 4-byte aligned
        w = head.clone().view(torch.int32)
    tail = None
    if n % 4:
        pad = torch.zeros(4, dtype=torch.uint8, device=b.device)
        pad[: n % 4] = b[nw * 4:]
        tail = pad.view(torch.int32)
    return w, tail


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    """0-dim int64 tensor: NaN/inf elements of ``t`` (0 for non-float dtypes). One min/max reduction (NaN
    propagates through both, an infinity is the min or the max; ~30 GB/s on two CPU cores for bf16, unlike a
    float32 sum that converts every element); the elements are counted only when it finds one."""
    if not t.is_floating_point() or t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    try:
        lo, hi = torch.aminmax(t.reshape(-1))
    except (RuntimeError, NotImplementedError):  # a dtype without min/max kernels here (fp8): widen in chunks
        flat = t.reshape(-1)
        step = 1 << 24
        return sum(((~torch.isfinite(flat[i:i + step].to(torch.float16))).sum() for i in range(0, flat.numel(), step)),
                   torch.zeros((), dtype=torch.int64, device=t.device))
    if bool(torch.isfinite(lo) & torch.isfinite(hi)):
        return torch.zeros((), dtype=torch.int64, device=t.device)
    return (~torch.isfinite(t)).sum()


def _sums_torch(b: torch.Tensor, block_offset: int = 0) -> tuple[int, int]:
    """(s, p) of a byte buffer whose first block is block number ``block_offset`` (a multiple of 16 KiB)."""
    w, tail = _words(b)
    n = w.numel()
    m = n // BLOCK_WORDS
    s = 0
    p = 0
    if m:
        # int32 accumulation wraps modulo 2**32, which is the checksum's arithmetic (and ~20x faster on a CPU
        # than an int64 accumulation); the m block sums are then small work
        blocks = w[: m * BLOCK_WORDS].view(m, BLOCK_WORDS).sum(1, dtype=torch.int32).to(torch.int64) & _MASK32
        idx = torch.arange(block_offset + 1, block_offset + m + 1, device=w.device, dtype=torch.int64)
        pair = torch.stack([blocks.sum(), (blocks * idx).sum()]).tolist()
        s, p = pair
    rest = w[m * BLOCK_WORDS:].sum(dtype=torch.int64)
    if tail is not None:
        rest = rest + tail.to(torch.int64).sum()
    r = int(rest) & _MASK32
    s += r
    p += r * (block_offset + m + 1)
    return s & _MASK32, p & _MASK32


def digest_torch(t: torch.Tensor) -> Digest:
    b = _bytes_of(t)
    s, p = _sums_torch(b)
    return Digest(s, p, int(_nonfinite(t)), b.numel())


# ------------------------------------------------------------------------------------------ CPU threads
def _runnable_elsewhere() -> int | None:
    """Runnable tasks of other processes now: the kernel's count of runnable tasks (``/proc/loadavg``) less
    this process's own (its OpenMP threads spin for a while after each parallel region, and the caller runs).
    None where ``/proc`` does not tell."""
    try:
        with open("/proc/loadavg") as fh:
            running = int(fh.read().split()[3].split("/")[0])
        tids = os.listdir("/proc/self/task")
    except (OSError, ValueError, IndexError):
        return None
    own = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                own += fh.read().rpartition(")")[2].split()[0] == "R"
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return max(0, running - own)


def pass_threads() -> int:
    """The intra-op threads a CPU check pass takes now: torch's setting for this thread, less the CPUs that
    other processes' runnable tasks hold (their share of this process's CPUs, where it may use fewer than the
    machine's); at least 1. A runnable task is counted even where it would give its CPU away (vLLM's idle
    workers spin on ``sched_yield`` for a second after each message): then the pass takes fewer threads than it
    could, never more. (Timing a parallel region instead does not tell: its first run after a pause is fast
    under load too, while OpenMP's threads sleep.)"""
    have = torch.get_num_threads()
    if have <= 1:
        return have
    busy = _runnable_elsewhere()
    if busy is None:
        return have
    mine = len(os.sched_getaffinity(0))  # /proc answered: Linux
    held = math.floor(busy * mine / max(os.cpu_count() or mine, mine) + 0.5)
    return max(1, min(have, mine - held))


@contextlib.contextmanager
def bounded_threads():
    """Torch's intra-op threads lowered to :func:`pass_threads` for a pass over CPU tensors, then restored.

    Why: every parallel region of OpenMP ends in a barrier. With another process holding one of the CPUs, each
    region of a check pass (a few per 4 MiB chunk) waits for a descheduled thread, a scheduler slice of
    milliseconds: the default update took 3.3x the time of an unchecked one on two cores with one busy
    process, 1.2x on an idle host. Threads no more than the free CPUs do not wait on one another. The setting is
    the calling thread's (OpenMP's thread count is per thread); a thread that makes its first torch call during
    the pass starts with the lowered count."""
    old = torch.get_num_threads()
    n = pass_threads()
    if n >= old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------ Triton (GPU)
@functools.lru_cache(maxsize=1)
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def digest_kernel(ptrs, nwords, work_t, work_b, out, MODE: tl.constexpr, MASK: tl.constexpr,
                      BLOCK: tl.constexpr, GROUP: tl.constexpr):
        # one program: a [GROUP, BLOCK] tile = GROUP consecutive checksum blocks of one tensor; three atomic adds
        pid = tl.program_id(0)
        ti = tl.load(work_t + pid)
        b0 = tl.load(work_b + pid).to(tl.int64)
        base = tl.load(ptrs + ti).to(tl.pointer_type(tl.int32))
        n = tl.load(nwords + ti)
        blocks = b0 + tl.arange(0, GROUP).to(tl.int64)
        offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        w = tl.load(base + offs, mask=offs < n, other=0)
        bs = tl.sum(w, axis=1)  # the GROUP block sums (int32, wrapping)
        s = tl.sum(bs, axis=0)
        p = tl.sum(bs * (blocks + 1).to(tl.int32), axis=0)
        tl.atomic_add(out + ti * 3 + 0, s)
        tl.atomic_add(out + ti * 3 + 1, p)
        if MODE == 1:  # two 16-bit floats per word
            lo = w & MASK
            hi = (w >> 16) & MASK
            bad = tl.sum(tl.sum((lo == MASK).to(tl.int32) + (hi == MASK).to(tl.int32), axis=1), axis=0)
            tl.atomic_add(out + ti * 3 + 2, bad)
        elif MODE == 2:  # one 32-bit float per word
            bad = tl.sum(tl.sum(((w & MASK) == MASK).to(tl.int32), axis=1), axis=0)
            tl.atomic_add(out + ti * 3 + 2, bad)

    return digest_kernel


_WORK_LOCK = threading.Lock()
_WORK: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _worklist(nwords: tuple[int, ...], device: torch.device, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, first block index) of every program (``group`` blocks of one tensor), on the device;
    cached per shape list."""
    key = (nwords, str(device), group)
    with _WORK_LOCK:
        hit = _WORK.get(key)
        if hit is not None:
            return hit
        span = BLOCK_WORDS * group
        counts = torch.tensor([(n + span - 1) // span for n in nwords], dtype=torch.int64, device=device)
        t_idx = torch.repeat_interleave(torch.arange(len(nwords), device=device, dtype=torch.int32), counts)
        starts = torch.cumsum(counts, 0) - counts
        b_idx = ((torch.arange(int(counts.sum()), device=device, dtype=torch.int64)
                  - torch.repeat_interleave(starts, counts)) * group).to(torch.int32)
        if len(_WORK) > 16:
            _WORK.clear()
        _WORK[key] = (t_idx, b_idx)
        return t_idx, b_idx


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _tables(ptrs: tuple[int, ...], nwords: tuple[int, ...], device: torch.device):
    """The pointer and length tables on the device (cached: a trainer's tensors keep their addresses)."""
    key = (ptrs, nwords, str(device))
    with _WORK_LOCK:
        hit = _TABLES.get(key)
        if hit is None:
            if len(_TABLES) > 16:
                _TABLES.clear()
            hit = _TABLES[key] = (torch.tensor(ptrs, dtype=torch.int64, device=device),
                                  torch.tensor(nwords, dtype=torch.int64, device=device))
        return hit


def _mode_of(dtype: torch.dtype) -> tuple[int, int]:
    if dtype in _HALF_MASKS:
        return 1, _HALF_MASKS[dtype]
    if dtype in _WORD_MASKS:
        return 2, _WORD_MASKS[dtype]
    return 0, 0


def _kernel_ok(t: torch.Tensor) -> bool:
    return (t.is_cuda and t.is_contiguous() and t.numel() > 0 and (t.numel() * t.element_size()) % 4 == 0
            and t.data_ptr() % 4 == 0 and (t.dtype in _HALF_MASKS or t.dtype in _WORD_MASKS
                                           or not t.is_floating_point()))


class DigestPlan:
    """The kernel's launches prepared once for a fixed list of CUDA tensors (an update repeats the same
    tensors every step): pointer tables, work lists and the accumulator are built once, :meth:`run` launches
    one kernel per dtype class and returns the ``[n, 3]`` int32 (s, p, nonfinite) rows, on the device."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        kern = _kernel()
        assert kern is not None
        self.kern = kern
        self.dev = tensors[0].device
        self.nbytes = [t.numel() * t.element_size() for t in tensors]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(_mode_of(t.dtype), []).append(i)
        self.acc = torch.zeros(len(tensors), 3, dtype=torch.int32, device=self.dev)
        self.launches = []
        for (mode, mask), idx in groups.items():
            nwords = tuple(tensors[i].numel() * tensors[i].element_size() // 4 for i in idx)
            ptrs, nw = _tables(tuple(tensors[i].data_ptr() for i in idx), nwords, self.dev)
            t_idx, b_idx = _worklist(nwords, self.dev)
            rows = torch.tensor(idx, dtype=torch.int64, device=self.dev)
            part = torch.zeros(len(idx) * 3, dtype=torch.int32, device=self.dev)
            self.launches.append((mode, mask, ptrs, nw, t_idx, b_idx, rows, part))

    def run(self) -> torch.Tensor:
        for mode, mask, ptrs, nw, t_idx, b_idx, rows, part in self.launches:
            part.zero_()
            self.kern[(t_idx.numel(),)](ptrs, nw, t_idx, b_idx, part, MODE=mode, MASK=mask, BLOCK=BLOCK_WORDS,
                                        GROUP=GROUP, num_warps=DIGEST_WARPS)
            self.acc.index_copy_(0, rows, part.view(-1, 3))
        return self.acc

    def digests(self) -> list[Digest]:
        vals = self.run().tolist()  # one device synchronisation
        return [Digest(s & _MASK32, p & _MASK32, int(bad), n) for (s, p, bad), n in zip(vals, self.nbytes)]


_PLANS: dict[tuple, DigestPlan] = {}


def _plan_key(tensors: Sequence[torch.Tensor]) -> tuple:
    # addresses are unique across the devices of one process (unified virtual addressing): no device needed
    return tuple((t.data_ptr(), t.nbytes, t.dtype) for t in tensors)


def _cached_plan(tensors: Sequence[torch.Tensor]) -> DigestPlan | None:
    """A plan prepared for exactly these tensors before (same addresses, sizes, dtypes; a prepared plan only
    exists for tensors that passed the kernel's checks)."""
    with _WORK_LOCK:
        return _PLANS.get(_plan_key(tensors))


def digest_plan(tensors: Sequence[torch.Tensor]) -> DigestPlan:
    """A :class:`DigestPlan` for these tensors (cached by their addresses, sizes and dtypes)."""
    key = _plan_key(tensors)
    with _WORK_LOCK:
        plan = _PLANS.get(key)
    if plan is None:
        plan = DigestPlan(tensors)
        with _WORK_LOCK:
            if len(_PLANS) > 8:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _digest_kernel(tensors: Sequence[torch.Tensor]) -> list[Digest]:
    """All tensors (same device, kernel-compatible) in one launch per dtype class."""
    return digest_plan(tensors).digests()


def parse_keys(keys: Sequence[str | None]) -> list[tuple[int, int] | None]:
    out: list[tuple[int, int] | None] = []
    for k in keys:
        out.append(None if not k else (int(k[:8], 16), int(k[8:16], 16)))
    return out


def mismatches(tensors: Sequence[torch.Tensor], expected: Sequence[str | None]) -> list[int]:
    """Indexes of the tensors whose bytes' checksum is not the expected key (None: not checked). On a GPU the
    comparison runs on the device: one launch per dtype class, one synchronisation."""
    plan = _cached_plan(tensors) if tensors and _KERNEL_ERROR is None and tensors[0].is_cuda else None
    if plan is not None or (tensors and all(_kernel_ok(t) for t in tensors) and kernel_available(tensors[0].device)):
        try:
            acc = (plan or digest_plan(tensors)).run()
            want = parse_keys(expected)
            have = [i for i, w in enumerate(want) if w is not None]
            if not have:
                return []
            exp = torch.tensor([want[i] for i in have], dtype=torch.int64).to(acc.device, non_blocking=True)
            got = acc[torch.tensor(have, device=acc.device), :2].to(torch.int64) & _MASK32
            bad = (got != exp).any(dim=1).nonzero().flatten().tolist()
            return [have[i] for i in bad]
        except Exception as e:  # noqa: BLE001
            _disable_kernel(e)
    got = digests(tensors)
    return [i for i, (g, w) in enumerate(zip(got, expected)) if w is not None and g.key != w]


def kernel_available(device: torch.device | str | None = None) -> bool:
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return False
    return _KERNEL_ERROR is None and torch.cuda.is_available() and _kernel() is not None


class PendingDigests:
    """Digests started now and read later: on a GPU the kernel is launched at once (asynchronously) and
    :meth:`result` waits for it, so the caller's CPU work in between (metadata, handles) overlaps it.
    Elsewhere :meth:`result` computes them."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)
        self.plan: DigestPlan | None = None
        self.acc: torch.Tensor | None = None
        ts = self.tensors
        if ts and _KERNEL_ERROR is None and ts[0].is_cuda:
            plan = _cached_plan(ts)
            try:
                if plan is None and all(_kernel_ok(t) for t in ts) and kernel_available(ts[0].device):
                    plan = digest_plan(ts)
                if plan is not None:
                    self.acc, self.plan = plan.run(), plan
            except Exception as e:  # noqa: BLE001 - the torch reduction in result()
                _disable_kernel(e)

    def result(self) -> list[Digest]:
        if self.plan is not None and self.acc is not None:
            vals = self.acc.tolist()  # one device synchronisation
            return [Digest(s & _MASK32, p & _MASK32, int(bad), n) for (s, p, bad), n in zip(vals, self.plan.nbytes)]
        return digests(self.tensors)


# ------------------------------------------------------------------------------------------ public
def digests(tensors: Iterable[torch.Tensor]) -> list[Digest]:
    """The digest of every tensor: CUDA tensors through the kernel (one launch per dtype class and device),
    the rest through torch reductions."""
    tensors = list(tensors)
    if tensors and _KERNEL_ERROR is None and tensors[0].is_cuda:  # the same tensors as before: a prepared plan
        hit = _cached_plan(tensors)
        if hit is not None:
            return hit.digests()
    out: list[Digest | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    rest = []
    for i, t in enumerate(tensors):
        if _kernel_ok(t) and kernel_available(t.device):
            by_dev.setdefault(t.device, []).append(i)
        else:
            rest.append(i)
    with bounded_threads() if any(tensors[i].device.type == "cpu" for i in rest) else contextlib.nullcontext():
        for i in rest:
            out[i] = digest_torch(tensors[i])
    for dev, idx in by_dev.items():
        try:
            ds = _digest_kernel([tensors[i] for i in idx])
        except Exception as e:  # noqa: BLE001 - a kernel that does not build here: the torch reduction instead
            _disable_kernel(e)
            ds = [digest_torch(tensors[i]) for i in idx]
        for i, d in zip(idx, ds):
            out[i] = d
    return out  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------ copy + check
@functools.lru_cache(maxsize=1)
def _copy_kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def copy_check_kernel(src_ptrs, dst_ptrs, nwords, work_t, work_b, out, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                          READBACK: tl.constexpr = 0):
        # one program: GROUP checksum blocks of one window; copy them, then read the destination back and digest
        # what it holds (s, p as in digest_kernel); two atomic adds per program
        pid = tl.program_id(0)
        ti = tl.load(work_t + pid)
        b0 = tl.load(work_b + pid).to(tl.int64)
        src = tl.load(src_ptrs + ti).to(tl.pointer_type(tl.int32))
        dst = tl.load(dst_ptrs + ti).to(tl.pointer_type(tl.int32))
        n = tl.load(nwords + ti)
        blocks = b0 + tl.arange(0, GROUP).to(tl.int64)
        offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        m = offs < n
        w = tl.load(src + offs, mask=m, other=0)
        tl.store(dst + offs, w, mask=m)
        # READBACK 0: a block barrier, then every thread reads the destination back from memory (volatile: from
        # L2, not from registers); 1: the same without the barrier (each thread reads back its own stores);
        # 2: an L2 (.cg) load without the barrier; 3: no read-back, the stored values are digested (a bound
        # for measurements, not a check of the destination)
        if READBACK == 0:
            tl.debug_barrier()
            r = tl.load(dst + offs, mask=m, other=0, volatile=True)
        elif READBACK == 1:
            r = tl.load(dst + offs, mask=m, other=0, volatile=True)
        elif READBACK == 2:
            r = tl.load(dst + offs, mask=m, other=0, cache_modifier=".cg")
        else:
            r = w
        bs = tl.sum(r, axis=1)
        s = tl.sum(bs, axis=0)
        p = tl.sum(bs * (blocks + 1).to(tl.int32), axis=0)
        tl.atomic_add(out + ti * 2 + 0, s)
        tl.atomic_add(out + ti * 2 + 1, p)

    return copy_check_kernel


def copy_check_ok(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Can the fused copy-and-check kernel take this window? Same dtype (a byte copy, no cast), both
    contiguous, whole 4-byte words, aligned."""
    return (dst.dtype == src.dtype and dst.device == src.device and dst.is_contiguous() and src.is_contiguous()
            and dst.numel() == src.numel() and dst.numel() > 0 and (dst.numel() * dst.element_size()) % 4 == 0
            and dst.data_ptr() % 4 == 0 and src.data_ptr() % 4 == 0)


class CopyCheckPlan:
    """The write of a validated update and its post-write check as one kernel pass: every (source, destination
    window) pair is copied block by block, and each block of the destination is read back from memory right
    after its store and digested. The digests are those of :class:`DigestPlan` (the same definition), so they
    compare with the sources' validated digests; the pass costs about one copy instead of a copy plus a
    digest pass over the destination. Prepared once per list of windows (an update template repeats them)."""

    def __init__(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]):
        kern = _copy_kernel()
        assert kern is not None
        self.kern = kern
        self.dev = dst[0].device
        nwords = tuple(d.numel() * d.element_size() // 4 for d in dst)
        self.src_ptrs = torch.tensor([t.data_ptr() for t in src], dtype=torch.int64, device=self.dev)
        self.dst_ptrs = torch.tensor([t.data_ptr() for t in dst], dtype=torch.int64, device=self.dev)
        self.nwords = torch.tensor(nwords, dtype=torch.int64, device=self.dev)
        self.t_idx, self.b_idx = _worklist(nwords, self.dev, COPY_GROUP)
        self.acc = torch.zeros(len(dst), 2, dtype=torch.int32, device=self.dev)
        self.n = len(dst)

    def run(self) -> torch.Tensor:
        """Copy every window and return the ``[n, 2]`` (s, p) digests of what the destinations hold (device)."""
        self.acc.zero_()
        self.kern[(self.t_idx.numel(),)](self.src_ptrs, self.dst_ptrs, self.nwords, self.t_idx, self.b_idx, self.acc,
                                         BLOCK=BLOCK_WORDS, GROUP=COPY_GROUP, num_warps=COPY_WARPS)
        return self.acc

    def run_and_compare(self, expected: Sequence[str | None]) -> list[int]:
        """Copy, check, and return the indexes whose destination digest is not ``expected`` (None: unchecked).
        One synchronisation."""
        acc = self.run()
        want = parse_keys(expected)
        have = [i for i, w in enumerate(want) if w is not None]
        if not have:
            torch.cuda.synchronize(self.dev) if self.dev.type == "cuda" else None
            return []
        exp = torch.tensor([want[i] for i in have], dtype=torch.int64).to(self.dev, non_blocking=True)
        got = (acc if len(have) == self.n else acc[torch.tensor(have, device=self.dev)]).to(torch.int64) & _MASK32
        bad = (got != exp).any(dim=1).nonzero().flatten().tolist()
        return [have[i] for i in bad]


_COPY_PLANS: dict[tuple, CopyCheckPlan] = {}
_COPY_WARM: set[str] = set()


def _copy_kernel_warm(device: torch.device) -> bool:
    """Compile the kernel on scratch memory before it touches a model (a kernel that fails to build must not
    leave an update half-written): False, and the two-pass copy + check from then on, if it fails."""
    if str(device) in _COPY_WARM:
        return True
    try:
        a = torch.arange(8, dtype=torch.int32, device=device)
        b = torch.zeros(8, dtype=torch.int32, device=device)
        bad = CopyCheckPlan([b], [a]).run_and_compare([digest_torch(a.cpu()).key])
        if bad or not torch.equal(a, b):
            raise RuntimeError("the fused copy-and-check kernel gave a wrong result on scratch memory")
    except Exception as e:  # noqa: BLE001
        _disable_kernel(e)
        return False
    _COPY_WARM.add(str(device))
    return True


def copy_check_plan(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> CopyCheckPlan | None:
    """A :class:`CopyCheckPlan` for these windows (cached by their addresses and sizes), or None where the kernel
    does not apply (not CUDA, no Triton, a window it cannot take: the caller copies and checks in two passes)."""
    if not dst or len(dst) != len(src) or _KERNEL_ERROR is not None or not dst[0].is_cuda:
        return None
    key = tuple((d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in zip(dst, src))
    with _WORK_LOCK:
        plan = _COPY_PLANS.get(key)
    if plan is not None:
        return plan
    if not kernel_available(dst[0].device) or _copy_kernel() is None \
            or not all(copy_check_ok(d, s) for d, s in zip(dst, src)):
        return None
    if not _copy_kernel_warm(dst[0].device):
        return None
    plan = CopyCheckPlan(dst, src)
    with _WORK_LOCK:
        if len(_COPY_PLANS) > 8:
            _COPY_PLANS.clear()
        _COPY_PLANS[key] = plan
    return plan


_KERNEL_ERROR: str | None = None


def _disable_kernel(e: BaseException) -> None:
    global _KERNEL_ERROR
    if _KERNEL_ERROR is None:
        import logging

        _KERNEL_ERROR = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        logging.getLogger("vllm.rlpatch").warning("vllm-rlpatch: the fused check kernel failed (%s); using torch "
                                                  "reductions instead", _KERNEL_ERROR)


def digest(t: torch.Tensor) -> Digest:
    return digests([t])[0]


def keys(tensors: Iterable[torch.Tensor]) -> list[str]:
    return [d.key for d in digests(tensors)]


PACK_CHUNK = 4 << 20  # bytes: a multiple of the 16 KiB block, small enough to stay in the cache


def pack_and_digest(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], *, check: bool = True) -> list[Digest | None]:
    """Copy each ``(source tensor, destination uint8 slice)`` and digest the destination in the same trip:
    chunk by chunk, each chunk's checksum and finite check read it while it is still in the cache.
    ``check=False``: copy only (digests are None). CPU tensors: the pass runs under :func:`bounded_threads`."""
    out: list[Digest | None] = []
    with torch.no_grad(), bounded_threads():
        for src, dst in pairs:
            sb = _bytes_of(src)
            n = sb.numel()
            if not check:
                dst[:n].copy_(sb)
                out.append(None)
                continue
            s = p = 0
            bad = torch.zeros((), dtype=torch.int64)
            fp = src.is_floating_point()
            step = max(PACK_CHUNK - PACK_CHUNK % (BLOCK_WORDS * 4), BLOCK_WORDS * 4)
            for off in range(0, n, step):
                end = min(off + step, n)
                d = dst[off:end]
                d.copy_(sb[off:end])
                cs, cp = _sums_torch(d, off // (BLOCK_WORDS * 4))
                s += cs
                p += cp
                if fp:  # chunk bounds are multiples of 16 KiB: whole elements
                    bad += _nonfinite(d.view(src.dtype))
            out.append(Digest(s & _MASK32, p & _MASK32, int(bad), n))
    return out
