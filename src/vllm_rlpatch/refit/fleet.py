"""One update, every engine: ``push_weights([llm_a, llm_b, ...], tensors)`` as a two-phase transaction over a
fleet of rollout engines, all-or-nothing.

The public ``push_weights`` / ``push_weights_async`` / ``weight_version`` (:mod:`.api`) come here with a list (or
tuple) of targets: :func:`push_fleet`, :func:`fleet_versions`.

A fleet update:

1. **Versions.** Every engine's weight version is read (after step 2's trainer-side work: an RPC leaves every
   engine's worker spinning for a second, vLLM's shm-broadcast ``busy_loop_s``, on the cores the trainer packs
   on); the new version is ``version`` or max(current) + 1, the same on every engine.
2. **The bytes, once.** The sender (:class:`~vllm_rlpatch.refit.outgoing.Outgoing`) checks the metadata against the
   schema (every engine must have the same one), then packs and digests the tensors **once**: for ``shm`` into
   one set of shared-memory segments that every engine's workers map; for ``cuda_ipc`` one set of handles that
   every engine opens; for ``dist`` one broadcast process group spanning the trainer (rank 0) and every
   engine's workers (gloo on CPU, NCCL on GPU; world = 1 + every engine's worker count): the trainer sends each
   bucket once for the whole fleet (NCCL's broadcast; with gloo and several receivers a relay, the receivers
   passing it on: :func:`~.dist.relay`). Each engine's request then differs only in its workers' rank offset
   (``rank_base``: 1 + the worker counts of the engines before it). A NaN is refused here, before any engine is
   asked anything.
3. **Prepare** (:func:`~.coordinator.coordinate_prepare`) on every engine at once, one thread per engine: each
   engine's workers validate and stage; nothing is written. With ``dist`` every worker receives the broadcast
   here, all engines at once (``stream`` False: never in commit, even for ``mode="direct"``); a worker that
   refuses still drains the broadcast (:meth:`~.dist.DistSource.drain`) so no other rank waits for it; the
   group's timeout (0.75 x ``timeout_s``) ends before the phase's, so the ranks that joined answer with a
   transport error while an engine that never joined is named as hung. The request carries the transaction id
   and a deadline (now + ``timeout_s``, wall clock): a worker refuses to commit after it, or after an abort of
   that id. Any refusal, failure, or an engine that has not answered by the deadline: every engine that
   answered is aborted (:func:`~.coordinator.coordinate_abort`) and keeps its old weights
   (``state="unchanged"``).
4. **Commit** (:func:`~.coordinator.coordinate_commit` with ``keep``) on every engine: each writes and keeps its
   backup. All committed: every engine releases its backup (``committed``). One failed (or did not answer in
   time): every engine that committed is aborted, which rolls it back from its backup (``restored``; the
   ``rollback`` guarantee) or, with no backup (``validate-then-write``, ``direct``), leaves it ``mixed``: that
   engine refuses requests until a good update lands. The fleet's state is the worst of its engines'.
   After a rollback the engines that had committed carry one more version (the rollback is a weight change
   for them); the others are raised to the same version (``rlpatch_refit_align_version``), so the fleet's
   versions agree again.
5. **The report** (:class:`FleetReport`): one entry per engine (its version, state, stages, errors, time), the
   slowest engine, the trainer-side stages. ``raise_on_error``: a :class:`~.protocol.RefitError` carrying it.

A hung or dead engine is an error naming it (``engine1: no answer to prepare within 30.0 s``) within
``timeout_s`` of the phase, never a hang: its thread is left behind, the engine is declared dead, the others are
aborted, and the shared-memory segments of that update are not reused (the next update packs into new ones).
The segments of an update are reused by the fleet's next update only after every engine answered (or was
declared dead) - which is when this call returns.

Where the engines are: each phase (``prepare``, ``commit`` keeping the backup, ``release``, ``abort``,
``weight_state``, ``align_version``) is one call to where the engine lives (:meth:`~.target.Target.phase`,
built from plain data by :func:`~.coordinator.coordinate_phase`): an engine of this process through its RPCs
here; a Ray actor handle as one ``__ray_call__`` into the actor (:mod:`.ray`); a URL as one call to the server's
``/rlpatch/v1/refit/<phase>`` route (:mod:`.http`). Any mix of them. The engine's front end takes the outcome
where it lives (a mixed engine refuses requests in its actor or server). With ``shm`` / ``cuda_ipc`` every
engine must be on this host (the bytes are placed once in its memory); a fleet with engines on other hosts is one
``dist`` group hosted at ``dist_host`` (an address of this host they reach). Engines are named ``engine<i>``, with the URL
or the Ray actor (``engine1 (Ray actor Host 3f2a...)``).

Not here (yet): several trainer ranks sending shards (one sender: the caller).
``dist`` across engines ran with gloo only; the NCCL branch with several receivers is unrun.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import warnings
from typing import Any, Callable

from vllm_rlpatch.refit import coordinator as C
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import transports
from vllm_rlpatch.refit.caches import CACHE, schema_for
from vllm_rlpatch.refit.options import Options
from vllm_rlpatch.refit.outgoing import Outgoing
from vllm_rlpatch.refit.report import build_report
from vllm_rlpatch.refit.resolve import resolve
from vllm_rlpatch.refit.target import EngineUnreachable, Target


@dataclasses.dataclass
class FleetReport:
    """What one fleet update did. ``state``: ``committed`` (every engine), ``unchanged`` (refused or failed
    before any write: every engine keeps its old weights), ``restored`` (a commit failed; every engine is back
    on its old weights from its backup), ``mixed`` (a commit failed without backups: the engines that wrote
    refuse requests until a good update). ``engines``: one entry per engine, in the order given (``name``,
    ``ok``, ``state``, ``version``, ``seconds``, ``stages``, ``errors``, ``guarantee``, ``path``, ``backup``,
    ``dead``). ``slowest``: the name of the engine that took longest (prepare + commit), ``slowest_seconds`` its
    time. ``stages``: the trainer's (validate_metadata, pack/fingerprint) and the phases' wall times."""

    ok: bool
    state: str
    version: int | None
    versions: list[int | None]
    transport: str
    mode: str
    bytes: int
    tensors: int
    seconds: float
    stages: dict[str, float]
    engines: list[dict[str, Any]]
    slowest: str | None
    slowest_seconds: float
    txid: str
    message: str = ""
    buckets: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------------------ one thread per engine
class _Call:
    """``fn()`` in a daemon thread; ``result`` / ``error`` once it returned, or ``dead`` after the deadline."""

    def __init__(self, fn: Callable[[], Any]):
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.t0 = time.perf_counter()
        self.seconds = 0.0
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True, name="rlpatch-fleet")
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - reported as this engine's error
            self.error = e
        finally:
            self.seconds = time.perf_counter() - self.t0
            self.done.set()


def _parallel(fns: dict[int, Callable[[], Any]], timeout_s: float) -> dict[int, _Call]:
    calls = {i: _Call(fn) for i, fn in fns.items()}
    end = time.monotonic() + timeout_s
    for c in calls.values():
        c.done.wait(max(0.0, end - time.monotonic()))
    return calls


class _Engine:
    def __init__(self, i: int, tgt: Target):
        self.i, self.tgt = i, tgt
        where = getattr(tgt, "url", None) or getattr(tgt, "label", None)
        self.name = f"engine{i}" + (f" ({where})" if where else "")
        self.errors: list[str] = []
        self.dead = False
        self.prep: dict[str, Any] | None = None
        self.commit: dict[str, Any] | None = None
        self.abort: dict[str, Any] | None = None
        self.state = "unchanged"
        self.seconds = 0.0
        self.version: int | None = None

    def drive(self, phase: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One phase (:func:`~.coordinator.coordinate_phase`) where this engine lives: an engine of this
        process through its RPCs here, a Ray actor or a ``vllm serve`` in one call there."""
        return self.tgt.phase(phase, args, timeout_s)


