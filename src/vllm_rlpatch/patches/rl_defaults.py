"""RL-correct engine defaults: rollout logprobs from the distribution the sampler actually used.

Why:   vLLM returns *raw* logprobs by default (``logprobs_mode="raw_logprobs"``: log-softmax of the
       model's logits at T=1, before temperature, top-k/top-p, penalties). At T!=1 or with top-p/top-k
       those are not the behaviour policy's logprobs, so importance ratios and KL estimates in the
       trainer are wrong (on our test model at T=0.7/top-p 0.9 stock vLLM 0.32 gave
       token_mult_prob_error 1.212 vs 1.008 with processed logprobs).
How:   a config contributor sets ``logprobs_mode="processed_logprobs"`` unless the user passed
       ``logprobs_mode`` explicitly (LLM kwargs, AsyncEngineArgs, or ``--logprobs-mode`` on the CLI);
       an explicit non-processed value is kept with one WARNING naming the RL consequence.
Targets: vllm.engine.arg_utils.EngineArgs.create_engine_config (through the shared config hook).
Upstream: vLLM's default is deliberate (raw logprobs are cheaper and model-intrinsic); no upstream change
       expected. Peers set it per framework (PEERS.md A2).
Remove when: vLLM's default becomes processed logprobs.
"""

from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.registry import PatchSpec

NAME = "rl_defaults"
PROCESSED = "processed_logprobs"

RAW_CONSEQUENCE = ("rollout logprobs are then NOT the behaviour policy's whenever temperature != 1 or "
                   "top-p/top-k/penalties are used (importance ratios and KL in the trainer will be off); "
                   "unset it to get processed_logprobs")


def contribute(engine_args, ctx: config_hook.ConfigContext) -> None:
    ctx.propose("logprobs_mode", PROCESSED, owner=NAME,
                reason="returned logprobs = the sampled (processed) distribution, i.e. the behaviour policy",
                user_consequence=RAW_CONSEQUENCE)


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 20, contribute))


def revert() -> None:
    config_hook.remove_contributor(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="logprobs_mode=processed_logprobs unless the user set it (behaviour-policy logprobs)",
    vllm=">=0.20",
    targets=(config_hook.TARGET, "vllm.config.model:ModelConfig"),
    apply=apply,
    revert=revert,
    upstream="by design upstream (raw_logprobs default); not a bug report",
    remove_when="vLLM defaults to processed logprobs",
)
