"""The coordinator of one update: the worker RPCs in order, in the process that owns the engine's front end.

Written once, as generators that yield ``(method, args, kwargs)`` worker RPCs and receive their per-worker
results (:func:`coordinate` for a whole update, :func:`coordinate_part` / :func:`coordinate_finish` /
:func:`coordinate_abort` for the parts of a session), driven synchronously (``LLM.collective_rpc``) by
:func:`run_sync` or asynchronously (``AsyncLLM.collective_rpc``) by :func:`run_async`.

Every rank prepares before any rank writes (``validate-then-write`` needs it; a refusal anywhere leaves every
rank unchanged). If a rank fails while writing, the others are aborted: ranks with a backup restore it, ranks
without one are ``mixed``; the outcome is the worst of them. The front end then refuses requests while the
engine is mixed (:mod:`vllm_rlpatch.hooks.mixed`, from the results' data).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator

from vllm_rlpatch.hooks import mixed, weights
from vllm_rlpatch.refit import protocol as P

Rpc = tuple[str, tuple, dict]
PREPARE, COMMIT, ABORT, RELEASE = ("rlpatch_refit_prepare", "rlpatch_refit_commit", "rlpatch_refit_abort",
                                   "rlpatch_refit_release")
ALIGN = "rlpatch_refit_align_version"
# The phases of a fleet update (:mod:`.fleet`), each one call to where the engine lives (this process, a Ray
# actor, ``vllm serve``): :func:`coordinate_phase`.
PHASES = ("prepare", "commit", "release", "abort", "weight_state", "align_version")
_STATE_ORDER = ("unchanged", "restored", "mixed")


def _worst(states) -> str:
    worst = "unchanged"
    for s in states:
        if s in _STATE_ORDER and _STATE_ORDER.index(s) > _STATE_ORDER.index(worst):
            worst = s
    return worst


def _failure(results: list, bad: list, **extra) -> dict[str, Any]:
    r0 = bad[0]
    return {"ok": False, "kind": r0.get("kind", "commit"), "message": r0.get("message"),
            "problems": r0.get("problems", []), **extra}


def rpc_split(t0: float, t1: float, results: list) -> dict[str, float]:
    """Where a commit RPC's round trip (``t0``..``t1`` on this process's monotonic clock) went, from the clocks
    the engine core and each worker put in their answers: ``to_core`` (the request reaching the engine core),
    ``core_before`` / ``core_after`` (its hooks around the workers' call), ``to_worker`` (until the first rank
    began), ``worker`` (the first rank's start to the last rank's end), ``from_worker``, ``from_core`` (the
    answer reaching this process); they add up to the round trip. Empty when the clocks are not comparable
    (another host: any span negative, or the parts longer than the round trip)."""
    ec = next((r.get("engine_core", {}).get("clock") for r in results
               if isinstance(r, dict) and isinstance(r.get("engine_core"), dict)), None)
    wk = [r["clock"] for r in results if isinstance(r, dict) and isinstance(r.get("clock"), dict)]
    if not isinstance(ec, dict) or not wk or len(wk) != len(results):
        return {}
    try:
        w_enter, w_exit = min(float(c["enter"]) for c in wk), max(float(c["exit"]) for c in wk)
        split = {"to_core": ec["enter"] - t0, "core_before": ec["call"] - ec["enter"], "to_worker": w_enter - ec["call"],
                 "worker": w_exit - w_enter, "from_worker": ec["return"] - w_exit, "core_after": ec["exit"] - ec["return"],
                 "from_core": t1 - ec["exit"]}
    except (KeyError, TypeError, ValueError):
        return {}
    tol = 1e-4  # one clock: only rounding
    if min(split.values()) < -tol or split["to_core"] + split["from_core"] > (t1 - t0) + tol:
        return {}
    return {k: max(v, 0.0) for k, v in split.items()}


def commit_result(res: list, t0: float, t1: float) -> dict[str, Any]:
    """The part of an update's result a commit RPC gives (sent at ``t0``, answered at ``t1``): the ranks'
    answers, its seconds, where they went (:func:`rpc_split`) and its clock."""
    return {"workers": res, "seconds_commit": t1 - t0, "commit_split": rpc_split(t0, t1, res), "commit_clock": (t0, t1)}


def timeline(marks: list[tuple[str, float]], out: dict[str, Any]) -> list[list]:
    """One update's points in time, in ms after its first mark: the caller's ``marks`` and, where the commit
    RPC's clocks are comparable (:func:`rpc_split`), the engine core's and rank 0's (``core.*``, ``worker.*``)."""
    if not marks:
        return []
    pts = list(marks)
    res = out.get("workers") or []
    if out.get("commit_split") and out.get("commit_clock") and res:
        send, back = out["commit_clock"]
        pts += [("commit_rpc", send), ("commit_answer", back)]
        r0 = res[0]
        ec = (r0.get("engine_core") or {}).get("clock") or {}
        pts += [(f"core.{k}", v) for k, v in ec.items()]
        pts += [(f"worker.{k}", v) for k, v in (r0.get("clock") or {}).items()]
        pts += [(f"worker.{k}", v) for k, v in (r0.get("marks") or [])]
    t0 = marks[0][1]
    try:
        return [[k, round((float(v) - t0) * 1e3, 3)] for k, v in sorted(pts, key=lambda p: float(p[1]))]
    except (TypeError, ValueError):
        return [[k, round((v - t0) * 1e3, 3)] for k, v in marks]