def _one_line(text: str) -> str:
    return (str(text).strip().splitlines() or [""])[0]


def _run_phase(engines: list[_Engine], what: str, args: Callable[[_Engine], dict[str, Any]], timeout_s: float
               ) -> dict[int, dict[str, Any]]:
    """Run phase ``what`` with ``args(engine)`` on every live engine at once. A call that raised or did not
    answer within ``timeout_s`` is that engine's failure (the latter, or a dead/unreachable engine, also marks
    it dead)."""
    live = [e for e in engines if not e.dead]
    calls = _parallel({e.i: (lambda e=e: e.drive(what, args(e), timeout_s)) for e in live}, timeout_s)
    out: dict[int, dict[str, Any]] = {}
    for e in live:
        c = calls[e.i]
        if not c.done.is_set():
            e.dead = True
            msg = f"{e.name}: no answer to {what} within {timeout_s:.1f} s (declared dead; its thread is left behind)"
            e.errors.append(msg)
            out[e.i] = {"ok": False, "kind": "timeout", "state": "unknown", "message": msg}
            continue
        e.seconds += c.seconds
        if c.error is not None:
            if isinstance(c.error, P.RefitError):  # a remote engine's call (Ray, HTTP) said what went wrong
                err = P.RefitError(f"{e.name} {what}: {_one_line(c.error)}", kind=c.error.kind)
            else:
                err = C.rpc_error_to_refit(c.error, f"{e.name} {what}", name_refusals=True)
            e.errors.append(_one_line(err))
            if _is_dead(c.error):
                e.dead = True
            out[e.i] = {"ok": False, "kind": err.kind, "state": "unknown" if what != "prepare" else "unchanged",
                        "message": _one_line(err)}
            continue
        r = c.result
        if not r.get("ok") and r.get("message"):
            e.errors.append(f"{e.name} {what}: {_one_line(r.get('message'))}")
        out[e.i] = r
    return out


