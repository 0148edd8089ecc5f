"""A worker's copy plan over its life: captured after a complete layerwise update, trusted while live.

:class:`PlanKeeper` holds the worker's :class:`~vllm_rlpatch.refit.plan.CopyPlan` (``None``: not tried yet;
``False``: not usable here, a quantized or LoRA engine, or a loader the plan cannot record) and the note every
result and ``describe`` carry. :func:`engine_layout` derives from a verified plan the zero-pack buffer layout
(:class:`~vllm_rlpatch.refit.cuda_ipc.EngineLayout`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.plan import CopyPlan, PlanError
from vllm_rlpatch.refit.tx_state import Part, Transaction

logger = logging.getLogger("vllm.rlpatch")


class PlanKeeper:
    def __init__(self) -> None:
        self.plan: CopyPlan | bool | None = None
        self.note = "not captured yet (the first complete update captures and verifies it)"

    @property
    def verified(self) -> CopyPlan | None:
        plan = self.plan
        return plan if isinstance(plan, CopyPlan) and plan.verified else None

    def usable(self, names: frozenset[str], subset: bool) -> bool:
        """Does the verified plan cover ``names`` (all of the model's, or a ``subset``), and is it still live?
        A plan that is no longer live is dropped (the next complete update captures a new one)."""
        plan = self.verified
        if plan is None:
            return False
        why = plan.live()
        if why is not None:
            self.plan, self.note = None, f"invalidated: {why}; the next complete update captures a new one"
            logger.info("vllm-rlpatch: refit copy plan %s", self.note)
            return False
        return plan.covers_part(names) if subset else plan.covers(names)

    def capture(self, worker: Any, model: Any, aliases: dict[str, str], tx: Transaction, part: Part | None) -> None:
        """Record and verify the copy plan after a complete layerwise update (GPU, unquantized, no LoRA)."""
        if getattr(worker.model_config, "quantization", None) is not None:
            self.plan, self.note = False, "not used: quantized model (post-processing changes the weights)"
            return
        if any(type(m).__name__.endswith("WithLoRA") for m in model.modules()):
            self.plan, self.note = False, "not used: LoRA engine"
            return
        if part is None or part.tensors is None:
            self.note = "not captured yet (needs a non-streamed update to verify against)"
            return
        names = {m.name for m in part.metas if m.name not in aliases}
        metas = [(m.name, m.shape, P.dtype_of(m.dtype)) for m in part.metas if m.name in names]
        try:
            plan = CopyPlan.capture(model, metas, skip=set(aliases))
            why = plan.verify({n: part.tensors[n] for n in names})
        except PlanError as e:
            self.plan, self.note = False, f"not usable: {e}"
            logger.info("vllm-rlpatch: refit copy plan not usable for this model: %s", e)
            return
        except Exception as e:  # noqa: BLE001 - the plan is an optimisation: the update itself has landed
            self.plan, self.note = None, f"capture failed ({type(e).__name__}: {e}); retried on the next update"
            logger.warning("vllm-rlpatch: recording the refit copy plan failed (%s: %s); updates keep vLLM's "
                           "layerwise reload until a capture succeeds", type(e).__name__, e)
            return
        if why is not None:
            self.plan, self.note = False, f"not usable: {why}"
            logger.warning("vllm-rlpatch: refit copy plan failed verification: %s", why)
            return
        self.plan = plan
        self.note = f"verified: {plan.copies} slice copies for {len(plan.names)} tensors"
        tx.check("plan_verified")
        logger.info("vllm-rlpatch: refit copy plan recorded and verified (%d copies, %.2f s); later complete "
                    "updates are slice copies", plan.copies, plan.capture_seconds)


def engine_layout(plan: CopyPlan) -> dict[str, Any]:
    """The engine layout a zero-pack trainer buffer uses: where every trainer tensor sits, as a strided view, in
    one buffer of this worker's dtype (each parameter 64-byte aligned)."""
    by_name: dict[str, list] = {}
    for e in plan.entries:
        by_name.setdefault(e.name, []).append(e)
    params: list[torch.Tensor] = []
    starts: dict[int, int] = {}  # a parameter's storage address -> its offset in the buffer
    views: dict[str, list] = {}
    offset = 0  # in elements of the common dtype
    dtype = None
    for name in sorted(by_name):
        es = by_name[name]
        if len(es) != 1:
            return {"ok": False, "message": f"{name} lands in {len(es)} windows (tensor parallel?)"}
        e = es[0]
        size, stride, off = e.src_geom
        if off != 0 or list(size) != list(e.dst_geom[0]):
            return {"ok": False, "message": f"{name}: the engine takes a part of it (sharded)"}
        p = e.dst.data
        dtype = dtype or p.dtype
        if p.dtype != dtype or not p.is_contiguous():
            return {"ok": False, "message": f"{name}: parameter dtype/layout differs"}
        key = p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()
        if key not in starts:
            params.append(p)
            starts[key] = offset
            offset += (p.numel() + 31) // 32 * 32  # 64-byte aligned for bf16
        dsize, dstride, doff = e.dst_geom
        views[name] = [list(dsize), list(dstride), starts[key] + (doff - p.storage_offset())]
    return {"ok": True, "dtype": P.dtype_name(dtype), "numel": offset, "views": views, "params": len(params)}