def coordinate(req: dict[str, Any]) -> Generator[Rpc, list, dict[str, Any]]:
    """A whole update (one part, final)."""
    t0 = time.perf_counter()
    rpc_kw = {"inflight": req.get("inflight")}
    if req.get("workers") == 1:
        # one worker, nothing to agree on across ranks: prepare and commit in a single round trip
        res = yield (COMMIT, (req["txid"],), {"version": req.get("version"), "release": True, "request": req, **rpc_kw})
        t1 = time.perf_counter()
        out = commit_result(res, t0, t1)
        bad = [r for r in res if not r.get("ok")]
        if not bad:
            out.update(ok=True, state="committed", version=max((r.get("version") or 0) for r in res))
            return out
        out.update(_failure(res, bad), state=_worst(r.get("state") for r in bad))
        return out
    prep = yield from coordinate_prepare(req)
    if not prep["ok"]:
        yield (ABORT, (req["txid"],), {})
        return prep
    out = yield from coordinate_commit(req, len(prep["workers_prepare"]))
    return {"workers_prepare": prep["workers_prepare"], "seconds_prepare": prep["seconds_prepare"], **out}


def coordinate_prepare(req: dict[str, Any]) -> Generator[Rpc, list, dict[str, Any]]:
    """Phase one (of :func:`coordinate`, and of a fleet update, :mod:`.fleet`): every rank prepares; nothing is
    written. A failure is returned, not aborted: the caller aborts (one engine, or every engine of a fleet)."""
    t0 = time.perf_counter()
    prep = yield (PREPARE, (req,), {"inflight": req.get("inflight")})
    t_prep = time.perf_counter() - t0
    bad = [r for r in prep if not r.get("ok")]
    if bad:
        return {**_failure(prep, bad), "state": "unchanged", "workers": prep, "seconds_prepare": t_prep}
    return {"ok": True, "state": "prepared", "workers_prepare": prep, "seconds_prepare": t_prep}


def coordinate_commit(req: dict[str, Any], n: int, keep: bool = False) -> Generator[Rpc, list, dict[str, Any]]:
    """Phase two: every rank writes what it prepared. A rank that fails makes the engine's other ranks abort
    (restored from their backup, or mixed). ``keep``: the ranks keep the committed update (and its backup)
    until :func:`coordinate_release` or :func:`coordinate_abort` (which then rolls it back): a fleet commits
    every engine before any engine lets go of its backup."""
    t1 = time.perf_counter()
    rpc_kw = {"inflight": req.get("inflight")}
    res = yield (COMMIT, (req["txid"],), {"version": req.get("version"), "release": n == 1 and not keep, **rpc_kw})
    t2 = time.perf_counter()
    out = commit_result(res, t1, t2)
    failed = [r for r in res if not r.get("ok")]
    if not failed:
        if n > 1 and not keep:
            yield (RELEASE, (req["txid"],), {})
        out.update(ok=True, state="committed", version=max((r.get("version") or 0) for r in res))
        return out
    states = [r.get("state") for r in failed]
    if n > 1:
        rb = yield (ABORT, (req["txid"],), {})
        out["workers_abort"] = rb
        states += [r.get("state") for r in rb]
    out.update(_failure(res, failed), state=_worst(states))
    return out


