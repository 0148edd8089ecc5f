"""The engine side of a refit: one worker's transaction, run through the ``rlpatch_refit_*`` worker methods.

An update is one or more *parts* (one for ``push_weights``; several for a :func:`~vllm_rlpatch.refit.refit_session`)
and ends in one commit with one version bump.

``prepare(request)``
    validates the part's metadata against the model's schema before any byte is read; opens the transport;
    checks the bytes (the sender's digests: NaN/inf counted in the same pass as the checksum; bytes that crossed
    a network are digested again here); decides the path and the guarantee (below) and reserves the backup.
    Nothing is written.
``commit(txid, version)``
    writes the part (backing it up first for ``rollback``) and checks what it wrote; on the final part fires
    the weight-update event with the new version. Any failure: ``rollback`` restores every backed-up byte and
    verifies them; ``validate-then-write`` and ``direct`` leave ``state="mixed"`` (the engine refuses to
    generate until a good update lands).
``abort(txid)``
    drops a prepared update, or rolls back one that was written (another rank failed, or the session ended
    with an exception).

Paths: ``plan`` (a verified copy plan: plain copies into the parameters' windows) or ``layerwise`` (vLLM's
own layerwise reload, which re-runs each layer's post-processing: CPU repacking, quantization).

Guarantees (``request["guarantee"]``, named in every result):

``rollback``
    a backup of everything the update writes is held until it commits (windows on the plan path; the whole
    model state on the layerwise path, whose post-processing re-creates tensors), in a reused arena of pinned
    host or device memory (:mod:`.backup`). Any failure restores it; the restored weights are compared with the
    backup.
``validate-then-write``
    no backup. Before the first write: the metadata, the sources' digests and finite values, and on the plan
    path that every source is resident and contiguous (the copy allocates nothing), castable in the copy, not
    overlapping a destination, and every destination still the model's live storage; every rank prepares before
    any rank writes. After the write, a mandatory check: the destination windows' digests against the sources'
    (plan path), or every layer complete and processed exactly once (layerwise path, whose post-processing
    leaves nothing to compare byte for byte). A failure after the first write leaves ``mixed``.
``auto`` (default)
    ``rollback`` when a bounded backup fits (on the device for the plan path, in the host arena within its cap
    for the layerwise path); otherwise ``validate-then-write`` on the plan path; otherwise refused before
    writing, with the sizes, offering ``mode="direct"`` or an explicit ``guarantee="validate-then-write"``.

``mode="direct"`` is the guarantee ``none``: written straight in (streamed for ``dist``), checked after,
``mixed`` on failure.

Results are plain dicts (``ok``, ``state``, ``kind``, ``problems``, ``guarantee``, ``path``, ``backup``,
``stages`` seconds, ``checks``...); expected failures are reported, never raised.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from typing import Any, Iterator

import torch

from vllm_rlpatch import envs
from vllm_rlpatch.hooks import layerwise, mixed, wake, weights, workerctx
from vllm_rlpatch.refit import backup as B
from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.cuda_ipc import IpcSource, LayoutSource
from vllm_rlpatch.refit.dist import DistSource
from vllm_rlpatch.refit.plan import CopyPlan, PlanError
from vllm_rlpatch.refit.shm import ShmSource
from vllm_rlpatch.refit.source import Source

logger = logging.getLogger("vllm.rlpatch")


def _now() -> float:
    return time.perf_counter()


class InjectedFault(RuntimeError):
    """A fault a test asked for (``VLLM_RLPATCH_FAULT_INJECTION=1``)."""


def _fail(kind: str, state: str, message: str, stages: dict, checks_: list, problems: list | None = None,
          **extra) -> dict[str, Any]:
    out = {"ok": False, "kind": kind, "state": state, "message": message, "problems": problems or [],
           "stages": stages, "checks": list(checks_), "pid": os.getpid(), **extra}
    if state == "mixed":
        out["mixed"] = mixed.MixedWeights(message, (), "refit").as_dict()
    return out


class _Part:
    """One prepared part of an update."""

    def __init__(self, req: dict[str, Any], metas: list[P.TensorMeta], source: Source, names: frozenset[str],
                 plan_names: frozenset[str]):
        self.req, self.metas, self.source = req, metas, source
        self.names = names  # every tensor's name
        self.plan_names = plan_names  # ``names`` less the tied aliases (an update template keeps both)
        self.tensors: dict[str, torch.Tensor] | None = None  # the received tensors (non-streamed sources)
        self.expected: dict[str, str] = {}  # name -> digest key of the bytes validated before the write


class _Tx:
    """One update: its parts, its path and guarantee, its backup."""

    def __init__(self, req: dict[str, Any]):
        self.txid: str = req["txid"]
        self.mode: str = req.get("mode", "atomic")
        self.partial = bool(req.get("partial", False))
        self.allow_cast = bool(req.get("allow_cast", False))
        self.verify = bool(req.get("verify", True))
        self.session = bool(req.get("session"))
        # fencing (a fleet update, :mod:`.fleet`): wall-clock time after which this worker refuses to commit
        d = req.get("deadline")
        self.deadline: float | None = float(d) if d is not None else None
        self.guarantee: str | None = None  # rollback | validate-then-write | none
        self.path: str | None = None  # plan | layerwise
        self.parts: list[_Part] = []
        self.pending: _Part | None = None
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
        self.fault: str | None = None  # armed by a test (VLLM_RLPATCH_FAULT_INJECTION=1)
        self.post_check: str | None = None
        self.note: str | None = None

    def mark(self, name: str) -> None:
        self.marks.append((name, _now()))

    def stage(self, name: str, seconds: float) -> None:
        self.stages[name] = self.stages.get(name, 0.0) + seconds

    def check(self, name: str) -> None:
        if name not in self.checks:
            self.checks.append(name)

    def backup_report(self) -> dict[str, Any] | None:
        b = self.windows or self.state_backup
        if b is None:
            return None
        return {"kind": self.backup_kind, "bytes": int(b.bytes), "seconds": float(b.seconds)}


class WorkerRefit:
    """Per-worker refit state: the schema, the verified copy plan, open transactions, backup arenas."""

    def __init__(self, worker: Any):
        self.worker_ref = weakref.ref(worker)
        self._schema: P.Schema | None = None
        self.txs: dict[str, _Tx] = {}
        self.plan = None  # a verified CopyPlan (None: not tried yet; False: not usable here)
        self.plan_note = "not captured yet (the first complete update captures and verifies it)"
        self.arenas: dict[str, B.BackupArena] = {}
        self.armed_fault: str | None = None
        self.templates: dict[str, dict[str, Any]] = {}  # key -> metadata and opened source of a repeated update
        self.aborted: collections.deque[str] = collections.deque(maxlen=256)  # fenced txids: never prepared again

    def arm_fault(self, where: str) -> dict[str, Any]:
        """Testing only (``VLLM_RLPATCH_FAULT_INJECTION=1``): the next transaction fails at ``where``
        (``prepare``, ``after_first_write``; ``@rankN`` for one rank)."""
        if not _fault_injection_allowed():
            return {"ok": False, "message": "fault injection is disabled in this engine (VLLM_RLPATCH_FAULT_INJECTION=1 "
                                            "enables it, for tests)"}
        if where.split("@")[0] not in ("prepare", "after_first_write"):
            return {"ok": False, "message": f"unknown fault {where!r}: prepare or after_first_write (@rankN)"}
        self.armed_fault = where
        return {"ok": True, "armed": where, "rank": self.rank}

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

    # --------------------------------------------------------------- schema
    def schema(self) -> P.Schema:
        if self._schema is None:
            mc = self.worker.model_config
            dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else getattr(torch, str(mc.dtype))
            errors = []
            # the checkpoint's own names are what vLLM's loader consumes; a model built from its config in
            # transformers (meta device) stands in where there is no checkpoint (load_format=dummy)
            try:
                self._schema = P.schema_from_checkpoint(str(mc.model), mc.hf_config, dtype)
            except Exception as e:  # noqa: BLE001 - fall back, report both if both fail
                errors.append(f"checkpoint: {type(e).__name__}: {e}")
                try:
                    self._schema = P.schema_from_hf_config(mc.hf_config, dtype,
                                                           getattr(mc, "trust_remote_code", False))
                except Exception as e2:  # noqa: BLE001
                    errors.append(f"transformers: {type(e2).__name__}: {e2}")
                    raise P.RefitError("cannot determine the tensors this model expects (" + "; ".join(errors) + ")",
                                       kind="validation") from e2
            logger.info("vllm-rlpatch: refit schema of %s: %d tensors (+%d tied aliases), %.1f MB, from %s",
                        type(self.model).__name__, len(self._schema.tensors), len(self._schema.aliases),
                        self._schema.nbytes / 1e6, self._schema.source)
        return self._schema

    def describe(self) -> dict[str, Any]:
        s = self.schema()
        vc = getattr(self.worker, "vllm_config", None)
        return {"schema": s.as_dict(), "device": str(self.device), "rank": self.rank, "pid": os.getpid(),
                "quantization": getattr(self.worker.model_config, "quantization", None),
                "lora": getattr(self.worker, "lora_config", None) is not None
                or getattr(vc, "lora_config", None) is not None,
                "model_class": type(self.model).__name__, "plan": self.plan_note}

    # --------------------------------------------------------------- helpers
    def _arena(self, kind: str) -> B.BackupArena:
        a = self.arenas.get(kind)
        if a is None:
            a = self.arenas[kind] = B.BackupArena(kind, self.device)
        return a

    def _plan_usable(self, names: set[str], tx: _Tx) -> bool:
        plan = self.plan
        if not getattr(plan, "verified", False):
            return False
        why = plan.live()
        if why is not None:
            self.plan, self.plan_note = None, f"invalidated: {why}; the next complete update captures a new one"
            logger.info("vllm-rlpatch: refit copy plan %s", self.plan_note)
            return False
        return plan.covers_part(names) if (tx.session or tx.partial) else plan.covers(names)

    def _fault(self, tx: _Tx, where: str) -> None:
        if tx.fault and tx.fault.split("@")[0] == where:
            at = tx.fault.split("@")[1] if "@" in tx.fault else None
            if at is None or at == f"rank{self.rank}":
                raise InjectedFault(f"injected fault {tx.fault!r} on rank {self.rank}")

    # --------------------------------------------------------------- prepare
    def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        self._dist_source: DistSource | None = None
        out = self._prepare(req)
        if not out.get("ok") and (req.get("transport") or {}).get("kind") == "dist":
            self._drain(req, out)
        return out

    def _drain(self, req: dict[str, Any], out: dict[str, Any]) -> None:
        """A refused ``dist`` update: this rank still takes part in the rest of the broadcast (joining the group
        if it refused before it did), so the sender and the other receivers - this engine's other workers, every
        other engine of a fleet - are not left waiting for it until the group's timeout."""
        src = self._dist_source
        t1 = _now()
        try:
            if src is None:
                src = make_source(req, [], self.worker, self.device)
            n = src.drain()
        except Exception as e:  # noqa: BLE001 - the refusal stands; the group fails on its timeout
            logger.warning("vllm-rlpatch: could not drain the refused dist update: %s: %s", type(e).__name__, e)
            out["drain_error"] = f"{type(e).__name__}: {e}"
            return
        if n:
            out.setdefault("stages", {})["drain"] = _now() - t1

    def _prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        t0 = _now()
        txid = req["txid"]
        if txid in self.aborted:
            return _fail("refused", "unchanged", f"update {txid!r} was aborted: it cannot be prepared again", {}, [])
        tx = self.txs.get(txid)
        new = tx is None
        if new:
            tx = _Tx(req)
            tx.fault, self.armed_fault = self.armed_fault, None
        elif tx.pending is not None:
            return _fail("validation", "unchanged", f"part of {txid!r} prepared twice", {}, [])
        stages = tx.stages
        tx.marks.append(("prepare", t0))
        try:
            if tx.guarantee is None and req.get("guarantee", "auto") not in P.GUARANTEES:
                return _fail("validation", "unchanged", f"guarantee={req.get('guarantee')!r}: use one of "
                             f"{', '.join(P.GUARANTEES)}", stages, tx.checks)
            if new and layerwise.reload_active(self.model):
                # vLLM's own update (start_weight_update ... finish_weight_update, or a reload that did not
                # finish) holds the layers on the meta device: its finish would overwrite whatever we write
                return _fail("refused", "unchanged", "vLLM's own weight update is open on this engine (its layers are "
                             "being reloaded: start_weight_update without finish_weight_update, or a reload that "
                             "did not finish); finish or abort it before push_weights", stages, tx.checks)
            schema = self.schema()
            partial = tx.partial or tx.session
            tmpl = None
            if (req.get("transport") or {}).get("kind") == "template":
                # the same tensors as an earlier update (a trainer updates its tensors in place): metadata checked
                # and IPC handles opened then; only this update's digests travel
                tmpl = self.templates.get(req["transport"]["key"])
                if tmpl is None:
                    return _fail("template", "unchanged", "unknown update template (the engine restarted?): send the "
                                 "full request", stages, tx.checks)
                metas = tmpl["metas"]  # the template's own records, this update's digests written into them
                fps = req.get("fingerprints") or [None] * len(metas)
                nfs = req.get("nonfinite") or [None] * len(metas)
                if len(fps) != len(metas) or len(nfs) != len(metas):
                    return _fail("validation", "unchanged", f"the update template has {len(metas)} tensors, the "
                                 f"request {len(fps)} digests", stages, tx.checks)
                for m, fp, nf in zip(metas, fps, nfs):
                    m.fingerprint, m.nonfinite = fp, nf
                probs = []
            else:
                metas = [P.TensorMeta.from_dict(d) for d in req["tensors"]]
                probs = P.validate_metadata(metas, schema, partial=partial, allow_cast=tx.allow_cast)
            again = sorted({m.name for m in metas} & tx.names_done)
            if again:
                probs.append(P.problem("duplicate", again[0], f"{again[0]} was already sent in an earlier part of "
                                                              "this update"))
            tx.check("metadata")
            tx.mark("metadata")
            if probs:
                return _fail("validation", "unchanged" if not tx.written else tx_state_now(tx),
                             P.summarize(probs), stages, tx.checks, probs)
            version = req.get("version")
            if new and version is not None:
                cur = weights.weight_version(self.worker)
                if int(version) <= cur:
                    return _fail("validation", "unchanged", f"version {version} is not greater than the engine's "
                                 f"current weight version {cur}", stages, tx.checks)
            self._fault(tx, "prepare")
            t1 = _now()
            if tmpl is not None:
                source = tmpl["source"]
                source.metas = metas
            else:
                source = make_source(req, metas, self.worker, self.device)
                if _is_dist(source):
                    self._dist_source = source  # taking part in the broadcast: drained if refused (prepare)
                source.open()
                if req.get("template"):
                    self.templates.clear()  # the latest only: a trainer that changed its tensors sent a new one
                    self.templates[req["template"]] = {"metas": metas, "source": source}
                    source.pinned = True  # kept open across updates
            # an update template keeps its name sets (an 8B model's 291 names, on every update)
            cache = tmpl if tmpl is not None else self.templates.get(req.get("template") or "")
            if cache is not None and "plan_names" in cache:
                all_names, names = cache["all_names"], cache["plan_names"]
            else:
                all_names = frozenset(m.name for m in metas)
                names = frozenset(n for n in all_names if n not in schema.aliases)
                if cache is not None:
                    cache["all_names"], cache["plan_names"] = all_names, names
            part = _Part(req, metas, source, all_names, names)
            tx.stage("open", _now() - t1)
            tx.mark("opened")
            live_now = False  # the plan's liveness proven in this call
            if tx.path is None:
                tx.path = "plan" if self._plan_usable(names, tx) else "layerwise"
                live_now = tx.path == "plan"
            elif tx.path == "plan" and not self._plan_usable(names, tx):
                return _fail("validation", tx_state_now(tx), "this part has tensors the copy plan does not cover "
                             "(an earlier part of the session took the plan path)", stages, tx.checks)
            tx.mark("path")
            # streamed (direct, dist): received in commit, as it is written; a fleet receives here (``stream``
            # False): every engine takes part in the one broadcast while they all prepare
            streamed = tx.mode == "direct" and getattr(source, "streaming_ok", True) and _is_dist(source)
            if not streamed:
                t1 = _now()
                if _is_dist(source):
                    source.receive_all()
                part.tensors = {m.name: t for m, t in source.tensors()}
                tx.stage("receive", _now() - t1)
                tx.mark("received")
                probs = self._check_sources(tx, part)
                if probs:
                    _close(source)
                    kind = "transport" if any(p["kind"] == "fingerprint" for p in probs) else "validation"
                    return _fail(kind, tx_state_now(tx), P.summarize(probs), stages, tx.checks, probs)
            if tx.guarantee is None:
                decided = self._decide(tx, req, part)
                if isinstance(decided, dict):
                    _close(source)
                    return decided
            elif tx.guarantee == "rollback" and tx.path == "plan":  # a later part of a session: room for its backup
                need = sum(e.dst.element_size() * _numel(e.dst_geom[0]) for e in self.plan.entries_for(names))
                arena = self._arena(tx.backup_kind)
                have = arena.capacity - (tx.windows.bytes if tx.windows is not None else 0)
                ok, why = B.fits(need, tx.backup_kind, self.device, max(0, have))
                if ok and have < need:  # a session's parts share one arena: a later part grows it by a chunk
                    arena.grow(need)
                if not ok:
                    _close(source)
                    return _fail("refused", tx_state_now(tx), f"no room to back up this part ({why}): abort the "
                                 "session (its earlier parts are restored)", stages, tx.checks)
            if tx.guarantee == "validate-then-write" and tx.path == "plan":
                entries = self.plan.entries_for(names)
                static_key = (self.plan, tx.allow_cast, len(entries))
                if tmpl is not None and tmpl.get("static_ok") == static_key:
                    # the sources are the template's: only liveness can change (proven just above, or now)
                    why = None if live_now else self.plan.live()
                else:
                    why = self.plan.preconditions(entries, part.tensors or {}, tx.allow_cast)
                    if why is None and tmpl is not None:
                        tmpl["static_ok"] = static_key
                if why is not None:
                    _close(source)
                    return _fail("validation", tx_state_now(tx), f"validate-then-write: {why}", stages, tx.checks)
                tx.check("preconditions")
            tx.pending = part
            self.txs[txid] = tx
            tx.mark("prepared")
            tx.stage("prepare", _now() - t0)
            # the version this rank holds now: a fleet picks max + 1 from these answers (no RPC of its own)
            return self._result(tx, ok=True, state=tx_state_now(tx),
                                weight_version=weights.weight_version(self.worker))
        except P.RefitError as e:
            return _fail(e.kind, tx_state_now(tx), str(e), stages, tx.checks, e.problems)
        except InjectedFault as e:
            return _fail("fault", tx_state_now(tx), str(e), stages, tx.checks)
        except Exception as e:  # noqa: BLE001 - an unexpected failure is still a structured failure
            logger.exception("vllm-rlpatch: refit prepare failed")
            return _fail("transport" if "transport" in str(e) else "validation", tx_state_now(tx),
                         f"{type(e).__name__}: {e}", stages, tx.checks)

    def _check_sources(self, tx: _Tx, part: _Part) -> list[dict[str, Any]]:
        """NaN/inf, the bytes' digests (re-computed only for bytes that crossed a network), tied tensors equal.
        Records the digests the post-write check compares against."""
        probs: list[dict[str, Any]] = []
        tensors = part.tensors or {}
        t1 = _now()
        counted = all(m.nonfinite is not None for m in part.metas)
        if part.source.trusted_digests and counted:
            for m in part.metas:
                if m.fingerprint:
                    part.expected[m.name] = m.fingerprint
            tx.check("sender_digest")
        elif tx.verify or tx.mode != "direct":
            names = [m.name for m in part.metas]
            ds = checks.digests([tensors[n] for n in names])
            for m, d in zip(part.metas, ds):
                if m.fingerprint and d.key != m.fingerprint:
                    probs.append(P.problem("fingerprint", m.name, f"{m.name}: the bytes received differ from the "
                                                                  f"bytes sent (checksum {d.key} != {m.fingerprint})"))
                m.nonfinite = d.nonfinite
                part.expected[m.name] = d.key
            tx.check("transport_fingerprint" if any(m.fingerprint for m in part.metas) else "digest")
        if all(m.nonfinite is not None for m in part.metas):
            for m in part.metas:
                if m.nonfinite:
                    probs.append(P.problem("nonfinite", m.name, f"{m.name}: {m.nonfinite} of {math_prod(m.shape)} "
                                                                "values are NaN or infinite"))
            tx.check("finite")
        tx.stage("check", _now() - t1)
        schema = self.schema()
        for alias, target in schema.aliases.items():
            if alias in tensors and target in tensors:
                a, b = part.expected.get(alias), part.expected.get(target)
                same = (a == b) if (a and b) else torch.equal(tensors[alias], tensors[target])
                if not same:
                    probs.append(P.problem("tied", alias, f"{alias} differs from {target}, but the engine's model "
                                                          "ties them (one tensor): send equal tensors, or untie the "
                                                          "model on both sides"))
        if schema.aliases:
            tx.check("tied_equal")
        return probs

    def _decide(self, tx: _Tx, req: dict[str, Any], part: _Part) -> dict[str, Any] | None:
        """The guarantee and the backup's place; a refusal (result dict) when neither level can be met."""
        want = req.get("guarantee", "auto") or "auto"
        if tx.mode == "direct":
            tx.guarantee = "none"
            return None
        if want == "validate-then-write":
            tx.guarantee = want
            return None
        if wake.weights_discarded(self.worker):
            # after sleep(level=2) the weight memory holds no valid weights: a backup would restore garbage
            if want == "rollback":
                return _fail("refused", "unchanged", "guarantee='rollback' needs valid old weights, and a level-2 "
                             "sleep discarded them: push with guarantee='validate-then-write' (or 'auto')",
                             tx.stages, tx.checks)
            tx.guarantee = "validate-then-write"
            tx.note = "the old weights were discarded by a level-2 sleep: no rollback possible, validated instead"
            return None
        dev = self.device
        slots = 1
        if tx.path == "plan":
            if tx.session or tx.partial:
                ents = self.plan.entries_for({m.name for m in part.metas})
                need, slots = sum(e.dst.element_size() * _numel(e.dst_geom[0]) for e in ents), len(ents)
            else:
                need, slots = self.plan.window_bytes(), self.plan.copies
            kind = "device" if dev.type == "cuda" else "host"
        else:
            need, slots = B.state_bytes(self.model), B.state_count(self.model)
            kind = B.arena_kind(dev, req.get("backup", "auto"))
            if dev.type == "cuda" and req.get("backup", "auto") == "auto":
                ok_dev, _ = B.fits(need, "device", dev, self._arena("device").capacity)
                kind = "device" if ok_dev else "pinned"
        if req.get("backup") == "host" and dev.type == "cuda":
            kind = "pinned"
        arena = self._arena(kind)
        ok, why = B.fits(need, kind, dev, arena.capacity)
        if ok:
            try:
                arena.reserve(need, slots)
            except Exception as e:  # noqa: BLE001 - out of memory while reserving: nothing written
                ok, why = False, f"reserving {need / 2**30:.2f} GiB of {kind} memory failed: {type(e).__name__}: {e}"
        if ok:
            tx.guarantee, tx.backup_kind = "rollback", kind
            return None
        if want == "auto" and tx.path == "plan":
            tx.guarantee = "validate-then-write"
            return None
        if want == "rollback" and kind == "device":  # asked for explicitly: the pinned host arena, overlapped
            kind = "pinned"
            arena = self._arena(kind)
            ok, why = B.fits(need, kind, dev, arena.capacity)
            if ok:
                try:
                    arena.reserve(need, slots)
                    tx.guarantee, tx.backup_kind = "rollback", kind
                    return None
                except Exception as e:  # noqa: BLE001
                    why = f"reserving {need / 2**30:.2f} GiB of pinned memory failed: {type(e).__name__}: {e}"
        return _fail("refused", "unchanged", f"no room for the rollback backup ({why}); the {tx.path} path can fail "
                     "part-way, so the update is refused before anything is written. Pass mode='direct' (written "
                     "straight in, mixed on failure) or guarantee='validate-then-write' (no backup, checked before "
                     "and after), or raise VLLM_RLPATCH_BACKUP_HOST_BYTES", tx.stages, tx.checks,
                     backup_needed=need, backup_kind=kind)

    def _result(self, tx: _Tx, **kw) -> dict[str, Any]:
        return {"stages": tx.stages, "checks": list(tx.checks), "marks": list(tx.marks), "pid": os.getpid(),
                "rank": self.rank,
                "guarantee": tx.guarantee, "path": tx.path, "backup": tx.backup_report(),
                "post_check": tx.post_check, "note": tx.note, "plan": self.plan_note, "extra_host_bytes": tx.extra_host,
                "extra_device_bytes": tx.extra_device, **kw}

    # --------------------------------------------------------------- commit
    def commit(self, txid: str, version: int | None = None, release: bool = True,
               request: dict[str, Any] | None = None, final: bool = True) -> dict[str, Any]:
        """Write the prepared part; on the ``final`` part, finish the update (one version bump). ``request``:
        prepare and commit in one RPC (a single worker: nothing to agree on across ranks)."""
        if request is not None:
            prep = self.prepare(request)
            if not prep.get("ok"):
                if not request.get("session"):
                    self._drop(request["txid"])
                return prep
        tx = self.txs.get(txid)
        if tx is None:
            if txid in self.aborted:
                return _fail("refused", "unchanged", f"update {txid!r} was aborted: not written", {}, [])
            return _fail("validation", "unchanged", f"no prepared update {txid!r} in this worker", {}, [])
        if tx.deadline is not None and not tx.written and time.time() > tx.deadline:
            late = time.time() - tx.deadline
            self._drop(txid)
            self.aborted.append(txid)
            return _fail("refused", "unchanged", f"update {txid!r} passed its deadline {late:.1f} s ago (timeout_s): "
                         "not written", {}, [])
        t0 = _now()
        tx.marks.append(("commit", t0))
        dev = self.device
        if dev.type == "cuda":
            base_alloc = _reset_peak(dev)
        error: BaseException | None = None
        findings = None
        try:
            part = tx.pending
            if part is not None:
                tx.pending = None
                if tx.path == "plan":
                    # prepared in this very call (one worker: one RPC), liveness was proven a moment ago
                    self._write_plan(tx, part, live_proven=request is not None)
                else:
                    findings = self._write_layerwise(tx, part, final)
                tx.parts.append(part)
                tx.names_done |= part.names
            if final:
                if tx.path == "layerwise" and tx.reload_open:
                    findings = self._finish_layerwise(tx)
                if tx.mode == "direct" and tx.verify:
                    self._check_after_direct(tx)
                if tx.path == "layerwise" and tx.guarantee == "validate-then-write":
                    tx.post_check = "layer_completeness"
                    tx.check("layers_complete")
                if (tx.path == "layerwise" and self.plan is None and not tx.partial and not tx.session
                        and tx.guarantee != "none"):
                    t1 = _now()
                    self._capture_plan(tx, tx.parts[-1] if tx.parts else None)
                    tx.stage("plan_capture", _now() - t1)
        except BaseException as e:  # noqa: BLE001 - everything below decides what the engine holds now
            error = e
        tx.stage("commit", _now() - t0)
        tx.mark("written")
        if dev.type == "cuda":
            tx.extra_device = max(tx.extra_device, _peak(dev) - base_alloc)
        if error is not None:
            return self._failed(tx, error, findings)
        if not final:
            return self._result(tx, ok=True, state="writing", findings=findings.as_dict() if findings else None)
        tx.committed = True
        mixed.clear_worker()
        if not tx.partial:
            wake.set_discarded(self.worker, False)  # valid weights again
        # logged by the caller and the engine core (a log line costs the update ~50 us here)
        ev = weights.fire(self.worker, "rlpatch_refit", "worker", version=version, log_level=logging.DEBUG)
        tx.mark("fired")
        out = self._result(tx, ok=True, state="committed", version=ev.version,
                           findings=findings.as_dict() if findings else None)
        if release:
            self._drop(txid)
        return out

    # plan path ----------------------------------------------------------------------------------------------
    def _write_plan(self, tx: _Tx, part: _Part, live_proven: bool = False) -> None:
        plan = self.plan
        tmpl = self._template_of(part)
        names = part.plan_names
        ekey = (plan, names)  # the plan object itself: an id could be reused
        if tmpl is not None and tmpl.get("entries_key") == ekey:
            entries = tmpl["entries"]
        else:
            entries = plan.entries_for(names)
            if tmpl is not None:
                tmpl["entries_key"], tmpl["entries"] = ekey, entries
        if tx.guarantee == "validate-then-write" and not live_proven:  # proven again before the first byte moves
            why = plan.live()
            if why is not None:
                raise P.RefitError(f"validate-then-write: {why}", kind="validation")
        sources = part.tensors
        if sources is None:  # streamed (direct dist): copy as the buckets arrive
            for m, t in part.source.tensors():
                if m.name in names:
                    plan.copy(plan.entries_for({m.name}), {m.name: t})
                    tx.written = True
            tx.check("plan_copy")
            return
        t1 = _now()
        if tx.guarantee == "rollback":
            if tx.windows is None:
                arena = self._arena(tx.backup_kind)
                arena.begin()
                tx.windows = B.WindowBackup(arena)
            dst = plan.windows(entries)
            src = plan.source_windows(entries, sources)

            def write(i: int) -> None:
                dst[i].copy_(src[i], non_blocking=True)
                tx.written = True
                if i == 0:
                    self._fault(tx, "after_first_write")

            tx.windows.save_then(dst, write)
            if tx.backup_kind in ("host", "pinned"):
                tx.extra_host = max(tx.extra_host, tx.windows.bytes)
            tx.check(f"backup_{'device' if tx.backup_kind == 'device' else 'host'}")
        else:
            if tx.fault and tx.fault.startswith("after_first_write") and entries:
                plan.copy(entries[:1], sources)
                tx.written = True
                self._fault(tx, "after_first_write")
            fused = None
            if (tx.verify or tx.guarantee == "validate-then-write") and not tx.fault and self.device.type == "cuda":
                # the copies and the post-write check in one pass: each destination block is read back right
                # after its store and digested (about one copy's time instead of a copy plus a digest pass)
                fused = self._copy_check(tmpl, entries, sources)
            if fused is not None:
                whole = tmpl.get("fused_names") if tmpl is not None and tmpl.get("fused") is fused else None
                want = [part.expected.get(n) for n in whole] if whole is not None else \
                    self._expected_windows(entries, part)
                tx.written = True
                bad = [entries[i].name for i in fused.run_and_compare(want)]
                tx.stage("write_check", _now() - t1)
                tx.check("plan_copy")
                tx.check("copy_readback")
                tx.post_check = "window_digests"
                tx.check("window_digests")
                if bad:
                    raise P.RefitError(f"after the write, {len(bad)} destination window(s) do not hold the validated "
                                       f"bytes: {', '.join(bad[:6])}", kind="commit")
                return
            graph = self._copy_graph(part, entries, sources) if not tx.fault else None
            tx.marks.append(("write", t1))
            if graph is not None:
                graph.replay()  # the template's copies, captured once: one launch
                tx.check("copy_graph")
            else:
                plan.copy(entries, sources)
            tx.written = True
            tx.mark("launched")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tx.stage("write", _now() - t1)
        tx.mark("synced")
        tx.check("plan_copy")
        if tx.verify or tx.guarantee == "validate-then-write":
            t1 = _now()
            want = self._expected_windows(entries, part)
            bad = [entries[i].name for i in checks.mismatches(plan.windows(entries), want)]
            tx.stage("check_after", _now() - t1)
            tx.post_check = "window_digests"
            tx.check("window_digests")
            if bad:
                raise P.RefitError(f"after the write, {len(bad)} destination window(s) do not hold the validated bytes: "
                                   f"{', '.join(bad[:6])}", kind="commit")

    def _template_of(self, part: _Part) -> dict[str, Any] | None:
        return self.templates.get(part.req.get("template") or (part.req.get("transport") or {}).get("key") or "")

    def _copy_check(self, tmpl: dict[str, Any] | None, entries, sources):
        """The fused copy-and-check kernel's plan for these windows (kept by an update template with the names
        whose digests its windows must have), or None where it does not apply."""
        key = (self.plan, len(entries))  # the plan object (kept alive by the key), not its id
        if tmpl is not None and tmpl.get("fused_key") == key:
            return tmpl["fused"]
        fused = checks.copy_check_plan(self.plan.windows(entries), self.plan.source_windows(entries, sources))
        if tmpl is not None and fused is not None:
            tmpl["fused_key"], tmpl["fused"] = key, fused
            tmpl["fused_names"] = [e.name for e in entries] if all(e.whole_source for e in entries) else None
        return fused

    def _copy_graph(self, part: _Part, entries, sources):
        """A CUDA graph of the plan's copies for an update template (its sources and the plan's windows stay
        the same tensors step after step): captured on the template's second use, replayed after. None where
        it does not apply (no template, not CUDA) or the capture failed (then the copies run one by one)."""
        tmpl = self.templates.get(part.req.get("template") or (part.req.get("transport") or {}).get("key") or "")
        if tmpl is None or self.device.type != "cuda" or tmpl.get("graph_failed"):
            return None
        key = (self.plan, len(entries))
        g = tmpl.get("graph")
        if g is not None and tmpl.get("graph_key") == key:
            return g
        if not tmpl.get("seen"):
            tmpl["seen"] = True  # the first use runs eagerly (the plan may be new); capture on the next
            return None
        try:
            dst = self.plan.windows(entries)
            src = self.plan.source_windows(entries, sources)
            g = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.graph(g, stream=stream):
                for d, s_ in zip(dst, src):
                    d.copy_(s_, non_blocking=True)
            torch.cuda.current_stream(self.device).wait_stream(stream)
        except Exception as e:  # noqa: BLE001 - the copies run one by one instead
            tmpl["graph_failed"] = True
            logger.info("vllm-rlpatch: capturing the refit copies as a CUDA graph failed (%s); copying eagerly", e)
            return None
        tmpl["graph"], tmpl["graph_key"] = g, key
        return g

    def _expected_windows(self, entries, part: _Part) -> list[str | None]:
        """The digest each destination window must have: the validated source digest where the window takes the
        whole source; else the source window's own digest, computed now (before anything else writes)."""
        out: list[str | None] = []
        partial_src = [e for e in entries if not e.whole_source]
        extra = {}
        if partial_src and part.tensors is not None:
            ds = checks.digests(self.plan.source_windows(partial_src, part.tensors))
            extra = {id(e): d.key for e, d in zip(partial_src, ds)}
        for e in entries:
            if e.whole_source:
                out.append(part.expected.get(e.name))
            else:
                out.append(extra.get(id(e)))
        return out

    # layerwise path -----------------------------------------------------------------------------------------
    def _iter_part(self, tx: _Tx, part: _Part, policy) -> Iterator[tuple[str, torch.Tensor]]:
        aliases = self.schema().aliases
        it = part.tensors.items() if part.tensors is not None else ((m.name, t) for m, t in part.source.tensors())
        for name, t in it:
            if name in aliases:
                continue
            if tx.fault and tx.fault.startswith("after_first_write") and policy.findings.processed > 0:
                tx.written = True
                self._fault(tx, "after_first_write")
            yield name, t
            if policy.findings.processed > 0:
                tx.written = True

    def _backup_state(self, tx: _Tx) -> None:
        if tx.guarantee != "rollback" or tx.state_backup is not None:
            return
        arena = self._arena(tx.backup_kind)
        arena.begin()
        tx.state_backup = B.StateBackup(self.model, arena)
        tx.stage("backup", tx.state_backup.seconds)
        if tx.backup_kind in ("host", "pinned"):
            tx.extra_host = max(tx.extra_host, tx.state_backup.bytes)
        tx.check(f"backup_{'device' if tx.backup_kind == 'device' else 'host'}")

    def _write_layerwise(self, tx: _Tx, part: _Part, final: bool):
        self._backup_state(tx)
        worker, model = self.worker, self.model
        t1 = _now()
        if not tx.session:
            with layerwise.strict(require_full=not tx.partial) as pol, weights.suppressed(), \
                    workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
                try:
                    worker.reload_weights(weights_iterator=self._iter_part(tx, part, pol))
                finally:
                    if layerwise.reload_active(model):  # the load raised half-way: put every layer back
                        layerwise.abort_open_reload(worker)
            tx.written = tx.written or pol.findings.processed > 0
            tx.stage("write", _now() - t1)
            tx.check("strict_reload")
            return pol.findings
        # a session: one reload spans the parts; vLLM buffers a layer until all its parts arrived
        lw = layerwise.vllm_layerwise()
        if not tx.reload_open:
            tx.policy = layerwise.Policy(require_full=False)
            with workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
                lw.initialize_layerwise_reload(model)
            tx.reload_open = True
        with layerwise.using(tx.policy), weights.suppressed(), workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
            try:
                model.load_weights(self._iter_part(tx, part, tx.policy))
            except BaseException:
                tx.reload_open = False
                layerwise.abort_open_reload(worker)
                raise
        tx.written = tx.written or tx.policy.findings.processed > 0
        tx.stage("write", _now() - t1)
        tx.check("strict_reload")
        return tx.policy.findings

    def _finish_layerwise(self, tx: _Tx):
        worker, model = self.worker, self.model
        tx.reload_open = False
        t1 = _now()
        with layerwise.using(tx.policy), weights.suppressed(), workerctx.vllm_config_ctx(worker), workerctx.lora_unwrapped(model):
            layerwise.vllm_layerwise().finalize_layerwise_processing(model, worker.model_config)
        tx.stage("write", _now() - t1)
        return tx.policy.findings

    def _check_after_direct(self, tx: _Tx) -> None:
        """``direct``: the bytes were written unchecked; check them now (a failure leaves ``mixed``)."""
        t1 = _now()
        probs = []
        for part in tx.parts:
            if part.tensors is None:
                continue  # streamed: checked bucket by bucket on arrival is not possible; the sender counted
            if not part.expected:
                probs += self._check_sources(tx, part)
        tx.stage("check_after", _now() - t1)
        if probs:
            raise P.RefitError(P.summarize(probs), kind="validation", problems=probs)

    # --------------------------------------------------------------- the copy plan
    def _capture_plan(self, tx: _Tx, part: _Part | None) -> None:
        """Record and verify the copy plan after a complete layerwise update (GPU, unquantized, no LoRA)."""
        w = self.worker
        if getattr(w.model_config, "quantization", None) is not None:
            self.plan, self.plan_note = False, "not used: quantized model (post-processing changes the weights)"
            return
        if any(type(m).__name__.endswith("WithLoRA") for m in self.model.modules()):
            self.plan, self.plan_note = False, "not used: LoRA engine"
            return
        if part is None or part.tensors is None:
            self.plan_note = "not captured yet (needs a non-streamed update to verify against)"
            return
        aliases = self.schema().aliases
        names = {m.name for m in part.metas if m.name not in aliases}
        metas = [(m.name, m.shape, P.dtype_of(m.dtype)) for m in part.metas if m.name in names]
        try:
            plan = CopyPlan.capture(self.model, metas, skip=set(aliases))
            why = plan.verify({n: part.tensors[n] for n in names})
        except PlanError as e:
            self.plan, self.plan_note = False, f"not usable: {e}"
            logger.info("vllm-rlpatch: refit copy plan not usable for this model: %s", e)
            return
        except Exception as e:  # noqa: BLE001 - the plan is an optimisation: the update itself has landed
            self.plan, self.plan_note = None, f"capture failed ({type(e).__name__}: {e}); retried on the next update"
            logger.warning("vllm-rlpatch: recording the refit copy plan failed (%s: %s); updates keep vLLM's "
                           "layerwise reload until a capture succeeds", type(e).__name__, e)
            return
        if why is not None:
            self.plan, self.plan_note = False, f"not usable: {why}"
            logger.warning("vllm-rlpatch: refit copy plan failed verification: %s", why)
            return
        self.plan = plan
        self.plan_note = f"verified: {plan.copies} slice copies for {len(plan.names)} tensors"
        tx.check("plan_verified")
        logger.info("vllm-rlpatch: refit copy plan recorded and verified (%d copies, %.2f s); later complete "
                    "updates are slice copies", plan.copies, plan.capture_seconds)

    # --------------------------------------------------------------- failure, abort
    def _failed(self, tx: _Tx, error: BaseException, findings) -> dict[str, Any]:
        kind = error.kind if isinstance(error, P.RefitError) else (
            "fault" if isinstance(error, InjectedFault) else "transport" if "transport" in str(error) else "commit")
        msg = str(error) if isinstance(error, P.RefitError) else f"{type(error).__name__}: {error}"
        if isinstance(error, mixed.MixedWeightsError):
            msg = error.mixed.reason
        probs = error.problems if isinstance(error, P.RefitError) else []
        if tx.reload_open:
            tx.reload_open = False
            layerwise.abort_open_reload(self.worker)
        state, note = self._undo(tx)
        if note:
            msg = f"{msg} ({note})"
        if state == "mixed":
            m = mixed.MixedWeights(msg, tuple(getattr(findings, "half", ()) or ()), "refit")
            mixed.set_worker(m)
            msg = m.message
        logger.error("vllm-rlpatch: refit %s failed (guarantee %s, %s path): %s -> engine state %s", tx.txid,
                     tx.guarantee, tx.path, msg, state)
        out = _fail(kind, state, msg, tx.stages, tx.checks, probs, guarantee=tx.guarantee, path=tx.path,
                    backup=tx.backup_report(), findings=findings.as_dict() if findings else None, rank=self.rank)
        self._drop(tx.txid)
        return out

    def _undo(self, tx: _Tx) -> tuple[str, str]:
        """Put back what was written: (state, note)."""
        if not tx.written:
            return "unchanged", ""
        if tx.windows is not None:
            t1 = _now()
            tx.windows.restore()
            tx.stage("restore", _now() - t1)
            bad = [w for w, s in tx.windows.saved if not _equal(w, s)]
            tx.check("restore_compared")
            if bad:
                return "mixed", f"{len(bad)} window(s) differ from their backup after the restore"
            mixed.clear_worker()
            return "restored", f"old weights restored from a {tx.backup_kind} backup ({tx.windows.bytes} bytes), " \
                               "compared with it"
        if tx.state_backup is not None:
            t1 = _now()
            try:
                tx.state_backup.restore()
            except Exception as e:  # noqa: BLE001
                logger.exception("vllm-rlpatch: restoring the old weights failed")
                return "mixed", f"restoring the old weights failed: {type(e).__name__}: {e}"
            tx.stage("restore", _now() - t1)
            bad = [n for n, saved in tx.state_backup.saved_named()
                   if not _same_storage_bytes(self.model, n, saved)]
            tx.check("restore_compared")
            if bad:
                return "mixed", f"{len(bad)} tensor(s) differ from their backup after the restore: {', '.join(bad[:4])}"
            mixed.clear_worker()
            return "restored", f"old weights restored from a {tx.backup_kind} backup ({tx.state_backup.bytes} " \
                               "bytes), compared with it"
        return "mixed", ""

    def abort(self, txid: str) -> dict[str, Any]:
        """Drop a prepared update, or undo a written one (another rank failed; a session ended by an error)."""
        if txid not in self.aborted:
            self.aborted.append(txid)  # fenced: a late prepare or commit of this update is refused
        tx = self.txs.get(txid)
        if tx is None:
            return {"ok": True, "state": "unchanged", "note": "nothing to abort"}
        if tx.reload_open:
            tx.reload_open = False
            layerwise.abort_open_reload(self.worker)
        if not tx.written:
            self._drop(txid)
            return {"ok": True, "state": "unchanged"}
        state, note = self._undo(tx)
        if state == "mixed":
            m = mixed.MixedWeights(f"the update was aborted after it wrote ({tx.guarantee}, no backup){': ' + note if note else ''}",
                                   (), "refit")
            mixed.set_worker(m)
            note = m.message
        elif tx.committed:
            weights.fire(self.worker, "rlpatch_refit_rollback", "worker")
        self._drop(txid)
        return {"ok": state == "restored", "state": state, "message": note, "guarantee": tx.guarantee,
                **({"mixed": mixed.worker_state().as_dict()} if state == "mixed" and mixed.worker_state() else {})}

    def release(self, txid: str) -> dict[str, Any]:
        self._drop(txid)
        return {"ok": True}

    def _drop(self, txid: str) -> None:
        tx = self.txs.pop(txid, None)
        if tx is None:
            return
        for part in tx.parts + ([tx.pending] if tx.pending is not None else []):
            part.tensors = None
            if getattr(part.source, "pinned", False):
                continue  # an update template's source stays open for the next update
            try:
                part.source.close()
            except Exception:
                pass
        if tx.windows is not None:
            tx.windows.drop()
        tx.windows = tx.state_backup = None
        for kind, a in list(self.arenas.items()):
            # host arenas stay for the next update; device memory goes back to the trainer at once
            held = kind == "device" and bool(a.chunks)
            a.release(keep=kind != "device")
            if kind == "device" and self.device.type == "cuda":
                del self.arenas[kind]
                if held:  # the allocator's cache only holds something when the arena did
                    torch.cuda.empty_cache()

    # --------------------------------------------------------------- layout, fingerprint
    def layout(self) -> dict[str, Any]:
        """The engine layout a zero-pack trainer buffer uses (needs a verified copy plan): where every trainer
        tensor sits, as a strided view, in one buffer of this worker's dtype."""
        plan = self.plan
        if not getattr(plan, "verified", False):
            return {"ok": False, "message": f"no verified copy plan in this worker ({self.plan_note})"}
        by_name: dict[str, list] = {}
        for e in plan.entries:
            by_name.setdefault(e.name, []).append(e)
        params: list[torch.Tensor] = []
        index: dict[int, int] = {}
        views: dict[str, list] = {}
        offset = 0  # in elements of the common dtype
        dtype = None
        starts: dict[int, int] = {}
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
            if key not in index:
                index[key] = len(params)
                params.append(p)
                starts[key] = offset
                offset += (p.numel() + 31) // 32 * 32  # 64-byte aligned for bf16
            dsize, dstride, doff = e.dst_geom
            views[name] = [list(dsize), list(dstride), starts[key] + (doff - p.storage_offset())]
        return {"ok": True, "dtype": P.dtype_name(dtype), "numel": offset, "views": views,
                "params": len(params)}

    def fingerprint(self) -> dict[str, Any]:
        fp, per = weights_fingerprint(self.model)
        return {"fingerprint": fp, "tensors": len(per), "rank": self.rank}


