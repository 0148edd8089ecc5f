"""The layerwise path's write: vLLM's own layerwise reload, which re-runs each layer's post-processing (CPU
repacking, quantization), held strict (every layer complete and processed exactly once).

Under ``rollback`` the whole model state is backed up first (:class:`~vllm_rlpatch.refit.backup.StateBackup`:
post-processing re-creates tensors). A single-part update is one ``reload_weights``; a session's parts share one
reload, opened at its first part and finished at the commit (vLLM buffers a layer until all its parts arrived).
"""

from __future__ import annotations

from typing import Iterator

import torch

from vllm_rlpatch.hooks import layerwise, weights, workerctx
from vllm_rlpatch.refit.backup import StateBackup
from vllm_rlpatch.refit.tx_state import Part, Transaction, now
from vllm_rlpatch.refit.worker_state import WorkerState


def _iter_part(ws: WorkerState, tx: Transaction, part: Part, policy) -> Iterator[tuple[str, torch.Tensor]]:
    aliases = ws.schema().aliases
    it = part.tensors.items() if part.tensors is not None else ((m.name, t) for m, t in part.source.tensors())
    for name, t in it:
        if name in aliases:
            continue
        if tx.fault_armed("after_first_write") and policy.findings.processed > 0:
            tx.written = True
            tx.raise_fault("after_first_write", ws.rank)
        yield name, t
        if policy.findings.processed > 0:
            tx.written = True


def _backup_state(ws: WorkerState, tx: Transaction) -> None:
    if tx.guarantee != "rollback" or tx.state_backup is not None:
        return
    arena = ws.backups.arena(tx.backup_kind, ws.device)
    arena.begin()
    tx.state_backup = StateBackup(ws.model, arena)
    tx.stage("backup", tx.state_backup.seconds)
    if tx.backup_kind in ("host", "pinned"):
        tx.extra_host = max(tx.extra_host, tx.state_backup.bytes)
    tx.check(f"backup_{'device' if tx.backup_kind == 'device' else 'host'}")


def write_layerwise(ws: WorkerState, tx: Transaction, part: Part):
    """Write one part through vLLM's reload; the layerwise findings."""
    _backup_state(ws, tx)
    if tx.request.session:
        return _write_session_part(ws, tx, part)
    worker, model = ws.worker, ws.model
    t1 = now()
    with layerwise.strict(require_full=not tx.request.partial) as pol, weights.suppressed(), \
            workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
        try:
            worker.reload_weights(weights_iterator=_iter_part(ws, tx, part, pol))
        finally:
            if layerwise.reload_active(model):  # the load raised half-way: put every layer back
                layerwise.abort_open_reload(worker)
    tx.written = tx.written or pol.findings.processed > 0
    tx.stage("write", now() - t1)
    tx.check("strict_reload")
    return pol.findings


def _write_session_part(ws: WorkerState, tx: Transaction, part: Part):
    """A session: one reload spans the parts; vLLM buffers a layer until all its parts arrived."""
    worker, model = ws.worker, ws.model
    t1 = now()
    if not tx.reload_open:
        tx.policy = layerwise.Policy(require_full=False)
        with workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
            layerwise.vllm_layerwise().initialize_layerwise_reload(model)
        tx.reload_open = True
    with layerwise.using(tx.policy), weights.suppressed(), workerctx.vllm_config_ctx(worker), \
            workerctx.lora_unwrapped(model):
        try:
            model.load_weights(_iter_part(ws, tx, part, tx.policy))
        except BaseException:
            tx.reload_open = False
            layerwise.abort_open_reload(worker)
            raise
    tx.written = tx.written or tx.policy.findings.processed > 0
    tx.stage("write", now() - t1)
    tx.check("strict_reload")
    return tx.policy.findings


def finish_layerwise(ws: WorkerState, tx: Transaction):
    """The end of a session's reload: every layer's post-processing; the findings."""
    worker, model = ws.worker, ws.model
    tx.reload_open = False
    t1 = now()
    with layerwise.using(tx.policy), weights.suppressed(), workerctx.vllm_config_ctx(worker), \
            workerctx.lora_unwrapped(model):
        layerwise.vllm_layerwise().finalize_layerwise_processing(model, worker.model_config)
    tx.stage("write", now() - t1)
    return tx.policy.findings
