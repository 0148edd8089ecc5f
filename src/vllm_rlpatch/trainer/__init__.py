"""Trainer-side helpers (no vLLM needed): make the trainer compute what the rollout engine computes.

- The fp32 head (:mod:`~vllm_rlpatch.trainer.fp32_head`): ``fp32_lm_head(model)`` makes a trainer's output
  projection compute in float32, as the engine's does with the plugin's ``fp32_lm_head`` patch;
  ``restore_lm_head`` undoes it, ``is_fp32_lm_head`` tells.
- Processed logprobs (:mod:`~vllm_rlpatch.trainer.twin`): ``processed_logprobs(logits, token_ids,
  sampling_params, ...)`` is each sampled token's logprob under the distribution the engine sampled it from
  (penalties, temperature, min-p, top-k, top-p), differentiable; with the engine's support information it
  renormalises exactly as the engine did.
- The engine's rules and support information (:mod:`~vllm_rlpatch.trainer.support`): ``engine_rules``,
  ``EngineRules``.

    from vllm_rlpatch.trainer import fp32_lm_head, restore_lm_head, processed_logprobs
"""

from vllm_rlpatch.trainer.fp32_head import fp32_lm_head, is_fp32_lm_head, restore_lm_head
from vllm_rlpatch.trainer.inputs import SAMPLING_EPS
from vllm_rlpatch.trainer.support import EngineRules, engine_rules
from vllm_rlpatch.trainer.twin import processed_logprobs

__all__ = ["SAMPLING_EPS", "EngineRules", "engine_rules", "fp32_lm_head", "is_fp32_lm_head", "processed_logprobs",
           "restore_lm_head"]
