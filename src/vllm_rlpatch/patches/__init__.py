"""All patch specs, in application order. Adding a patch = one module ending in ``SPEC`` + one line here."""

from vllm_rlpatch.patches import (
    async_preempt_discard,
    cpu_amx_permission,
    fp32_lm_head,
    kv_cache_pin,
    mq_bind_retry,
    mrv2_top_p,
    prefix_cache,
    refit_guard,
    refit_http,
    rl_defaults,
    sampling_support,
    tcpstore_port,
    wake_order_guard,
    weight_events,
    worker_extension,
)

ALL_PATCHES = (
    cpu_amx_permission.SPEC,
    weight_events.SPEC,
    worker_extension.SPEC,
    rl_defaults.SPEC,
    fp32_lm_head.SPEC,
    sampling_support.SPEC,
    mrv2_top_p.SPEC,
    kv_cache_pin.SPEC,
    prefix_cache.SPEC,
    refit_guard.SPEC,
    wake_order_guard.SPEC,
    refit_http.SPEC,
    async_preempt_discard.SPEC,
    mq_bind_retry.SPEC,
    tcpstore_port.SPEC,
)

BY_NAME = {s.name: s for s in ALL_PATCHES}
