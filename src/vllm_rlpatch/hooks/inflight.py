"""What happens to the requests running when the weights change: one policy, applied once per update.

Modes (:data:`MODES`, the values of ``VLLM_RLPATCH_INFLIGHT`` and of ``push_weights(inflight=...)``):
``recompute`` (preempt them: their KV is rebuilt with the new weights), ``abort``, ``keep`` (they go on with
the KV of the old weights; their version spans say so) and ``refuse`` (the update is refused while any runs).

Patches that need it :func:`require` it; the engine-core hook (:mod:`vllm_rlpatch.hooks.engine_core`) calls
:func:`before_update` before an update RPC and :func:`after_update` when the weights changed, before the
patches' own update policies run. The default mode is ``VLLM_RLPATCH_INFLIGHT`` when a user that honours it
is active (the prefix-cache patch), else vLLM's own behaviour, ``keep``; a refit call's ``inflight=``
overrides it for that call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from vllm_rlpatch import envs

logger = logging.getLogger("vllm.rlpatch")

MODES = envs.INFLIGHT_MODES

_LOCK = threading.Lock()
_USERS: dict[str, bool] = {}  # user -> honours VLLM_RLPATCH_INFLIGHT


def require(user: str, honour_env: bool) -> None:
    with _LOCK:
        _USERS[user] = honour_env


def release(user: str) -> None:
    with _LOCK:
        _USERS.pop(user, None)


def active() -> bool:
    return bool(_USERS)


def default(honour_env: bool | None = None) -> str:
    """The mode when a call does not choose one (``honour_env``: as if a user honouring the variable were
    active, for ``doctor``; None: as the active users decide)."""
    if honour_env is None:
        honour_env = any(_USERS.values())
    return envs.INFLIGHT.get() if honour_env else "keep"


def mode(g: Any) -> str:
    """The mode for the update ``g`` (an engine-core guard) is running now."""
    return g.inflight_override or default()


def _how(g: Any, m: str) -> str:
    return f"inflight={m}" if g.inflight_override else f"VLLM_RLPATCH_INFLIGHT={m}"


def before_update(g: Any, method: str) -> None:
    """Refuse the update RPC ``method`` under ``refuse`` while requests run."""
    m = mode(g)
    if m == "refuse":
        running = g.running()
        if running:
            raise RuntimeError(
                f"vllm-rlpatch: weight update {method!r} refused: {len(running)} request(s) are running "
                f"({_how(g, m)}). Wait for them, pause generation, or choose recompute|abort|keep.")


def after_update(g: Any, source: str, running: int, previous_version: int) -> list[str]:
    """Apply the mode to the requests running when the weights changed. Records ``inflight``, ``recomputed``,
    ``aborted`` and ``cache_reset`` in ``g.last_update``; returns what was done, as phrases for the log."""
    m = mode(g)
    g.last_update["inflight"] = m
    if m == "refuse" and running:
        logger.error("vllm-rlpatch: weights changed through %s while %d request(s) were running although %s "
                     "(a path the plugin cannot refuse in advance); recomputing them", source, running, _how(g, m))
        m = "recompute"
    done: list[str] = []
    if m == "recompute":
        reqs = g.running()
        if reqs:
            try:
                # vLLM's own primitive: preempt every running request (their KV is freed and rebuilt, async
                # placeholders discarded) and reset the prefix cache in one go.
                g.scheduler.reset_prefix_cache(reset_running_requests=True)
                g.last_update["cache_reset"] = True
                g.last_update["recomputed"] = len(reqs)
                done.append(f"{len(reqs)} running request(s) preempted, KV rebuilt with the new weights")
            except RuntimeError as e:  # a connector still holds blocks (remote KV transfer)
                logger.error("vllm-rlpatch: could not preempt running requests for recompute: %s", e)
    elif m == "abort":
        ids = g.abort_running(f"weights changed ({_how(g, m)}, via {source})")
        g.last_update["aborted"] = list(ids)
        if ids:
            done.append(f"{len(ids)} running request(s) aborted")
    elif m == "keep" and running:
        done.append(f"{running} running request(s) keep the KV of weight version {previous_version} "
                    "(reported in their version spans)")
    return done