def _is_dead(err: BaseException) -> bool:
    """An engine that cannot answer any more: a dead engine core, or a Ray actor or server its target could not
    reach."""
    return isinstance(err, EngineUnreachable) or type(err).__name__ in ("EngineDeadError", "EOFError")


def _engine_key(t: Target) -> Any:
    """What makes two targets one engine: its front end object, its Ray actor, its URL."""
    if t.front is not None:
        return ("front", id(t.front))
    if hasattr(t, "key"):
        return t.key()
    if getattr(t, "url", None):
        return ("url", t.url)
    return ("target", id(t))


def _check_targets(tgts: list[Target]) -> None:
    seen: dict[Any, int] = {}
    for i, t in enumerate(tgts):
        k = _engine_key(t)
        if k in seen:
            raise P.RefitError(f"engine{i} is engine{seen[k]} again: list each engine once", kind="validation")
        seen[k] = i


def _version_of(e: _Engine, timeout_s: float) -> int:
    """The engine's version, also while its weights are mixed (``rlpatch_weight_state`` never raises for that)."""
    return max(int(s["version"]) for s in e.drive("weight_state", {}, timeout_s)["workers"])


def _versions(engines: list[_Engine], timeout_s: float) -> dict[int, int | None]:
    calls = _parallel({e.i: (lambda e=e: _version_of(e, timeout_s)) for e in engines if not e.dead}, timeout_s)
    out: dict[int, int | None] = {}
    for e in engines:
        c = calls.get(e.i)
        if c is None or not c.done.is_set() or c.error is not None:
            out[e.i] = None
            if c is not None and not c.done.is_set():
                e.dead = True
                e.errors.append(f"{e.name}: no answer to weight_version within {timeout_s:.1f} s (declared dead)")
            elif c is not None:
                if _is_dead(c.error):
                    e.dead = True
                why = _one_line(c.error) if isinstance(c.error, P.RefitError) else \
                    f"{type(c.error).__name__}: {_one_line(c.error)}"
                e.errors.append(f"{e.name}: weight_version: {why}")
        else:
            out[e.i] = int(c.result)
    return out


def _schemas(engines: list[_Engine], timeout_s: float) -> list[Any]:
    """Every engine's schema (cached per engine after the first update), asked of all at once: an engine that
    cannot say (unreachable, dead, no plugin) or does not answer within ``timeout_s`` is an error naming it."""
    calls = _parallel({e.i: (lambda e=e: schema_for(e.tgt)) for e in engines}, timeout_s)
    for e in engines:
        c = calls[e.i]
        if not c.done.is_set():
            raise P.RefitError(f"{e.name}: no answer to describe within {timeout_s:.1f} s", kind="transport")
        if c.error is not None:
            kind = c.error.kind if isinstance(c.error, P.RefitError) else "refused"
            raise P.RefitError(f"{e.name}: describe: {_one_line(c.error)}", kind=kind) from c.error
    return [calls[e.i].result for e in engines]


