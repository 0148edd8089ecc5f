"""What one worker keeps between its refit RPCs: the schema, the open transactions and the fenced ones, the
copy plan, the backup arenas, the update templates and an armed test fault.

:class:`WorkerState` is the base of :class:`~vllm_rlpatch.refit.transaction.WorkerRefit` (which adds the RPC
methods); the steps of :mod:`.prepare` and :mod:`.commit` take it.
"""

from __future__ import annotations

import collections
import logging
import weakref
from typing import Any

import torch

from vllm_rlpatch.hooks import workerctx
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.backup import BackupPool
from vllm_rlpatch.refit.templates import Templates
from vllm_rlpatch.refit.tx_state import Transaction
from vllm_rlpatch.refit.worker_plan import PlanKeeper

logger = logging.getLogger("vllm.rlpatch")


class WorkerState:
    def __init__(self, worker: Any):
        self.worker_ref = weakref.ref(worker)
        self.cached_schema: P.Schema | None = None
        self.txs: dict[str, Transaction] = {}
        self.plans = PlanKeeper()
        self.backups = BackupPool()
        self.templates = Templates()
        self.armed_fault: str | None = None
        self.aborted: collections.deque[str] = collections.deque(maxlen=256)  # fenced txids: never prepared again

    @property
    def worker(self):
        return self.worker_ref()

    @property
    def model(self):
        return workerctx.model_of(self.worker)

    @property
    def device(self) -> torch.device:
        return workerctx.device_of(self.worker)

    @property
    def rank(self) -> int:
        return int(getattr(self.worker, "rank", 0) or 0)

    def schema(self) -> P.Schema:
        if self.cached_schema is None:
            self.cached_schema = _load_schema(self.worker.model_config)
            s = self.cached_schema
            logger.info("vllm-rlpatch: refit schema of %s: %d tensors (+%d tied aliases), %.1f MB, from %s",
                        type(self.model).__name__, len(s.tensors), len(s.aliases), s.nbytes / 1e6, s.source)
        return self.cached_schema

    def drop(self, txid: str) -> None:
        """Forget a transaction: close its sources (an update template's stays open), drop its backup, give
        the arenas back."""
        tx = self.txs.pop(txid, None)
        if tx is None:
            return
        for part in tx.parts + ([tx.pending] if tx.pending is not None else []):
            part.tensors = None
            if part.source.pinned:
                continue  # an update template's source stays open for the next update
            try:
                part.source.close()
            except Exception as e:  # noqa: BLE001 - the update is over either way
                logger.debug("vllm-rlpatch: closing a refit source failed: %s: %s", type(e).__name__, e)
        if tx.windows is not None:
            tx.windows.drop()
        tx.windows = tx.state_backup = None
        self.backups.end_update(self.device)


def _load_schema(mc: Any) -> P.Schema:
    """The checkpoint's own names are what vLLM's loader consumes; a model built from its config in
    transformers (meta device) stands in where there is no checkpoint (load_format=dummy)."""
    dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else getattr(torch, str(mc.dtype))
    try:
        return P.schema_from_checkpoint(str(mc.model), mc.hf_config, dtype)
    except Exception as e:  # noqa: BLE001 - fall back, report both if both fail
        first = f"checkpoint: {type(e).__name__}: {e}"
    try:
        return P.schema_from_hf_config(mc.hf_config, dtype, getattr(mc, "trust_remote_code", False))
    except Exception as e2:  # noqa: BLE001
        raise P.RefitError(f"cannot determine the tensors this model expects ({first}; transformers: "
                           f"{type(e2).__name__}: {e2})", kind="validation") from e2
