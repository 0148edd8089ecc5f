"""The trainer-agnostic weight-update API.

    from vllm_rlpatch.refit import push_weights, weight_version
    report = push_weights(llm, model.state_dict().items())      # a vllm.LLM, AsyncLLM, Ray handle or URL
    report.version, report.gbps, report.stages                   # what happened, how fast
    weight_version(llm)                                          # the engine's current weight version

See :mod:`vllm_rlpatch.refit.api` (targets, modes, in-flight policies), :mod:`.transports` (shm, dist,
cuda_ipc) and :mod:`.worker` (the engine side: validation, atomic commit, rollback).
"""

from vllm_rlpatch.refit.api import EngineLayout, RefitReport, push_weights, push_weights_async, weight_version
from vllm_rlpatch.refit.protocol import RefitError, fingerprint, fingerprints

__all__ = ["EngineLayout", "RefitError", "RefitReport", "fingerprint", "fingerprints", "push_weights", "push_weights_async",
           "weight_version"]
