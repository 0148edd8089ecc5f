"""TRL: its colocate-mode weight sync moved onto :func:`vllm_rlpatch.refit.push_weights`, in one line.

    from vllm_rlpatch.integrations.trl import use_push_weights
    trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    use_push_weights(trainer)            # the one added line; trainer.train() as before

What TRL 1.16 does on its own (``trl/generation/vllm_generation.py``, ``VLLMGeneration.sync_weights``): every
parameter of the policy, one at a time, into ``llm.llm_engine.model_executor.driver_worker.model_runner.model
.load_weights([(name, param)])``, then ``llm.reset_prefix_cache()``. With the plugin that path is correct (the
plugin routes each direct ``load_weights`` through a strict layerwise reload); without it, on vLLM CPU it raises
half-way. :func:`use_push_weights` replaces that method on the trainer's ``VLLMGeneration`` instance (nothing
of TRL's classes changes) by one :func:`~vllm_rlpatch.refit.push_weights` of the same tensors, taken from TRL's
own ``_iter_named_params`` (its naming, its PEFT merge, its gathers): one validated, versioned update with a
guarantee level and a report (``sync.last``), whose prefix-cache policy keeps KV of older weights out.

Refused (:class:`~vllm_rlpatch.integrations.support.IntegrationError`, the trainer left as it was): a TRL
release this adapter does not know; a trainer without a colocated vLLM engine (``use_vllm=False``, or server
mode, whose sync runs on vLLM's NCCL weight-transfer engine); several processes or tensor parallelism (each
rank's engine holds one shard, driven by TRL's external launcher); FSDP or DeepSpeed ZeRO-3 (their gathers
were not verified here). A PEFT (LoRA) policy is pushed as TRL pushes it, merged: the merged tensors are copied while
TRL holds them merged (it unmerges when its iteration ends), so the update costs one extra copy of the model.
Float tensors travel in the engine's dtype (a float32 trainer's weights are cast as vLLM's loader would cast them).
"""

from __future__ import annotations

import time
from typing import Any

from vllm_rlpatch.integrations.support import IntegrationError, require_framework
from vllm_rlpatch.refit import RefitReport, push_weights

# The TRL releases whose VLLMGeneration this adapter was written against and run with.
KNOWN = ">=1.16.0,<1.17"
ALLOW_ENV = "VLLM_RLPATCH_TRL_ANY_VERSION"


def generation_of(trainer: Any) -> Any:
    """The trainer's ``VLLMGeneration`` (TRL's vLLM backend), or the object itself if it is one."""
    if type(trainer).__name__ == "VLLMGeneration":
        return trainer
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not getattr(trainer, "use_vllm", False):
        raise IntegrationError("TRL: this trainer generates without vLLM (use_vllm=False): there is no engine "
                               "whose weights need a sync")
    return gen


def refusal(gen: Any) -> str | None:
    """Why this ``VLLMGeneration``'s sync cannot move onto ``push_weights`` safely, or None."""
    if gen.mode != "colocate":
        return (f"vllm_mode={gen.mode!r}: TRL's server mode syncs through vLLM's NCCL weight-transfer engine; "
                "only colocate mode is handled (push to a server started with the plugin with "
                "push_weights(url, tensors))")
    if gen.tensor_parallel_size != 1:
        return (f"vllm_tensor_parallel_size={gen.tensor_parallel_size}: each rank's colocated engine holds one "
                "shard under TRL's external launcher; only a whole engine per process is handled")
    if gen.accelerator.num_processes != 1:
        return (f"{gen.accelerator.num_processes} training processes: only a single-process trainer with its own "
                "colocated engine is handled")
    if gen._dist.is_fsdp or gen._dist.is_zero3:
        return "FSDP/DeepSpeed ZeRO-3: their parameter gathers were not verified with this adapter"
    return None


class TrlSync:
    """The ``sync_weights`` that :func:`use_push_weights` installs on one ``VLLMGeneration``."""

    def __init__(self, gen: Any, push_kwargs: dict[str, Any]):
        self.gen = gen
        self.push_kwargs = dict(push_kwargs)
        self.reports: list[RefitReport] = []
        self.seconds: list[float] = []

    @property
    def last(self) -> RefitReport | None:
        return self.reports[-1] if self.reports else None

    def named_tensors(self) -> list[tuple[str, Any]]:
        """TRL's own parameter walk, each float tensor in the engine's dtype (TRL's ``load_weights`` lets vLLM
        cast; a trainer holding float32 master weights sends bfloat16 here, cast the same way, round to nearest).
        A PEFT policy's merged tensors are copied before TRL unmerges them."""
        dtype = self.gen.llm.llm_engine.model_config.dtype
        peft = type(self.gen.model).__module__.startswith("peft")
        out = []
        for name, t in self.gen._iter_named_params():
            t = t.detach()
            if t.is_floating_point() and t.dtype != dtype:
                t = t.to(dtype)
            elif peft:
                t = t.clone()
            out.append((name, t))
        return out

    def __call__(self) -> RefitReport:
        gen = self.gen
        t0 = time.perf_counter()
        if gen.enable_sleep_mode:  # TRL's own order (vllm_generation.py sync_weights): weights awake first
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        report = push_weights(gen.llm, self.named_tensors(), **self.push_kwargs)
        self.seconds.append(time.perf_counter() - t0)
        self.reports.append(report)
        return report


def use_push_weights(trainer: Any, **push_kwargs: Any) -> TrlSync:
    """Move a TRL trainer's colocate-mode weight sync onto ``push_weights`` (keyword arguments go to it:
    ``guarantee=``, ``mode=``, ...). Returns the installed sync (its ``reports``, ``last``, ``seconds``).
    Raises :class:`IntegrationError` before changing anything when the TRL release or the setup is refused."""
    require_framework("TRL", "trl", KNOWN, allow_env=ALLOW_ENV)
    gen = generation_of(trainer)
    if isinstance(gen.__dict__.get("sync_weights"), TrlSync):
        return gen.__dict__["sync_weights"]
    why = refusal(gen)
    if why is not None:
        raise IntegrationError(f"TRL: {why}")
    sync = TrlSync(gen, push_kwargs)
    gen.sync_weights = sync
    return sync


def restore(trainer: Any) -> None:
    """Give the trainer back TRL's own ``sync_weights``."""
    gen = generation_of(trainer)
    if isinstance(gen.__dict__.get("sync_weights"), TrlSync):
        del gen.sync_weights