def push_fleet(targets: list[Any], named_tensors: Any, opts: Options, raise_on_error: bool = True) -> FleetReport:
    t0 = time.perf_counter()
    if not targets:
        raise P.RefitError("push_weights([]): the fleet has no engine", kind="validation")
    tgts = [resolve(t) for t in targets]
    _check_targets(tgts)
    engines = [_Engine(i, t) for i, t in enumerate(tgts)]
    # schemas: every engine must expect the same tensors
    schemas = _schemas(engines, opts.timeout_s)
    schema = schemas[0]
    for e, s in zip(engines[1:], schemas[1:]):
        if s.tensors != schema.tensors or s.aliases != schema.aliases:
            raise P.RefitError(f"{e.name} serves another model than engine0 (its schema differs): a fleet update "
                               "needs one model", kind="validation")
    remote = next((e.name for e in engines if not e.tgt.same_host()), None)
    url = next((e.name for e in engines if e.tgt.kind == "http"), None)
    opts = dataclasses.replace(opts, transport=transports.for_fleet(opts.transport, remote=remote, url=url,
                                                                    dist_host=opts.dist_host))
    key = ("fleet",) + tuple(_engine_key(e.tgt) for e in engines)
    out_ = Outgoing(tgts[0], named_tensors, opts, schema, pool=CACHE.of_key(key).shm_pool(), fleet=True)
    fleet = _Fleet(engines, out_, opts, [s.workers for s in schemas], t0, raise_on_error)
    try:
        return fleet.run()
    finally:
        if out_.sender is not None and not fleet.keep_pool:
            CACHE.drop_pool(key)  # an engine declared dead may still read them: the next update packs anew
        out_.close()


