"""The guarantee an update runs under, decided at its first part, and the room its backup needs.

``mode="direct"`` is the guarantee ``none``; an explicit ``validate-then-write`` is taken as asked. Otherwise
``rollback`` when its backup fits and is reserved now (before anything is written): on the plan path the
destination windows (device memory on a GPU), on the layerwise path the whole model state (device memory when
it fits under ``backup="auto"``, else pinned host memory within the host cap). When it does not fit, ``auto``
falls back to ``validate-then-write`` on the plan path; an explicit ``rollback`` tries pinned host memory;
anything else is refused with the sizes. After a level-2 sleep the old weights are gone: no rollback.
"""

from __future__ import annotations

import math
from typing import Any

from vllm_rlpatch.hooks import wake
from vllm_rlpatch.refit import backup as B
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.tx_state import Part, Transaction
from vllm_rlpatch.refit.worker_state import WorkerState


def window_bytes(entries) -> int:
    return sum(e.dst.element_size() * math.prod(e.dst_geom[0]) for e in entries)


def decide(ws: WorkerState, tx: Transaction, req: P.RefitRequest, part: Part) -> dict[str, Any] | None:
    """Set ``tx.guarantee`` (and reserve the backup); a refusal (result dict) when neither level can be met."""
    want = req.guarantee or "auto"
    if tx.request.mode == "direct":
        tx.guarantee = "none"
        return None
    if want == "validate-then-write":
        tx.guarantee = want
        return None
    if wake.weights_discarded(ws.worker):
        # after sleep(level=2) the weight memory holds no valid weights: a backup would restore garbage
        if want == "rollback":
            return tx.fail("refused", "guarantee='rollback' needs valid old weights, and a level-2 sleep discarded "
                           "them: push with guarantee='validate-then-write' (or 'auto')", state="unchanged")
        tx.guarantee = "validate-then-write"
        tx.note = "the old weights were discarded by a level-2 sleep: no rollback possible, validated instead"
        return None
    need, slots, kind = _backup_size(ws, tx, req, part)
    ok, why = ws.backups.reserve(kind, need, slots, ws.device)
    if not ok and want == "auto" and tx.path == "plan":
        tx.guarantee = "validate-then-write"
        return None
    if not ok and want == "rollback" and kind == "device":  # asked for explicitly: the pinned host arena, overlapped
        kind = "pinned"
        ok, why = ws.backups.reserve(kind, need, slots, ws.device)
    if ok:
        tx.guarantee, tx.backup_kind = "rollback", kind
        return None
    return tx.fail("refused", f"no room for the rollback backup ({why}); the {tx.path} path can fail part-way, so "
                   "the update is refused before anything is written. Pass mode='direct' (written straight in, mixed "
                   "on failure) or guarantee='validate-then-write' (no backup, checked before and after), or raise "
                   "VLLM_RLPATCH_BACKUP_HOST_BYTES", state="unchanged", backup_needed=need, backup_kind=kind)


def _backup_size(ws: WorkerState, tx: Transaction, req: P.RefitRequest, part: Part) -> tuple[int, int, str]:
    """(bytes, slots, arena kind) of the rollback backup of this update."""
    dev = ws.device
    if tx.path == "plan":
        plan = ws.plans.plan
        if tx.subset:
            ents = plan.entries_for({m.name for m in part.metas})
            need, slots = window_bytes(ents), len(ents)
        else:
            need, slots = plan.window_bytes(), plan.copies
        kind = "device" if dev.type == "cuda" else "host"
    else:
        need, slots = B.state_bytes(ws.model), B.state_count(ws.model)
        kind = B.arena_kind(dev, req.backup)
        if dev.type == "cuda" and req.backup == "auto":
            ok_dev, _ = B.fits(need, "device", dev, ws.backups.arena("device", dev).capacity)
            kind = "device" if ok_dev else "pinned"
    if req.backup == "host" and dev.type == "cuda":
        kind = "pinned"
    return need, slots, kind


def room_for_part(ws: WorkerState, tx: Transaction, part: Part) -> dict[str, Any] | None:
    """A later part of a ``rollback`` session on the plan path: room for its backup (the arena grows by a
    chunk), or a refusal."""
    if tx.guarantee != "rollback" or tx.path != "plan":
        return None
    need = window_bytes(ws.plans.plan.entries_for(part.plan_names))
    held = tx.windows.bytes if tx.windows is not None else 0
    ok, why = ws.backups.grow_for_part(tx.backup_kind, need, held, ws.device)
    if ok:
        return None
    return tx.fail("refused", f"no room to back up this part ({why}): abort the session (its earlier parts are "
                   "restored)")
