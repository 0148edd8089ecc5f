"""All patch specs, in application order. Adding a patch = one module ending in ``SPEC`` + one line here."""

from vllm_rlpatch.patches import rl_defaults, weight_events, worker_extension

ALL_PATCHES = (
    weight_events.SPEC,
    worker_extension.SPEC,
    rl_defaults.SPEC,
)

BY_NAME = {s.name: s for s in ALL_PATCHES}
