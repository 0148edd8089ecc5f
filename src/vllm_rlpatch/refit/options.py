"""The options of one weight update (:class:`Options`), checked before anything is sent."""

from __future__ import annotations

import dataclasses

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.transports import AUTO, CHOICES

MODES = ("atomic", "direct")
INFLIGHT = ("refuse", "abort", "keep", "recompute")
TRANSPORTS = CHOICES


@dataclasses.dataclass
class Options:
    transport: str = AUTO
    mode: str = "atomic"
    guarantee: str = "auto"
    inflight: str | None = None
    version: int | None = None
    partial: bool = False
    allow_cast: bool = False
    bucket_bytes: int | None = None
    verify: bool = True
    dist_host: str | None = None
    dist_port: int = 0
    dist_backend: str | None = None
    timeout_s: float = 300.0
    backup: str = "auto"  # where a rollback backup goes: auto | device | host

    def validate(self) -> None:
        if self.mode not in MODES:
            raise P.RefitError(f"mode={self.mode!r}: use 'atomic' (default: validated, with the guarantee below) or "
                               "'direct' (written straight in, checked after)", kind="validation")
        if self.guarantee not in P.GUARANTEES:
            raise P.RefitError(f"guarantee={self.guarantee!r}: use one of {', '.join(P.GUARANTEES)}",
                               kind="validation")
        if self.mode == "direct" and self.guarantee != "auto":
            raise P.RefitError(f"mode='direct' has no guarantee (guarantee={self.guarantee!r} given): drop one",
                               kind="validation")
        if self.inflight is not None and self.inflight not in INFLIGHT:
            raise P.RefitError(f"inflight={self.inflight!r}: use one of {', '.join(INFLIGHT)} (or None for the "
                               "engine's VLLM_RLPATCH_INFLIGHT)", kind="validation")
        v = self.version
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise P.RefitError(f"version={v!r}: a positive int greater than the engine's current version",
                               kind="validation")
        if self.transport not in TRANSPORTS:
            raise P.RefitError(f"transport={self.transport!r}: use one of {', '.join(TRANSPORTS)}", kind="validation")
        if self.backup not in ("auto", "device", "host"):
            raise P.RefitError(f"backup={self.backup!r}: use auto, device or host", kind="validation")

