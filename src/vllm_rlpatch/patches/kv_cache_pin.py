"""KV-cache pin: one measured ``kv_cache_memory_bytes`` for every engine, and a warning when it is too small.

Why:   in colocated RL, vLLM sleeps while the trainer runs and wakes for rollouts. Without a pin vLLM sizes
       the KV cache from ``gpu_memory_utilization`` and its own profiling, and that sizing changed between
       releases (NeMo-RL measured 36.13 GiB available KV on 0.20 vs a 20 GiB pin needed on 0.25.1 to stop
       ``CUDA Error: out of memory at cumem_allocator.cpp`` at wake-up, PEERS.md), so teams hard-code pins
       per recipe. And a pin that is too small fails nothing: requests queue or are preempted and
       throughput drops without an error (NeMo-RL: its driver "cannot detect a too-small pin").
How:   a config contributor sets ``kv_cache_memory_bytes`` from ``VLLM_RLPATCH_KV_CACHE_BYTES`` (a size such
       as ``20GiB``, measured by ``vllm-rlpatch kv-pin``) for engines that did not pass it themselves (a
       value the user passed wins, with one WARNING when it differs). In the engine core, after vLLM
       allocated the KV cache, it logs the capacity in tokens and where the size came from, and WARNs when
       it holds fewer tokens than ``VLLM_RLPATCH_ROLLOUT_TOKENS`` (the rollout's concurrent sequences x
       prompt+generation length). ``doctor --model`` shows the same check from the config alone.
Targets: EngineArgs.create_engine_config (the shared config hook); vllm.v1.engine.core.EngineCore.
       _initialize_kv_caches (same signature and return value, a KVCacheConfig, in 0.20, 0.25 and 0.32).
Upstream: by design: vLLM's profiling-based sizing is correct for a GPU it owns; sleep/wake next to a
       trainer is the RL case (vllm#40256: KV estimate wrong with sleep mode). No upstream diff.
Remove when: vLLM sizes the KV cache with the memory a sleeping engine gives back in mind, consistently
       across releases.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_rlpatch import _wrapping, envs
from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "kv_cache_pin"
CORE_TARGET = "vllm.v1.engine.core:EngineCore._initialize_kv_caches"

USER_CONSEQUENCE = ("VLLM_RLPATCH_KV_CACHE_BYTES is not applied to this engine; if the value passed was not "
                    "measured for this GPU, model and trainer reserve, wake-up can run out of memory "
                    "(`vllm-rlpatch kv-pin` measures one)")

# What the last engine core of this process allocated (for tests and the status side channel).
LAST: dict[str, Any] = {}


def contribute(engine_args, ctx: config_hook.ConfigContext) -> None:
    pin = envs.KV_CACHE_BYTES.get()
    if pin is None:
        return
    ctx.propose("kv_cache_memory_bytes", pin, owner=NAME,
                reason=f"VLLM_RLPATCH_KV_CACHE_BYTES={envs.format_size(pin)} (measured by `vllm-rlpatch kv-pin`)",
                user_consequence=USER_CONSEQUENCE, none_is_unset=True)


def capacity(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """Tokens the allocated KV cache holds, computed the way vLLM computes its own start-up line (max
    concurrency x max_model_len, which is right for hybrid / sliding-window layouts too)."""
    from vllm.v1.core import kv_cache_utils as ku

    if hasattr(ku, "get_kv_cache_capacity"):  # 0.25+
        tokens, conc = ku.get_kv_cache_capacity(vllm_config, kv_cache_config)
    else:
        conc = ku.get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
        tokens = int(conc * vllm_config.model_config.max_model_len)
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    block = min((g.kv_cache_spec.block_size for g in groups), default=vllm_config.cache_config.block_size)
    nbytes = sum(getattr(t, "size", 0) for t in getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    return {"tokens": int(tokens), "num_blocks": int(kv_cache_config.num_blocks), "block_size": int(block),
            "bytes": int(nbytes), "max_concurrency_at_max_model_len": round(float(conc), 2),
            "max_model_len": int(vllm_config.model_config.max_model_len)}


def source_of_size(vllm_config: Any) -> str:
    pinned = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    if pinned is None:
        return f"sized by vLLM from gpu_memory_utilization={vllm_config.cache_config.gpu_memory_utilization}"
    env = envs.KV_CACHE_BYTES.get()
    if env is not None and int(env) == int(pinned):
        return f"pinned by VLLM_RLPATCH_KV_CACHE_BYTES={envs.format_size(pinned)}"
    return f"pinned by kv_cache_memory_bytes={envs.format_size(pinned)}"


def check_rollout(tokens: int, rollout: int | None) -> str | None:
    """The too-small-pin message, or None when the cache holds the declared rollout."""
    if rollout is None or tokens >= rollout:
        return None
    return (f"the KV cache holds {tokens:,} tokens but the rollout keeps {rollout:,} in flight "
            f"(VLLM_RLPATCH_ROLLOUT_TOKENS): requests will queue or be preempted and rollout throughput drops "
            f"without an error; raise the pin (`vllm-rlpatch kv-pin` measures the largest that still wakes) "
            f"or lower the rollout concurrency")


def _initialize_kv_caches_wrapper(wrapped, instance, args, kwargs):
    kv_cache_config = wrapped(*args, **kwargs)
    try:
        vllm_config = args[0] if args else kwargs.get("vllm_config")
        cap = capacity(vllm_config, kv_cache_config)
    except Exception as e:  # never break engine start-up over a log line
        logger.debug("vllm-rlpatch: %s: could not compute the KV capacity: %s", NAME, e)
        return kv_cache_config
    cap["source"] = source_of_size(vllm_config)
    rollout = envs.ROLLOUT_TOKENS.get()
    cap["rollout_tokens"] = rollout
    cap["too_small"] = check_rollout(cap["tokens"], rollout)
    LAST.clear()
    LAST.update(cap)
    logger.info("vllm-rlpatch: KV cache holds %s tokens (%d blocks x %d, %s; %s)", f"{cap['tokens']:,}",
                cap["num_blocks"], cap["block_size"], envs.format_size(cap["bytes"]) if cap["bytes"] else "?",
                cap["source"])
    if cap["too_small"]:
        logger.warning("vllm-rlpatch: %s", cap["too_small"])
    return kv_cache_config


def estimate_tokens(vllm_config: Any, nbytes: int) -> int | None:
    """Tokens ``nbytes`` of KV cache hold for this config, from the model shape alone (full attention:
    K and V of every layer per token, whole blocks). ``doctor`` uses it without starting an engine."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    try:
        layers = mc.get_num_layers(pc)
        per_token = 2 * layers * mc.get_num_kv_heads(pc) * mc.get_head_size()
        dtype = mc.dtype if cc.cache_dtype in (None, "auto") else None
        itemsize = dtype.itemsize if dtype is not None else 1  # fp8 KV caches
        per_block = per_token * itemsize * (cc.block_size or 16)
    except Exception:
        return None
    if per_block <= 0:
        return None
    return int(nbytes // per_block) * (cc.block_size or 16)


_CORE = _wrapping.LazyWrap(CORE_TARGET, _initialize_kv_caches_wrapper, NAME)


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 30, contribute))
    _CORE.apply()


def revert() -> None:
    config_hook.remove_contributor(NAME)
    _CORE.revert()


SPEC = PatchSpec(
    name=NAME,
    summary="VLLM_RLPATCH_KV_CACHE_BYTES pins kv_cache_memory_bytes (measured by `vllm-rlpatch kv-pin`); "
            "KV capacity in tokens logged, WARN below VLLM_RLPATCH_ROLLOUT_TOKENS",
    vllm=">=0.20",
    targets=(config_hook.TARGET,),
    lazy_targets=(CORE_TARGET,),
    apply=apply,
    revert=revert,
    upstream="by design upstream (profiling-based sizing for a GPU vLLM owns); vllm#40256 (sleep-mode KV estimate)",
    remove_when="vLLM sizes the KV cache for sleep/wake next to a trainer, consistently across releases",
)