def coordinate_release(txid: str) -> Generator[Rpc, list, dict[str, Any]]:
    """The end of a kept commit (:func:`coordinate_commit` ``keep=True``): the ranks drop its backup."""
    res = yield (RELEASE, (txid,), {})
    return {"ok": True, "workers_release": res}


def coordinate_part(req: dict[str, Any]) -> Generator[Rpc, list, dict[str, Any]]:
    """One part of a session: every rank prepares it, then every rank writes it (no version bump)."""
    rpc_kw = {"inflight": req.get("inflight")}
    prep = yield (PREPARE, (req,), dict(rpc_kw))
    bad = [r for r in prep if not r.get("ok")]
    if bad:
        return {**_failure(prep, bad), "state": _worst(r.get("state") for r in bad), "workers": prep}
    res = yield (COMMIT, (req["txid"],), {"release": False, "final": False, **rpc_kw})
    bad = [r for r in res if not r.get("ok")]
    if bad:
        return {**_failure(res, bad), "state": _worst(r.get("state") for r in bad), "workers": res,
                "workers_prepare": prep}
    return {"ok": True, "state": "writing", "workers": res, "workers_prepare": prep}


def coordinate_finish(txid: str, version: int | None, inflight: str | None) -> Generator[Rpc, list, dict[str, Any]]:
    """The end of a session: every rank finishes (post-write checks, the layerwise reload's close) and bumps
    the version once; a rank that fails makes the others abort."""
    res = yield (COMMIT, (txid,), {"version": version, "release": False, "final": True, "inflight": inflight})
    failed = [r for r in res if not r.get("ok")]
    if not failed:
        yield (RELEASE, (txid,), {})
        return {"ok": True, "state": "committed", "workers": res, "version": max((r.get("version") or 0) for r in res)}
    rb = yield (ABORT, (txid,), {})
    return {**_failure(res, failed), "state": _worst([r.get("state") for r in failed] + [r.get("state") for r in rb]),
            "workers": res, "workers_abort": rb}


def coordinate_abort(txid: str) -> Generator[Rpc, list, dict[str, Any]]:
    rb = yield (ABORT, (txid,), {})
    state = _worst(r.get("state") for r in rb)
    return {"ok": state != "mixed", "state": state, "workers": rb,
            "message": next((r.get("message") for r in rb if r.get("message")), "")}


def coordinate_phase(front: Any, phase: str, args: dict[str, Any]) -> Generator[Rpc, list, dict[str, Any]]:
    """One phase of a fleet update (:mod:`.fleet`), run where the engine's front end is (the caller's process
    for a ``vllm.LLM`` / ``AsyncLLM``, the actor for a Ray handle, the API server for a URL), from plain data
    (``args``, JSON-able), with what the front end holds afterwards (:func:`finish`):

    * ``prepare`` ``{"req"}``: :func:`coordinate_prepare`;
    * ``commit`` ``{"req", "n", "keep"}``: :func:`coordinate_commit`; a failure that left the engine ``mixed``
      makes its front end refuse requests;
    * ``release`` ``{"txid", "version"}``: the fleet committed: the front end takes the update (a mixed state is
      cleared, the update event fires), then :func:`coordinate_release` drops the backups;
    * ``abort`` ``{"txid"}``: :func:`coordinate_abort`; ``mixed`` afterwards: the front end refuses requests;
    * ``weight_state`` ``{}``: every worker's ``rlpatch_weight_state`` (version, mixed) under ``workers``;
    * ``align_version`` ``{"version"}``: every worker's version raised to it (``workers``: the versions).
    """
    if phase == "prepare":
        return (yield from coordinate_prepare(args["req"]))
    if phase == "commit":
        out = yield from coordinate_commit(args["req"], int(args["n"]), keep=bool(args.get("keep", True)))
        if not out.get("ok") and out.get("state") == "mixed" and front is not None:
            finish(front, out)
        return out
    if phase == "release":
        if front is not None:  # before the RPC: the update is in whether or not dropping its backup works
            finish(front, {"ok": True, "state": "committed", "version": args.get("version")})
        return (yield from coordinate_release(args["txid"]))
    if phase == "abort":
        out = yield from coordinate_abort(args["txid"])
        if out["state"] == "mixed" and front is not None:
            finish(front, {**out, "ok": False, "workers_abort": out.get("workers") or []})
        return out
    if phase == "weight_state":
        return {"ok": True, "workers": (yield (mixed.STATE_RPC, (), {}))}
    if phase == "align_version":
        return {"ok": True, "workers": (yield (ALIGN, (int(args["version"]),), {}))}
    raise P.RefitError(f"unknown refit phase {phase!r} (one of {', '.join(PHASES)})", kind="validation")


