"""The trainer-agnostic weight-update API.

    from vllm_rlpatch.refit import push_weights, refit_session, weight_version
    report = push_weights(llm, model.state_dict().items())      # a vllm.LLM, AsyncLLM, Ray handle or URL
    report.guarantee, report.version, report.stages              # what was promised and what happened
    with refit_session(llm) as s:                                # one update in several calls
        for bucket in buckets:
            s.push(bucket)
    weight_version(llm)                                          # the engine's current weight version
    push_weights([llm_a, llm_b], tensors)                        # a fleet: every engine or none (.fleet)

Layout: :mod:`.api` (the entry points), :mod:`.push` (one update's steps), :mod:`.outgoing` (the sender of one
update), :mod:`.caches` (what it keeps per engine), :mod:`.report`, :mod:`.session`, :mod:`.fleet`, :mod:`.target`
(what can be updated), :mod:`.coordinator` (the worker RPCs in order), :mod:`.transports` (the transports by
name), one module per transport with its sender and its source (:mod:`.shm`, :mod:`.dist`, :mod:`.cuda_ipc` with
:mod:`.ipc_sender`), and on the engine side :mod:`.transaction` (the worker's refit state; the guarantee levels),
:mod:`.prepare` (the preparation steps, in order), :mod:`.sources` (the sources by transport), :mod:`.commit`
(:mod:`.write_plan`, :mod:`.write_layerwise`, :mod:`.undo`), :mod:`.backup`, :mod:`.plan` (the copy plan) and
:mod:`.checks` (the fused checksum + finite check).
"""

from vllm_rlpatch.refit.report import RefitReport
from vllm_rlpatch.refit.api import push_weights, push_weights_async, weight_version
from vllm_rlpatch.refit.fleet import FleetReport
from vllm_rlpatch.refit.cuda_ipc import EngineLayout
from vllm_rlpatch.refit.protocol import GUARANTEES, RefitError, fingerprint, fingerprints
from vllm_rlpatch.refit.session import RefitSession, refit_session
from vllm_rlpatch.refit.target import Target

__all__ = ["EngineLayout", "FleetReport", "GUARANTEES", "RefitError", "RefitReport", "RefitSession", "Target", "fingerprint",
           "fingerprints", "push_weights", "push_weights_async", "refit_session", "weight_version"]
