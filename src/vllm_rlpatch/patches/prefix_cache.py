"""A prefix/KV cache that never serves KV computed with older weights, and a policy for running requests.

Why:   No weight-update path in vLLM resets the prefix cache (``reload_weights``, the native update API and
       a trainer's ``model.load_weights`` all leave it alone) and prefix caching is on by default, so after
       an update every prompt that was seen before is answered from KV of the *old* weights: measured on
       stock vLLM 0.32.0 CPU, token_mult_prob_error ~2690 against the new weights. ``reset_prefix_cache()``
       alone is not enough either: it returns False (and only logs) while running requests hold blocks.
       Requests running during an update continue with the old weights' KV, silently.
How:   ``VLLM_RLPATCH_PREFIX_CACHE`` picks the cache policy; every weight update the engine core sees
       (:mod:`vllm_rlpatch.hooks.engine_core`: any RPC, any worker-side path) triggers it:
       - ``salt`` (default): every request's ``cache_salt`` carries the weight version current when its
         tokens are computed (a user's own salt is kept and combined), so blocks of older weights are
         unreachable while the n samples of one prompt under one version still share its KV. Version 0
         (no update yet) adds no salt: nothing changes for engines that never update.
       - ``reset``: the cache is reset on every update. If vLLM refuses (blocks in use by requests kept
         running), new computation is salted until the reset succeeds, and the reset is retried before
         the first scheduling step with no running request: never ignored.
       - ``off``: prefix caching disabled (``enable_prefix_caching=False`` unless the user set it).
       - ``stock``: vLLM's own behaviour (the patch is off; stale KV possible).
       ``VLLM_RLPATCH_INFLIGHT`` decides what happens to requests running at the update: ``recompute``
       (default; preempted, KV rebuilt with the new weights, generation goes on), ``abort`` (finished with
       ``abort``), ``keep`` (continue on old KV; reported in their version spans), ``refuse`` (an update
       RPC vLLM knows is refused while requests run).
Targets: vllm.engine.arg_utils.EngineArgs.create_engine_config (config hook); the engine-core hook's
       targets (EngineCore.collective_rpc/preprocess_add_request/add_request, Scheduler.schedule/
       update_from_output/_preempt_request).
Upstream: not reported upstream as one bug; peers reset or salt by hand (PEERS.md A2: prime-rl salts with
       the policy version client-side, NeMo-RL PR #4018 found its cache never reset across 17 refits).
Remove when: vLLM invalidates its prefix cache on every weight update.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_rlpatch import envs
from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.hooks import engine_core, inflight
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "prefix_cache"
MODES = ("salt", "reset", "off", "stock")

TOGGLE = envs.mode_toggle(
    NAME, MODES, "salt", "stock",
    "Prefix-cache policy across weight updates: `salt` (default: requests are salted with the weight "
    "version, old blocks unreachable, n samples of a prompt still share KV), `reset` (reset on every "
    "update; refused resets are retried and salted meanwhile), `off` (prefix caching disabled), `stock` "
    "(vLLM's behaviour, stale KV possible; disables the patch). 1 = salt, 0 = stock.",
    aliases={"1": "salt", "0": "stock", "true": "salt", "false": "stock", "on": "salt"},
)


def mode() -> str:
    return TOGGLE.get()


def effective_mode(requested: str, caching: bool) -> str:
    """The mode an engine runs with: ``off`` with prefix caching set on explicitly is ``salt``; ``salt`` or
    ``reset`` without prefix caching is ``off`` (there is nothing to salt or reset)."""
    if requested == "off" and caching:
        return "salt"
    if requested in ("salt", "reset") and not caching:
        return "off"
    return requested


# ------------------------------------------------------------------------------------------ config side
def contribute(engine_args: Any, ctx: config_hook.ConfigContext) -> None:
    m = mode()
    if m == "off":
        ctx.propose("enable_prefix_caching", False, owner=NAME,
                    reason="VLLM_RLPATCH_PREFIX_CACHE=off: no KV is ever reused across requests",
                    user_consequence="prefix caching stays on as you asked; the engine core salts requests "
                                     "with the weight version instead (VLLM_RLPATCH_PREFIX_CACHE=salt behaviour)")
    else:
        ctx.keep("enable_prefix_caching", owner=NAME,
                 reason=f"VLLM_RLPATCH_PREFIX_CACHE={m}: caching stays on, "
                        + ("blocks of older weights unreachable (salted by weight version)" if m == "salt"
                           else "the cache is reset on every weight update"))


# ------------------------------------------------------------------------------------------ engine core
def _state(g: engine_core.Guard) -> dict[str, Any]:
    st = g.state.get(NAME)
    if st is None:
        requested = mode()
        core = g.core
        caching = bool(getattr(getattr(getattr(core, "vllm_config", None), "cache_config", None),
                               "enable_prefix_caching", True))
        m = effective_mode(requested, caching)
        if requested == "off" and m == "salt":
            logger.warning("vllm-rlpatch: VLLM_RLPATCH_PREFIX_CACHE=off but prefix caching is on (set explicitly); "
                           "salting requests with the weight version instead")
        st = g.state[NAME] = {"mode": m, "pending": 0, "pending_steps": 0, "resets": 0, "refused": 0}
        logger.info("vllm-rlpatch: prefix cache policy %s, in-flight requests at a weight update: %s",
                    m, inflight.default())
    return st


def salt_key(g: engine_core.Guard) -> str | None:
    st = _state(g)
    if st["mode"] == "salt":
        return f"rlpatch-wv{g.version}" if g.version > 0 else None
    if st["mode"] == "reset" and st["pending"]:
        return f"rlpatch-reset-pending-{st['pending']}"
    return None


def _reset(g: engine_core.Guard, st: dict[str, Any], reason: str) -> bool:
    ok = bool(g.scheduler.reset_prefix_cache())
    if ok:
        st["resets"] += 1
        if st["pending"]:
            logger.info("vllm-rlpatch: prefix-cache reset succeeded after %d step(s) (%s)", st["pending_steps"], reason)
        st["pending"] = 0
        st["pending_steps"] = 0
    return ok


def on_update(g: engine_core.Guard, info: engine_core.UpdateInfo) -> None:
    st = _state(g)
    m = st["mode"]
    done = list(g.last_update.get("inflight_done", ()))  # what the in-flight policy did just before
    if g.last_update.get("cache_reset"):  # recomputing the running requests reset the cache too
        st["resets"] += 1
        st["pending"] = 0
    if m == "reset" and not _reset(g, st, info.source):
        st["refused"] += 1
        st["pending"] += 1
        st["pending_steps"] = 0
        logger.warning("vllm-rlpatch: prefix-cache reset refused by vLLM (blocks in use by %d running request(s)); "
                       "new computation is salted until the reset succeeds, retried as soon as no running request holds blocks",
                       len(g.running()))
        done.append("prefix-cache reset refused: retrying")
    elif m == "reset":
        done.append("prefix cache reset")
    elif m == "salt":
        done.append(f"new requests salted with weight version {g.version}")
    if m in ("salt", "reset"):
        for req in g.waiting():
            if getattr(req, "num_computed_tokens", 1) == 0 and getattr(req, "block_hashes", None) is not None:
                g.salt(req, rehash=True)
    logger.info("vllm-rlpatch: prefix cache (%s), in-flight (%s): %s", m, g.last_update.get("inflight", "keep"),
                "; ".join(done) or "nothing to do")


def before_schedule(g: engine_core.Guard) -> None:
    st = g.state.get(NAME)
    if st is not None and st["pending"]:
        st["pending_steps"] += 1
        if not g.running():  # vLLM refuses (and logs a WARNING) while running requests hold blocks
            _reset(g, st, "retried once the requests holding blocks finished")


POLICY = engine_core.Policy(NAME, on_update=on_update, before_schedule=before_schedule,
                            salt_key=salt_key)


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 30, contribute))
    engine_core.require(NAME)
    engine_core.add_policy(POLICY)
    inflight.require(NAME, honour_env=True)


def revert() -> None:
    inflight.release(NAME)
    engine_core.remove_policy(NAME)
    engine_core.release(NAME)
    config_hook.remove_contributor(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Prefix/KV cache never mixes weight versions: salt by weight version (default), reset, or off; "
            "running requests recomputed/aborted/kept at an update",
    vllm=">=0.20",
    targets=(config_hook.TARGET,),
    lazy_targets=engine_core.CORE_TARGETS + engine_core.SCHED_TARGETS,
    toggle=TOGGLE,
    apply=apply,
    revert=revert,
    upstream="not reported upstream as one bug (no update path resets the cache; reset_prefix_cache() returns "
             "False while blocks are in use)",
    remove_when="vLLM invalidates its prefix cache on every weight update",
)