def run_sync(gen: Generator, rpc: Callable[[str, tuple, dict], list]) -> Any:
    try:
        call = next(gen)
        while True:
            method, args, kwargs = call
            call = gen.send(rpc(method, args, kwargs))
    except StopIteration as stop:
        return stop.value


async def run_async(gen: Generator, rpc) -> Any:
    try:
        call = next(gen)
        while True:
            method, args, kwargs = call
            call = gen.send(await rpc(method, args, kwargs))
    except StopIteration as stop:
        return stop.value


def finish(front: Any, out: dict[str, Any]) -> dict[str, Any]:
    """What the front end holds after an update: a committed one clears a mixed state (and counts as an
    update on this side); a mixed outcome makes the front end refuse requests."""
    if out.get("ok") and out.get("state") == "committed":
        mixed.clear(front)
        weights.fire(front, "rlpatch_refit", "frontend", version=out.get("version"))
    elif out.get("state") == "mixed":
        m = mixed.from_results(out.get("workers_abort") or []) or mixed.from_results(out.get("workers") or []) or \
            mixed.MixedWeights(out.get("message") or "a weight update failed part-way", (), "refit")
        mixed.poison(front, m)
    return out


def rpc_error_to_refit(e: BaseException, what: str, *, name_refusals: bool = False) -> P.RefitError:
    """An exception from vLLM's RPC machinery as a :class:`RefitError` with a kind. vLLM hands a worker's or the
    engine core's exception across processes as text (``collective_rpc``, utility calls), so this is the one
    place that reads an error's message: the engine's refusal (asleep, a refused update) and the workers'
    missing ``rlpatch_*`` methods have no type of their own there. A refusal's message is the engine's own
    line (``name_refusals``: prefixed with ``what`` like every other)."""
    msg = str(e)
    if "asleep" in msg or "refused" in msg:
        line = msg.split("\n")[0]
        return P.RefitError(f"{what}: {line}" if name_refusals else line, kind="refused")
    if "has no attribute 'rlpatch_" in msg or "rlpatch_refit" in msg and "AttributeError" in msg:
        return P.RefitError(f"{what}: the engine's workers have no rlpatch_* methods: vllm-rlpatch is not active in "
                            "the engine's processes (not installed there, VLLM_PLUGINS excludes 'rlpatch', or "
                            "VLLM_RLPATCH_ENABLED=0 / VLLM_RLPATCH_WORKER_EXTENSION=0)", kind="refused")
    return P.RefitError(f"{what}: {type(e).__name__}: {msg}", kind="commit")


def _unchanged_on_error(e: BaseException) -> dict[str, Any]:
    err = rpc_error_to_refit(e, "refit")
    return {"ok": False, "state": "unchanged", "kind": err.kind, "message": str(err), "problems": []}


def coordinate_on(front: Any, req: dict[str, Any], drive: Callable[[Generator], dict],
                  gen: Generator | None = None) -> dict[str, Any]:
    try:
        out = drive(gen if gen is not None else coordinate(req))
    except Exception as e:  # noqa: BLE001 - an RPC raised (engine-core refusal, dead worker, ...)
        return _unchanged_on_error(e)
    return finish(front, out)


async def coordinate_on_async(front: Any, req: dict[str, Any], drive, gen: Generator | None = None) -> dict[str, Any]:
    try:
        out = await drive(gen if gen is not None else coordinate(req))
    except Exception as e:  # noqa: BLE001
        return _unchanged_on_error(e)
    return finish(front, out)