# ------------------------------------------------------------------------------------------ helpers
def tx_state_now(tx: _Tx | None) -> str:
    """What the engine holds while a transaction is open and not failed: unchanged until it writes."""
    return "writing" if tx is not None and tx.written else "unchanged"


def _close(source: Source) -> None:
    """Close a transaction's source, unless it is an update template's (kept open for the next update)."""
    if not source.pinned:
        source.close()


def _is_dist(source: Source) -> bool:
    return type(source).__name__ == "DistSource"


def _reset_peak(dev: torch.device) -> int:
    """Reset the allocator's peak and return what is allocated now. The allocator's counters are read directly
    (``torch.cuda.memory_allocated`` flattens every statistic into a dict first: ~1 ms per update)."""
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        torch._C._cuda_resetPeakMemoryStats(idx)
        return int(torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["current"])
    except Exception:  # noqa: BLE001 - another torch: the public calls
        torch.cuda.reset_peak_memory_stats(dev)
        return torch.cuda.memory_allocated(dev)


def _peak(dev: torch.device) -> int:
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return int(torch._C._cuda_memoryStats(idx)["allocated_bytes"]["all"]["peak"])
    except Exception:  # noqa: BLE001
        return torch.cuda.max_memory_allocated(dev)


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def math_prod(shape) -> int:
    return _numel(shape)


