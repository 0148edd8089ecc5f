"""Putting back what an update wrote, and aborting an update.

:func:`undo` restores a ``rollback`` backup (the windows on the plan path, the whole model state on the
layerwise path) and compares the restored weights with it; without a backup what was written stays
(``mixed``). :func:`abort` drops a prepared update, or undoes a written one (another rank failed, a session
ended with an exception); an update this worker does not hold is answered ``absent`` (idempotent).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_rlpatch.hooks import layerwise, mixed, weights
from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit.tx_state import Transaction, now
from vllm_rlpatch.refit.worker_state import WorkerState

logger = logging.getLogger("vllm.rlpatch")


def undo(ws: WorkerState, tx: Transaction) -> tuple[str, str]:
    """Put back what was written: (state, note)."""
    if not tx.written:
        return "unchanged", ""
    if tx.windows is not None:
        return _restore_windows(tx)
    if tx.state_backup is not None:
        return _restore_state(ws, tx)
    return "mixed", ""


def _restore_windows(tx: Transaction) -> tuple[str, str]:
    t1 = now()
    tx.windows.restore()
    tx.stage("restore", now() - t1)
    bad = [w for w, s in tx.windows.saved if not _equal(w, s)]
    return _compared(tx, tx.windows.bytes, f"{len(bad)} window(s) differ from their backup after the restore"
                     if bad else None)


def _restore_state(ws: WorkerState, tx: Transaction) -> tuple[str, str]:
    t1 = now()
    try:
        tx.state_backup.restore()
    except Exception as e:  # noqa: BLE001
        logger.exception("vllm-rlpatch: restoring the old weights failed")
        return "mixed", f"restoring the old weights failed: {type(e).__name__}: {e}"
    tx.stage("restore", now() - t1)
    model = ws.model
    bad = [n for n, saved in tx.state_backup.saved_named() if not _same_storage_bytes(model, n, saved)]
    return _compared(tx, tx.state_backup.bytes, f"{len(bad)} tensor(s) differ from their backup after the "
                     f"restore: {', '.join(bad[:4])}" if bad else None)


def _compared(tx: Transaction, nbytes: int, mismatch: str | None) -> tuple[str, str]:
    """The state after a restore whose result was compared with the backup: ``mismatch`` says what differed."""
    tx.check("restore_compared")
    if mismatch is not None:
        return "mixed", mismatch
    mixed.clear_worker()
    return "restored", f"old weights restored from a {tx.backup_kind} backup ({nbytes} bytes), compared with it"


def close_open_reload(ws: WorkerState, tx: Transaction) -> None:
    """A session's layerwise reload still open: every layer put back as it was."""
    if tx.reload_open:
        tx.reload_open = False
        layerwise.abort_open_reload(ws.worker)


def abort(ws: WorkerState, txid: str) -> dict[str, Any]:
    """Drop a prepared update, or undo a written one (another rank failed; a session ended by an error)."""
    if txid not in ws.aborted:
        ws.aborted.append(txid)  # fenced: a late prepare or commit of this update is refused
    tx = ws.txs.get(txid)
    if tx is None:
        return {"ok": True, "state": "unchanged", "absent": True, "note": "nothing to abort"}
    close_open_reload(ws, tx)
    if not tx.written:
        ws.drop(txid)
        return {"ok": True, "state": "unchanged"}
    state, note = undo(ws, tx)
    if state == "mixed":
        m = mixed.MixedWeights(f"the update was aborted after it wrote ({tx.guarantee}, no backup)"
                               f"{': ' + note if note else ''}", (), "refit")
        mixed.set_worker(m)
        note = m.message
    elif tx.committed:
        weights.fire(ws.worker, "rlpatch_refit_rollback", "worker")
    ws.drop(txid)
    held = mixed.worker_state() if state == "mixed" else None
    return {"ok": state == "restored", "state": state, "message": note, "guarantee": tx.guarantee,
            **({"mixed": held.as_dict()} if held else {})}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal; across devices by digest (the restore check must not allocate a model-sized copy)."""
    if a.device == b.device:
        return bool(torch.equal(a, b))
    da, db = checks.digests([a, b])
    return da.key == db.key


def _same_storage_bytes(model, name: str, saved: torch.Tensor) -> bool:
    t = _named_tensor(model, name)
    if t is None or t.is_meta:
        return False
    d = t.data
    if d.numel() != saved.numel() or d.dtype != saved.dtype:
        return False
    return _equal(d, saved.view(d.shape) if saved.shape != d.shape else saved)


def _named_tensor(model, name: str):
    mod_name, _, leaf = name.rpartition(".")
    try:
        mod = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        return None
    t = mod._parameters.get(leaf)
    if t is None:
        t = mod._buffers.get(leaf)
    return t
