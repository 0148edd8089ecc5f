"""What ``vllm-rlpatch parity`` compares: the configurations (each one's patches, as environment), the
trainer-side references, the phases, the metrics and NeMo-RL's bound."""

from __future__ import annotations

from vllm_rlpatch.patches import ALL_PATCHES

CONFIGS = ("stock", "processed_logprobs", "fp32_lm_head", "prefix_cache", "all", "twin", "support")
# scored from the `all` engine's rollouts with another trainer-side computation (no engine of their own)
DERIVED = {"twin": "all", "support": "all"}
ENGINE_CONFIGS = tuple(c for c in CONFIGS if c not in DERIVED)
FEATURES = ("rl_defaults", "fp32_lm_head", "prefix_cache")  # the patches the configurations tell apart
CONFIG_FEATURES = {
    "stock": (),
    "processed_logprobs": ("rl_defaults",),
    "fp32_lm_head": ("fp32_lm_head",),
    "prefix_cache": ("prefix_cache",),
    "all": FEATURES,
}
CONFIG_DOC = {
    "stock": "vLLM as installed: the stock profile, every patch off but the host fixes (cpu_amx_permission, "
             "without which vLLM CPU dies on AMX hosts); weights updated with vLLM's reload_weights",
    "processed_logprobs": "rl_defaults only (processed logprobs) among the fixes",
    "fp32_lm_head": "fp32_lm_head only among the fixes",
    "prefix_cache": "prefix_cache only (the guard: no KV of older weights reused)",
    "all": "the plugin's defaults (every fix)",
    "twin": "the `all` rollouts; reference side: vllm_rlpatch.trainer.processed_logprobs (the twin of the engine's "
            "processing, no engine information)",
    "support": "the `all` rollouts; reference side: the twin with the engine's support information "
               "(lp_T - log_mass_kept per token)",
}
REFERENCES = ("fp32", "bf16_fp32_head")
REFERENCE_DOC = {"fp32": "transformers, float32 (the bf16 checkpoint upcast)",
                 "bf16_fp32_head": "transformers, bfloat16 body + fp32 head (vllm_rlpatch.trainer.fp32_lm_head)"}
PHASES = ("before_refit", "after_refit")
BOUND = 1.05
METRICS = ("token_mult_prob_error", "max_mult_prob_error", "mean_abs_diff", "kl_k3", "frac_outside_bound",
           "non_finite", "tokens", "tokens_per_s", "outside_support", "at_boundary", "mean_log_mass_kept")

DEFAULT_OUT = "vllm-rlpatch-out"


class ParityError(RuntimeError):
    pass


def config_env(name: str) -> dict[str, str]:
    """The VLLM_RLPATCH_* environment of one configuration."""
    env: dict[str, str] = {}
    if name == "stock":  # vLLM as installed; host fixes (e.g. cpu_amx_permission) stay on
        return {"VLLM_RLPATCH_PROFILE": "stock"}
    for s in ALL_PATCHES:
        if s.name in FEATURES:
            on = s.name in CONFIG_FEATURES[name]
            if s.toggle is not None:
                env[s.env.name] = s.toggle.default if on else "stock"
            else:
                env[s.env.name] = "1" if on else "0"
    return env