def _fault_injection_allowed() -> bool:
    return bool(envs.FAULT_INJECTION.get())


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


def weights_fingerprint(model) -> tuple[str, dict[str, str]]:
    named = []
    seen = set()
    for n, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if id(t) in seen or t.is_meta:
            continue
        seen.add(id(t))
        named.append((n, t))
    named.sort(key=lambda x: x[0])
    fps = P.fingerprints([t for _, t in named])
    per = dict(zip([n for n, _ in named], fps))
    return P.combine(f"{n}={f}" for n, f in per.items()), per


_REFITS: "weakref.WeakKeyDictionary[Any, WorkerRefit]" = weakref.WeakKeyDictionary()
_REFITS_LOCK = threading.RLock()


def for_worker(worker: Any) -> WorkerRefit:
    """The worker's transaction object (one per worker), which the ``rlpatch_refit_*`` worker methods call."""
    with _REFITS_LOCK:
        r = _REFITS.get(worker)
        if r is None:
            r = _REFITS[worker] = WorkerRefit(worker)
        return r


def make_source(req: dict[str, Any], metas: list[P.TensorMeta], worker: Any, device: torch.device) -> Source:
    tr = req["transport"]
    kind = tr["kind"]
    if kind == "shm":
        return ShmSource(metas, tr)
    if kind == "dist":
        rank = int(tr.get("rank_base", 1)) + int(getattr(worker, "rank", 0) or 0)
        return DistSource(metas, tr, rank, device)
    if kind == "cuda_ipc":
        return IpcSource(metas, tr, device)
    if kind == "cuda_ipc_layout":
        return LayoutSource(metas, tr, device)
    raise P.RefitError(f"unknown transport {kind!r}", kind="validation")
