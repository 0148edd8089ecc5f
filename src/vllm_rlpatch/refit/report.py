"""What a weight update did: :class:`RefitReport` and :func:`build_report`, which reads it from the coordinator's
answer (one engine's workers, every phase they ran)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class RefitReport:
    """What one ``push_weights`` (or one part / the commit of a session) did. ``seconds`` is wall time in the
    caller; ``gbps`` = bytes / seconds. ``guarantee``: ``rollback``, ``validate-then-write`` or ``none``
    (``mode="direct"``); ``path``: ``plan`` (copies into the parameters) or ``layerwise`` (vLLM's reload);
    ``backup``: ``{"kind", "bytes", "seconds"}`` of the rollback backup (None without one)."""

    ok: bool
    state: str  # committed | writing (a session part) | unchanged | restored | mixed
    version: int | None
    transport: str
    mode: str
    bytes: int
    tensors: int
    seconds: float
    gbps: float
    stages: dict[str, float]
    checks: list[str]
    peak_extra_device_bytes: int
    peak_extra_host_bytes: int
    aborted_requests: list[str]
    recomputed_requests: int
    workers: list[dict[str, Any]]
    message: str = ""
    buckets: int = 0  # shared-memory segments / broadcast buckets (a tensor larger than a bucket has its own)
    guarantee: str | None = None
    path: str | None = None
    backup: dict[str, Any] | None = None
    post_check: str | None = None
    # [point, ms after the call began]: the caller's steps and, for an engine in this process whose clocks
    # compare, the engine core's and rank 0's (``core.*``, ``worker.*``): where the time went
    timeline: list[list] = dataclasses.field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)



def build_report(out: dict[str, Any], *, transport: str, mode: str, nbytes: int, n: int, seconds: float,
                 stages: dict[str, float], host_extra: int) -> RefitReport:
    workers = out.get("workers") or []
    everyone = (out.get("workers_prepare") or []) + workers
    checks_: list[str] = []
    for w in everyone:
        for c in w.get("checks", []):
            if c not in checks_:
                checks_.append(c)
    w_stages: dict[str, float] = {}
    for w in everyone:
        for k, v in (w.get("stages") or {}).items():
            w_stages[k] = max(w_stages.get(k, 0.0), float(v))
    st = dict(stages)
    st.update({f"worker_{k}": v for k, v in w_stages.items()})
    for k in ("seconds_prepare", "seconds_commit"):
        if k in out:
            st[k.removeprefix("seconds_") + "_rpc"] = out[k]
    st.update({f"commit_rpc_{k}": v for k, v in (out.get("commit_split") or {}).items()})
    ec = {}
    for w in workers:
        if isinstance(w.get("engine_core"), dict):
            ec = w["engine_core"]
    first = next((w for w in reversed(everyone) if w.get("guarantee")), {})
    return RefitReport(
        ok=bool(out.get("ok")), state=out.get("state", "unchanged"), version=out.get("version"), transport=transport,
        mode=mode, bytes=nbytes, tensors=n, seconds=seconds, gbps=(nbytes / seconds / 1e9) if seconds > 0 else 0.0,
        stages=st, checks=checks_,
        peak_extra_device_bytes=max([int(w.get("extra_device_bytes") or 0) for w in workers] or [0]),
        peak_extra_host_bytes=host_extra + sum(int(w.get("extra_host_bytes") or 0) for w in workers),
        aborted_requests=list(ec.get("aborted", [])), recomputed_requests=int(ec.get("recomputed", 0)),
        workers=workers or list(out.get("workers_prepare") or []), message=out.get("message") or "",
        guarantee=first.get("guarantee"), path=first.get("path"), backup=first.get("backup"),
        post_check=next((w.get("post_check") for w in everyone if w.get("post_check")), None))