class _Fleet:
    """One fleet update once its engines, schema and transport are known: the module doc's steps 1-5."""

    def __init__(self, engines: list[_Engine], out_: Outgoing, opts: Options, workers: list[int | None],
                 t0: float, raise_on_error: bool):
        self.engines, self.out_, self.opts, self.workers = engines, out_, opts, workers
        self.t0, self.raise_on_error = t0, raise_on_error
        self.txid: str = out_.req["txid"]
        self.group = out_.sender_type.needs_receivers  # one group spanning every engine's workers
        self.bases: dict[int, int] = {}  # with a group: each engine's first worker rank
        self.stages: dict[str, float] = {}
        self.cur: dict[int, int | None] = {}  # each engine's version, as its prepare answer said
        self.new_version: int | None = opts.version
        self.keep_pool = True

    def run(self) -> FleetReport:
        # the trainer's side first (pack and digest / fingerprint), before any RPC of this update: an RPC wakes
        # every engine's workers, and vLLM's shm-broadcast readers then spin for a second (busy_loop_s = 1 in
        # shm_broadcast.py) on the cores the trainer would be packing on. The engines' versions come back with
        # their prepare answers (no RPC of their own: an engine core that read a message less than a second ago
        # spins while it waits for its workers), and the new version travels with the commit.
        self._send()
        if self.out_.refused is not None:
            for e in self.engines:
                e.errors.append(f"{e.name}: not asked (the sender refused the update)")
            return self._end("unchanged", self.out_.refused["message"], refused=self.out_.refused)
        prep = self._prepare()
        if not all(r.get("ok") for r in prep.values()) or any(e.dead for e in self.engines):
            return self._abort_prepared(prep)
        com = self._commit()
        if all(r.get("ok") for r in com.values()) and not any(e.dead for e in self.engines):
            return self._release()
        return self._roll_back(com)

    def _send(self) -> None:
        if self.group:
            self.bases = _dist_rank_bases(self.engines, self.workers)
            # the group's timeout ends before the phase's: a rank that never joins (a hung engine) turns into a
            # transport error on the others, and the hung engine is named when the phase times out
            self.out_.send(n_workers=sum(self.workers), group_timeout_s=_dist_group_timeout(self.opts.timeout_s))
        else:
            self.out_.send(n_workers=self.workers[0])
        self.stages.update(self.out_.stages)

    def _prepare(self) -> dict[int, dict[str, Any]]:
        """Phase 1: prepare everywhere (with a group: every engine's workers receive the one broadcast here)."""
        req = dict(self.out_.req)
        req["workers"] = None  # never the one-RPC path: a fleet prepares everywhere before it writes anywhere
        req["deadline"] = time.time() + self.opts.timeout_s
        # one request per engine; with a group they differ only in the rank offset of the engine's workers
        reqs = {e.i: _dist_request(req, self.bases[e.i]) if self.group else req for e in self.engines}
        t1 = time.perf_counter()
        prep = _run_phase(self.engines, "prepare", lambda e: {"req": reqs[e.i]}, self.opts.timeout_s)
        self.stages["prepare"] = time.perf_counter() - t1
        if self.out_.sender_type.streams_bytes:
            good = all(r.get("ok") for r in prep.values()) and not any(e.dead for e in self.engines)
            self.stages.update(self.out_.finish_send(timeout=10.0 if good else 0.0))
        for e in self.engines:
            e.prep = prep.get(e.i)
        self.cur = {e.i: _prepared_version(e.prep) for e in self.engines}
        if self.new_version is None:
            self.new_version = max(v or 0 for v in self.cur.values()) + 1
        if any(e.dead for e in self.engines):
            self.keep_pool = False
        return prep

    def _abort_prepared(self, prep: dict[int, dict[str, Any]]) -> FleetReport:
        t1 = time.perf_counter()
        ab = _run_phase(self.engines, "abort", lambda e: {"txid": self.txid}, self.opts.timeout_s)
        self.stages["abort"] = time.perf_counter() - t1
        for e in self.engines:
            e.abort = ab.get(e.i)
            # nothing was written anywhere (prepare only stages): an abort that could not say (its RPC
            # failed, e.g. a server without the phase routes) leaves the weights as they were
            said = (e.abort or {}).get("state")
            e.state = "unknown" if e.dead else (said if said not in (None, "unknown") else "unchanged")
        bad = [e for e in self.engines if e.errors]
        return self._end(_fleet_state(self.engines), "prepare failed on " + "; ".join(
            x for e in bad for x in e.errors[:1]) + self._never_joined(), kind=_kind(prep))

    def _never_joined(self) -> str:
        """After a failed prepare: the engines with a worker that never joined the broadcast group (why the
        others' group timed out), as a message suffix."""
        missing = set(self.out_.sender.missing_ranks()) if self.group and self.out_.sender is not None else set()
        names = []
        for e, n_workers in zip(self.engines, self.workers):
            n = len([r for r in missing if self.bases[e.i] <= r < self.bases[e.i] + int(n_workers or 0)])
            if n:
                names.append(f"{e.name} ({n} worker{'s' if n > 1 else ''})")
        return f"; never joined the broadcast group: {', '.join(names)}" if names else ""

    def _commit(self) -> dict[int, dict[str, Any]]:
        """Phase 2: commit everywhere, every engine keeping its backup until all committed."""
        t1 = time.perf_counter()
        n = {e.i: len(e.prep["workers_prepare"]) for e in self.engines}
        creq = {"txid": self.txid, "version": self.new_version, "inflight": self.out_.req.get("inflight")}
        com = _run_phase(self.engines, "commit", lambda e: {"req": creq, "n": n[e.i], "keep": True},
                         self.opts.timeout_s)
        self.stages["commit"] = time.perf_counter() - t1
        for e in self.engines:
            e.commit = com.get(e.i)
        if any(e.dead for e in self.engines):
            self.keep_pool = False
        return com

    def _release(self) -> FleetReport:
        t1 = time.perf_counter()
        # (each engine's front end takes the update in its release phase, where it lives)
        rel = _run_phase(self.engines, "release",
                         lambda e: {"txid": self.txid, "version": (e.commit or {}).get("version")}, self.opts.timeout_s)
        self.stages["release"] = time.perf_counter() - t1
        for e in self.engines:
            e.state = "committed"
            if not rel.get(e.i, {}).get("ok"):
                e.errors.append(f"{e.name}: release after commit failed (its backup is dropped at the next update)")
        return self._end("committed", "")

    def _roll_back(self, com: dict[int, dict[str, Any]]) -> FleetReport:
        """One engine failed to commit: roll back the ones that committed ..."""
        t1 = time.perf_counter()
        # ... and the live ones whose commit RPC raised: what they hold is unknown, an abort undoes what they wrote
        done = [e for e in self.engines if not e.dead and ((e.commit or {}).get("ok")
                                                          or (e.commit or {}).get("state") == "unknown")]
        # (an engine left mixed refuses requests: its front end was told in its commit or abort phase)
        ab = _run_phase(done, "abort", lambda e: {"txid": self.txid}, self.opts.timeout_s) if done else {}
        self.stages["abort"] = time.perf_counter() - t1
        for e in self.engines:
            if e.dead:
                e.state = "unknown"
            elif e in done:
                e.abort = ab.get(e.i) or {}
                e.state = e.abort.get("state", "unknown")
                if not (e.commit or {}).get("ok") and _had_nothing_to_abort(e.abort):
                    e.state = "unknown"  # its commit raised and left no transaction: what it holds is unknown
            else:
                e.state = (e.commit or {}).get("state") or "unknown"
        state = _fleet_state(self.engines)
        _align(self.engines, self.stages, self.opts.timeout_s)
        failed = [e for e in self.engines if not (e.commit or {}).get("ok")]
        return self._end(state, "commit failed on " + "; ".join(x for e in failed for x in e.errors[:1]),
                         kind=_kind(com))

    def _end(self, state: str, message: str, *, kind: str = "commit", refused: dict[str, Any] | None = None
             ) -> FleetReport:
        live = [e for e in self.engines if not e.dead]
        said = {e.i: (e.commit or {}).get("version") for e in live}
        if state == "committed" and all(v is not None for v in said.values()):
            # as each engine's commit answered (no RPC after the release: it would wake every engine's workers,
            # and vLLM's RPC readers spin for a second after a read on the cores the trainer works on)
            final = {i: int(v) for i, v in said.items()}
        elif state == "committed" or any(e.commit for e in self.engines):
            final = _versions(live, self.opts.timeout_s) if live else {}  # after a write: asked now
        else:  # nothing written: as each engine said in its prepare answer, and asked of those that did not say
            final = dict(self.cur)
            final.update(_versions([e for e in live if self.cur.get(e.i) is None], self.opts.timeout_s))
        entries = [_entry(e, final.get(e.i), self.out_.transport, self.opts.mode) for e in self.engines]
        slow = max(entries, key=lambda x: x["seconds"], default=None)
        metas = self.out_.metas
        rep = FleetReport(ok=state == "committed", state=state,
                          version=self.new_version if state == "committed" else None,
                          versions=[x["version"] for x in entries], transport=self.out_.transport,
                          mode=self.opts.mode, bytes=sum(m.nbytes for m in metas), tensors=len(metas),
                          seconds=time.perf_counter() - self.t0, stages=self.stages, engines=entries,
                          slowest=slow["name"] if slow else None, slowest_seconds=slow["seconds"] if slow else 0.0,
                          txid=self.txid, message=message, buckets=self.out_.buckets)
        if not rep.ok and self.raise_on_error:
            raise P.RefitError(f"fleet weight update not applied ({state}): {message}",
                               kind=(refused or {}).get("kind", kind), state=state,
                               problems=(refused or {}).get("problems", []), report=rep)
        return rep


