"""RL-correct engine defaults: behaviour-policy logprobs, sampling defaults that are the request's own.

Why:   vLLM returns *raw* logprobs by default (``logprobs_mode="raw_logprobs"``: log-softmax of the
       model's logits at T=1, before temperature, top-k/top-p, penalties). At T!=1 or with top-p/top-k
       those are not the behaviour policy's logprobs, so importance ratios and KL estimates in the
       trainer are wrong (on our test model at T=0.7/top-p 0.9 stock vLLM 0.32 gave
       token_mult_prob_error 1.212 vs 1.008 with processed logprobs). And ``generation_config="auto"``
       lets a model's ``generation_config.json`` (temperature, top-p/top-k, penalties) fill every sampling
       field a request leaves unset, so a rollout can be sampled with parameters the trainer never saw.
How:   config contributors set ``logprobs_mode="processed_logprobs"`` and ``generation_config="vllm"``
       (vLLM's neutral sampling defaults; special tokens such as extra EOS ids still come from the
       model's generation config) unless the user passed them explicitly (LLM kwargs, AsyncEngineArgs,
       or the CLI); an explicit other value is kept with one WARNING naming the RL consequence.
       ``async_scheduling`` is left to vLLM (on where the platform supports it): with the
       ``prefix_cache`` patch's in-flight handling and the ``async_preempt_discard`` backport it is safe
       around weight updates, and turning it off costs throughput (benchmarks/results/, README).
Targets: vllm.engine.arg_utils.EngineArgs.create_engine_config (through the shared config hook).
Upstream: vLLM's defaults are deliberate (raw logprobs are cheaper and model-intrinsic; "auto" follows the
       model author's advice); no upstream change expected. Peers set them per framework (PEERS.md A2).
Remove when: vLLM's defaults become processed logprobs and neutral sampling defaults.
"""

from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.registry import PatchSpec

NAME = "rl_defaults"
PROCESSED = "processed_logprobs"

RAW_CONSEQUENCE = ("rollout logprobs are then NOT the behaviour policy's whenever temperature != 1 or "
                   "top-p/top-k/penalties are used (importance ratios and KL in the trainer will be off); "
                   "unset it to get processed_logprobs")


GENCONFIG_CONSEQUENCE = ("requests that leave temperature/top-p/top-k/penalties unset are then sampled with the "
                         "values of that generation config, which the trainer may not know about")


def contribute(engine_args, ctx: config_hook.ConfigContext) -> None:
    ctx.propose("logprobs_mode", PROCESSED, owner=NAME,
                reason="returned logprobs = the sampled (processed) distribution, i.e. the behaviour policy",
                user_consequence=RAW_CONSEQUENCE)
    ctx.propose("generation_config", "vllm", owner=NAME,
                reason="neutral sampling defaults: a model's generation_config.json does not change RL sampling",
                user_consequence=GENCONFIG_CONSEQUENCE)
    ctx.keep("async_scheduling", owner=NAME,
             reason="left to vLLM (on where the platform supports it): measured safe around weight updates "
                    "with the plugin, and off gained nothing (README, benchmarks/results)")


def apply() -> None:
    config_hook.add_contributor(config_hook.Contributor(NAME, 20, contribute))


def revert() -> None:
    config_hook.remove_contributor(NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="logprobs_mode=processed_logprobs and generation_config=vllm unless the user set them",
    vllm=">=0.20",
    targets=(config_hook.TARGET, "vllm.config.model:ModelConfig"),
    apply=apply,
    revert=revert,
    upstream="by design upstream (raw_logprobs default); not a bug report",
    remove_when="vLLM defaults to processed logprobs",
)
