"""Fire a weight-update event and bump a per-engine weight version on every update path.

Why:   vLLM has no notion of "the weights changed": nothing downstream (prefix cache, request metadata,
       refit bookkeeping) can react to an update, and no version says which weights produced a rollout.
How:   wraps ``LLMEngine.collective_rpc`` / ``AsyncLLM.collective_rpc`` in process 0 (reload_weights;
       finish_weight_update on 0.25+; update_weights on 0.20) and, in each worker,
       ``Worker.reload_weights``, the native update method and the model's ``load_weights`` (nested calls
       count once). Each side is wrapped when vLLM imports its module (the plugin imports none of
       them: the worker module alone takes 1.7 s to import in a process that never runs a worker). See :mod:`vllm_rlpatch.hooks.weights`.
       In the engine core (:mod:`vllm_rlpatch.hooks.engine_core`) every RPC is followed by a look at the
       workers' version, so updates through a framework's own worker method count too; each batch is
       stamped with the version it was scheduled under and every ``CompletionOutput`` carries
       ``rlpatch_weight_versions``: spans of output tokens with the weight version that sampled them and
       the version their KV was computed with.
Targets: vllm.v1.engine.llm_engine.LLMEngine.collective_rpc, vllm.v1.engine.async_llm.AsyncLLM.collective_rpc,
       vllm.v1.worker.gpu_worker.Worker.{reload_weights, load_model, update_weights|finish_weight_update};
       the engine-core hook (EngineCore.collective_rpc/add_request/step, Scheduler.schedule/update_from_output)
       and the front end's OutputProcessor.process_outputs / RequestState._new_completion_output.
Upstream: vLLM 0.32 has a user-set ``weight_version`` string (``update_weight_version``), not an event
       fired by every path; not reported upstream.
Remove when: vLLM emits an update event from every weight-changing path.
"""

from vllm_rlpatch.hooks import engine_core, weights
from vllm_rlpatch.registry import PatchSpec

NAME = "weight_events"


POLICY = engine_core.Policy(NAME, tags_outputs=True)


def apply() -> None:
    weights.install()
    engine_core.require(NAME)
    engine_core.add_policy(POLICY)


def revert() -> None:
    engine_core.remove_policy(NAME)
    engine_core.release(NAME)
    weights.uninstall()


SPEC = PatchSpec(
    name=NAME,
    summary="Weight-update event + per-engine weight version on every update path; outputs carry per-token "
            "version spans",
    vllm=">=0.20",
    targets=(),
    lazy_targets=(*weights.FRONTEND_TARGETS, *weights.WORKER_TARGETS, *engine_core.TARGETS),
    apply=apply,
    revert=revert,
    upstream="not reported upstream (0.32 has only a user-set weight_version string)",
    remove_when="vLLM fires an update event from reload_weights, the native API and load_weights",
)