def _entry(e: _Engine, version: int | None, transport: str, mode: str) -> dict[str, Any]:
    """One engine's entry in the fleet's report."""
    e.version = version
    merged: dict[str, Any] = {}
    for r in (e.prep, e.commit):
        merged.update({k: v for k, v in (r or {}).items() if k.startswith("workers") or k.startswith("seconds_")})
    if e.abort and e.abort.get("workers"):
        merged["workers_abort"] = e.abort["workers"]
    rep = build_report({**merged, "ok": e.state == "committed", "state": e.state, "version": e.version},
                       transport=transport, mode=mode, nbytes=0, n=0, seconds=e.seconds, stages={}, host_extra=0)
    return {"name": e.name, "ok": e.state == "committed", "state": e.state, "version": e.version,
            "seconds": e.seconds, "stages": rep.stages, "errors": list(e.errors), "dead": e.dead,
            "guarantee": rep.guarantee, "path": rep.path, "backup": rep.backup, "checks": rep.checks}


def _had_nothing_to_abort(abort: dict[str, Any]) -> bool:
    """A worker answered the abort with no transaction of that id (it never prepared, or its commit dropped it)."""
    return any(isinstance(w, dict) and w.get("absent") for w in abort.get("workers") or [])


def _prepared_version(r: dict[str, Any] | None) -> int | None:
    """The version an engine holds, from its prepare answer (every rank says; None: it did not prepare)."""
    vs = [w.get("weight_version") for w in (r or {}).get("workers_prepare") or []]
    return max(vs) if vs and None not in vs else None


