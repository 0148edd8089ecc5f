"""``vllm-rlpatch parity``: do the rollout engine's logprobs agree with the trainer's, before and after a
weight update, with and without each fix?

For each configuration an engine starts in its own process (patches are chosen by environment before vLLM
is imported), samples rollouts, takes a weight update, and samples the same prompts again (so KV that
the prefix cache kept from the old weights shows up). Every sampled token's returned logprob is then
compared with a trainer-side reference from the same weights and sampling params (temperature, then
top-k, then top-p, as vLLM's sampler applies them):

- ``fp32``: the model in float32 (the bf16 checkpoint upcast), the default reference;
- ``bf16_fp32_head``: the model in bf16 with an fp32 head (:func:`vllm_rlpatch.trainer.fp32_lm_head`),
  what a bf16 trainer that follows the fp32-head advice computes.

Two configurations run no engine of their own: they score the ``all`` engine's rollouts (whose requests ask
for the engine's support information, ``extra_args={"rlpatch_support": True}``) with the trainer-side
computation a trainer would use: ``twin`` = :func:`vllm_rlpatch.trainer.processed_logprobs` on the
reference's logits (the twin of the engine's processing, no engine information), ``support`` = the same
with the engine's per-token support information (``lp_T - log_mass_kept``: never -inf).

Metrics per configuration, phase and reference: ``token_mult_prob_error`` (NeMo-RL's mean over tokens of
exp(|Δ|), Δ = vLLM logprob − reference logprob) and its max over tokens, mean |Δ|, a KL estimate
(k3: mean of r − 1 − log r with r = p_ref/p_vllm over the sampled tokens, i.e. KL(vLLM‖reference)), the
fraction of tokens with exp(|Δ|) > 1.05 (NeMo-RL's bound), non-finite tokens (a logprob of −inf on either
side, e.g. a token outside the other side's top-p set; excluded from the means) and tokens/s.

The parts: :mod:`.configs` (what is compared), :mod:`.prompts`, :mod:`.engines` (the engine runs),
:mod:`.reference` (the trainer side), :mod:`.runner` (one run, start to end), :mod:`.measure` (the metrics),
:mod:`.rendering` (the text) and :mod:`.command` (the command line).
"""

from vllm_rlpatch.tools.parity.command import main
from vllm_rlpatch.tools.parity.configs import (
    BOUND,
    CONFIG_DOC,
    CONFIG_FEATURES,
    CONFIGS,
    DEFAULT_OUT,
    DERIVED,
    ENGINE_CONFIGS,
    FEATURES,
    METRICS,
    PHASES,
    REFERENCE_DOC,
    REFERENCES,
    ParityError,
    config_env,
)
from vllm_rlpatch.tools.parity.engines import default_engine_args
from vllm_rlpatch.tools.parity.measure import metrics, worst_all
from vllm_rlpatch.tools.parity.prompts import SENTENCE_STEPS, fitted_prompts, make_prompts
from vllm_rlpatch.tools.parity.reference import Reference, processed_logprobs
from vllm_rlpatch.tools.parity.rendering import render, table
from vllm_rlpatch.tools.parity.runner import perturb, run

__all__ = ["BOUND", "CONFIGS", "CONFIG_DOC", "CONFIG_FEATURES", "DEFAULT_OUT", "DERIVED", "ENGINE_CONFIGS", "FEATURES",
           "METRICS", "PHASES", "REFERENCES", "REFERENCE_DOC", "SENTENCE_STEPS", "ParityError", "Reference", "config_env",
           "default_engine_args", "fitted_prompts", "main", "make_prompts", "metrics", "perturb", "processed_logprobs",
           "render", "run", "table", "worst_all"]
