"""One update's state in a worker: its parts, the path and guarantee it took, its backup, its timings.

An update is one part (``push_weights``) or several (a ``refit_session``), and ends in one commit.
:class:`Transaction` holds what spans the parts (the first part's request, the names written so far, a layerwise
reload left open between parts, the backup, the stages and checks of the report); :class:`Part` holds one
part's records, source and received tensors. Results are plain dicts (:func:`failure`,
:meth:`Transaction.result`); expected failures are reported, never raised.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from vllm_rlpatch.hooks import mixed
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.source import Source
from vllm_rlpatch.refit.templates import Template


def now() -> float:
    return time.perf_counter()


class InjectedFault(RuntimeError):
    """A fault a test asked for (``VLLM_RLPATCH_FAULT_INJECTION=1``)."""


FAULTS = ("prepare", "after_first_write")  # where a test may arm one (``@rankN``: on that rank only)


def error_kind(error: BaseException, default: str) -> str:
    """A failure's ``kind``, from its type: a ``RefitError``'s own kind; ``fault`` for a test's; ``transport``
    for an error raised while handling a transport's (a loader that wrapped it); else ``default``."""
    if isinstance(error, P.RefitError):
        return error.kind
    if isinstance(error, InjectedFault):
        return "fault"
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, P.TransportError):
            return "transport"
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return default


def failure(kind: str, state: str, message: str, stages: dict, checks_: list, problems: list | None = None,
            **extra) -> dict[str, Any]:
    """A failed step's result: ``kind`` (validation, refused, transport, commit, fault, template) and ``state``
    (what the engine holds now: unchanged, writing, restored, mixed)."""
    out = {"ok": False, "kind": kind, "state": state, "message": message, "problems": problems or [],
           "stages": stages, "checks": list(checks_), "pid": os.getpid(), **extra}
    if state == "mixed":
        out["mixed"] = mixed.MixedWeights(message, (), "refit").as_dict()
    return out


class Part:
    """One prepared part of an update."""

    def __init__(self, metas: list[P.TensorMeta], source: Source, names: frozenset[str], plan_names: frozenset[str],
                 template: Template | None):
        self.metas, self.source = metas, source
        self.names = names  # every tensor's name
        self.plan_names = plan_names  # ``names`` less the tied aliases (an update template keeps both)
        self.template = template  # the update template it uses or registers (its caches), or None
        self.tensors: dict[str, torch.Tensor] | None = None  # the received tensors (non-streamed sources)
        self.expected: dict[str, str] = {}  # name -> digest key of the bytes validated before the write


class Transaction:
    """One update: its parts, its path and guarantee, its backup. ``request``: the first part's request, whose
    mode, partial, allow_cast, verify, session and deadline hold for the whole update."""

    def __init__(self, request: P.RefitRequest, fault: str | None = None):
        self.request = request
        self.guarantee: str | None = None  # rollback | validate-then-write | none
        self.path: str | None = None  # plan | layerwise
        self.parts: list[Part] = []
        self.pending: Part | None = None
        self.windows = None  # WindowBackup (plan path, rollback)
        self.state_backup = None  # StateBackup (layerwise path, rollback)
        self.backup_kind: str | None = None
        self.written = False  # anything written into the model yet
        self.committed = False
        self.reload_open = False  # a layerwise reload spans this session's parts
        self.policy = None  # the layerwise policy of a session's reload
        self.names_done: set[str] = set()
        self.stages: dict[str, float] = {}
        self.checks: list[str] = []
        self.marks: list[tuple[str, float]] = []  # (point, this process's perf_counter): the report's timeline
        self.extra_host = 0
        self.extra_device = 0
        self.fault = fault  # armed by a test (VLLM_RLPATCH_FAULT_INJECTION=1)
        self.post_check: str | None = None
        self.note: str | None = None

    @property
    def txid(self) -> str:
        return self.request.txid

    @property
    def subset(self) -> bool:
        """A part of a session or a partial update: its names need not be the whole model."""
        return self.request.partial or self.request.session

    def mark(self, name: str) -> None:
        self.marks.append((name, now()))

    def stage(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def check(self, name: str) -> None:
        if name not in self.checks:
            self.checks.append(name)

    def state_now(self) -> str:
        """What the engine holds while this update is open and not failed: unchanged until it writes."""
        return "writing" if self.written else "unchanged"

    def raise_fault(self, where: str, rank: int) -> None:
        """Raise the armed test fault if it is armed for ``where`` (and this rank)."""
        if self.fault and self.fault.split("@")[0] == where:
            at = self.fault.split("@")[1] if "@" in self.fault else None
            if at is None or at == f"rank{rank}":
                raise InjectedFault(f"injected fault {self.fault!r} on rank {rank}")

    def fault_armed(self, where: str) -> bool:
        return bool(self.fault) and self.fault.startswith(where)

    def backup_report(self) -> dict[str, Any] | None:
        b = self.windows or self.state_backup
        if b is None:
            return None
        return {"kind": self.backup_kind, "bytes": int(b.bytes), "seconds": float(b.seconds)}

    def fail(self, kind: str, message: str, problems: list | None = None, state: str | None = None,
             **extra) -> dict[str, Any]:
        """This update's failure result; ``state`` defaults to what the engine holds now."""
        return failure(kind, state or self.state_now(), message, self.stages, self.checks, problems, **extra)

    def result(self, rank: int, plan_note: str, **kw) -> dict[str, Any]:
        return {"stages": self.stages, "checks": list(self.checks), "marks": list(self.marks), "pid": os.getpid(),
                "rank": rank, "guarantee": self.guarantee, "path": self.path, "backup": self.backup_report(),
                "post_check": self.post_check, "note": self.note, "plan": plan_note,
                "extra_host_bytes": self.extra_host, "extra_device_bytes": self.extra_device, **kw}