def _dist_rank_bases(engines: list[_Engine], workers: list[int | None]) -> dict[int, int]:
    """``dist`` across a fleet: one group, the trainer rank 0, then each engine's workers in the order given
    (world = 1 + every engine's worker count); an engine's worker of rank r is rank ``base + r``."""
    bases, base = {}, 1
    for e, n in zip(engines, workers):
        if not n:
            raise P.RefitError(f"{e.name}: its worker count is unknown, so its ranks in the fleet's broadcast group "
                               "cannot be placed: use transport='shm'", kind="validation")
        bases[e.i], base = base, base + int(n)
    return bases


def _dist_group_timeout(timeout_s: float) -> float:
    """The fleet's broadcast group times out before the phase does (``timeout_s``): the ranks that joined get a
    transport error in time to answer, the one that never joined is the engine named for no answer."""
    return max(1.0, 0.75 * timeout_s)


def _dist_request(req: dict[str, Any], base: int) -> dict[str, Any]:
    """The request one engine of a ``dist`` fleet gets: the shared one with its workers' rank offset, received
    in prepare (never streamed into the weights in commit, where a refusal would leave the others waiting)."""
    return {**req, "transport": {**req["transport"], "rank_base": base, "stream": False}}


def _kind(results: dict[int, dict[str, Any]]) -> str:
    return next((r.get("kind") for r in results.values() if not r.get("ok") and r.get("kind")), "commit")


def _fleet_state(engines: list[_Engine]) -> str:
    states = [e.state for e in engines]
    for s in ("mixed", "unknown", "restored"):
        if s in states:
            return s
    return "unchanged"


def _align(engines: list[_Engine], stages: dict[str, float], timeout_s: float) -> None:
    """After a rollback: every engine at the highest version any of them reached (nothing else changes)."""
    live = [e for e in engines if not e.dead]
    vs = _versions(live, timeout_s)
    known = [v for v in vs.values() if v is not None]
    if not known or len(set(known)) == 1:
        return
    top = max(known)
    t1 = time.perf_counter()
    lag = [e for e in live if vs.get(e.i) is not None and vs[e.i] < top]
    calls = _parallel({e.i: (lambda e=e: e.drive("align_version", {"version": top}, timeout_s)) for e in lag},
                      timeout_s)
    for e in lag:
        c = calls[e.i]
        if not c.done.is_set() or c.error is not None:
            e.errors.append(f"{e.name}: could not align its version to {top}: {c.error or 'no answer'}")
    stages["align_versions"] = time.perf_counter() - t1


class VersionsDisagree(P.RefitError):
    """The engines of a fleet report different weight versions; ``versions``: each one's, in the order given."""

    def __init__(self, versions: list[int]):
        super().__init__("the engines' weight versions disagree: " + ", ".join(f"engine{i}={v}"
                                                                               for i, v in enumerate(versions)),
                         kind="validation", state="mixed")
        self.versions = versions


def fleet_versions(targets: list[Any]) -> list[int]:
    """Each engine's weight version, raising :class:`VersionsDisagree` if they differ."""
    vs = []
    for i, t in enumerate(targets):
        e = _Engine(i, resolve(t))
        try:
            vs.append(e.tgt.version())
        except Exception as err:  # noqa: BLE001 - which engine could not say, in one line
            kind = err.kind if isinstance(err, P.RefitError) else "refused"
            raise P.RefitError(f"{e.name}: weight_version: {_one_line(err)}", kind=kind) from err
    if len(set(vs)) > 1:
        raise VersionsDisagree(vs)
    return vs


_MOVED = ("push_weights", "push_weights_async", "weight_version")


def __getattr__(name: str) -> Any:
    # The public calls are defined once, in .api (a list of targets is a fleet), which imports this module; the
    # package, always imported before this module, holds them.
    if name in _MOVED:
        warnings.warn(f"vllm_rlpatch.refit.fleet.{name} is deprecated: use vllm_rlpatch.refit.{name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(sys.modules["vllm_rlpatch.refit"], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
