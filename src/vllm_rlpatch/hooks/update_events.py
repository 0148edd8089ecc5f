"""Weight updates as the engine core sees them: which RPCs write weights, and the :class:`Guard` of each
``EngineCore`` that detects and counts updates on every path.

vLLM's scheduler (and with it the prefix cache and every running request's KV) lives in the engine core
(a process of its own, or process 0 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Its guard

* **detects** weight updates whatever their path: every ``collective_rpc`` a client sends passes
  ``EngineCore.collective_rpc``; afterwards the guard compares the workers' weight version (counted by
  :mod:`vllm_rlpatch.hooks.weights` in each worker, so ``reload_weights``, the native update API and a
  trainer's direct ``model.load_weights`` all count). In-process workers (the uniproc executor) report
  through the weight-event listener (:func:`on_weight_event`) at no cost; other executors are asked with one
  extra ``collective_rpc("rlpatch_weight_version")`` after an RPC the guard cannot classify by name. A
  trainer that loads weights into an in-process worker without any RPC (TRL-style colocation) is seen by
  the listener as well.
* **counts** them: ``guard.version`` is the engine's weight version (0 = the weights it started with).
* **notifies** policies (:func:`add_policy`): the ``prefix_cache`` patch decides what happens to the
  prefix cache and to running requests; it also salts requests (:meth:`Guard.salt_key`).
* **refuses** to generate while the workers hold a mix of old and new weights (:meth:`Guard.poison`).

Outputs are stamped with the version by :mod:`vllm_rlpatch.hooks.output_stamps`; the wrappers that feed the
guard are installed by :mod:`vllm_rlpatch.hooks.engine_core`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from typing import Any, Callable, Iterator, NamedTuple

from vllm_rlpatch import compat
from vllm_rlpatch.hooks import inflight, mixed, weights, workerctx
from vllm_rlpatch.hooks.refit_rpc import REFIT_ABORT, REFIT_COMMIT, REFIT_PREPARE, commit_answers

logger = logging.getLogger("vllm.rlpatch")

# RPCs that never change weights (ours, and vLLM's own read-only ones): no worker-version check after them.
READ_ONLY = frozenset({"rlpatch_ping", "rlpatch_status", "rlpatch_weight_version", mixed.STATE_RPC, "rlpatch_refit_describe",
                        "rlpatch_refit_layout", "rlpatch_refit_inject_fault", "rlpatch_fingerprint", "rlpatch_refit_release", "get_model", "check_health",
                        "get_kv_cache_spec", "determine_available_memory", "get_supported_tasks", "list_loras",
                        "get_cache_block_size_bytes", "is_sleeping", "update_max_model_len",
                        "compute_weight_checksums"})


def update_method_names() -> frozenset[str]:
    """RPC names of a complete weight update (the name-only fallback, and ``refuse``)."""
    if not compat.weight_update_sessions():
        return frozenset({"reload_weights", "update_weights", REFIT_COMMIT})  # 0.20: each update_weights is complete
    return frozenset({"reload_weights", "finish_weight_update", REFIT_COMMIT})  # 0.25+: start/update/finish sessions


def starts_update(method: str) -> bool:
    """Would this RPC start writing weights (used to refuse it before anything is written)?"""
    return method in update_method_names() or method in ("start_weight_update", "update_weights", REFIT_PREPARE)


class VersionSpan(NamedTuple):
    """Output tokens ``[start, end)`` were sampled with weight version ``version``; their KV (prompt and
    earlier tokens included) was computed with ``kv_version``. ``kv_version < version`` means the tokens
    attended to KV of older weights (in-flight ``keep``): the mixing is reported, never hidden."""

    start: int
    end: int
    version: int
    kv_version: int

    @property
    def mixed(self) -> bool:
        return self.kv_version != self.version


@dataclasses.dataclass
class UpdateInfo:
    version: int
    previous: int
    source: str  # what revealed it: an RPC name, "worker event", ...
    running: int  # requests running when it was seen
    waiting: int


@dataclasses.dataclass
class Policy:
    """What a patch does around an update (run in the engine core's main thread, between steps)."""

    name: str
    before_rpc: Callable[["Guard", str], None] | None = None  # may raise to refuse an update
    on_update: Callable[["Guard", UpdateInfo], None] | None = None
    before_schedule: Callable[["Guard"], None] | None = None
    salt_key: Callable[["Guard"], str | None] | None = None  # key that salts new computation, None = no salt
    tags_outputs: bool = False  # stamp every scheduled batch's outputs with its weight version


_LOCK = threading.RLock()
_POLICIES: dict[str, Policy] = {}
_GUARDS: "weakref.WeakKeyDictionary[Any, Guard]" = weakref.WeakKeyDictionary()
_BY_SCHEDULER: "weakref.WeakKeyDictionary[Any, Guard]" = weakref.WeakKeyDictionary()
_BY_WORKER: "weakref.WeakValueDictionary[int, Guard]" = weakref.WeakValueDictionary()


class _Tls(threading.local):
    rpc_guard: "Guard | None" = None


_TLS = _Tls()


def in_rpc() -> bool:
    """Is this thread handling a ``collective_rpc`` of an engine core (whose end settles weight updates)?"""
    return _TLS.rpc_guard is not None


@contextlib.contextmanager
def handling_rpc(g: "Guard") -> Iterator[None]:
    """This thread runs a ``collective_rpc`` of ``g``'s engine core: weight events of its in-process worker are
    settled when the RPC returns (:meth:`Guard.check_workers`), not as they fire."""
    outer = _TLS.rpc_guard
    _TLS.rpc_guard = g
    try:
        yield
    finally:
        _TLS.rpc_guard = outer


class Guard:
    """Per-``EngineCore`` state. Touched from the engine core's main thread, except :meth:`salt_key` (read
    from vLLM's input thread too)."""

    def __init__(self, core: Any) -> None:
        self.core_ref = weakref.ref(core)
        self.scheduler = None  # set by guard_for() once the engine core has one
        self.version = 0
        self.worker_version = 0
        self.kv_version: dict[str, int] = {}  # request id -> version its KV is computed with
        self.last_tag: dict[str, tuple[int, int]] = {}  # request id -> the stamp it was last sent (output_stamps)
        self.pending_aborts: list[Any] = []  # in-process engine core: finish outputs to deliver
        self.state: dict[str, Any] = {}  # for policies
        self.updates = 0
        self.outputs_seen = 0  # batches stamped (output_stamps prunes its records every 2048)
        self.in_process_worker = self._local_worker(core)
        self.can_query = True
        self.rpc: tuple[str, tuple, dict] | None = None  # the collective_rpc being handled
        self.inflight_override: str | None = None  # per-update in-flight policy (the refit API's `inflight`)
        self.last_update: dict[str, Any] = {}  # what the policies did at the latest update
        self.poisoned: mixed.MixedWeights | None = None  # refuse to generate until a good update lands
        self.session: str | None = None  # txid of a multi-call update in progress: no generation meanwhile
        self.partial: list[str] = []  # fused layers whose parts are still arriving: no generation meanwhile
        if self.in_process_worker is not None:
            _BY_WORKER[id(self.in_process_worker)] = self
            # Workers in other processes start at 0 and change only through an RPC that passes this
            # guard; an in-process worker may have been loaded into before the guard existed.
            self.version = self.worker_version = weights.weight_version(self.in_process_worker)

    @staticmethod
    def _local_worker(core: Any) -> Any:
        ex = getattr(core, "model_executor", None)
        wrapper = getattr(ex, "driver_worker", None)
        try:
            from vllm.v1.executor.uniproc_executor import UniProcExecutor
        except ImportError:
            return None
        if isinstance(ex, UniProcExecutor) and wrapper is not None:
            return getattr(wrapper, "worker", None)
        return None

    @property
    def core(self) -> Any:
        return self.core_ref()

    # ------------------------------------------------------------------ salting
    def salt_key(self) -> str | None:
        for p in policies():
            if p.salt_key is not None:
                key = p.salt_key(self)
                if key is not None:
                    return key
        return None

    def salt(self, request: Any, *, rehash: bool) -> None:
        """Salt ``request`` (a scheduler ``Request``) for computation starting now; rehash its blocks."""
        key = self.salt_key()
        if getattr(request, "_rlpatch_salt_key", None) == key:
            return
        user = getattr(request, "_rlpatch_user_salt", _MISSING)
        if user is _MISSING:
            user = getattr(request, "cache_salt", None)
            _set(request, "_rlpatch_user_salt", user)
        request.cache_salt = combine_salt(user, key)
        _set(request, "_rlpatch_salt_key", key)
        if rehash and hasattr(request, "update_block_hashes"):
            del request.block_hashes[:]
            request.update_block_hashes()

    # ------------------------------------------------------------------ update
    def running(self) -> list[Any]:
        return list(getattr(self.scheduler, "running", []) or [])

    def waiting(self) -> list[Any]:
        out = []
        for name in ("waiting", "skipped_waiting"):
            q = getattr(self.scheduler, name, None)
            if q is not None:
                out.extend(q)
        return out

    def idle(self) -> bool:
        """No request scheduled: an update's last RPC may rest the RPC readers (:mod:`.workerctx`). Never while
        requests run: resting them mid-generation (an update with ``inflight="keep"``, vLLM 0.20.2) left an
        ``execute_model`` reply unread until its 300 s timeout, a missed wake-up whose cause inside vLLM was not
        pinned down. While idle the readers sleep as vLLM's own do after a second without a read."""
        return self.scheduler is not None and not self.running() and not self.waiting()

    def updated(self, source: str, new_worker_version: int | None = None) -> UpdateInfo:
        prev = self.version
        self.version += 1
        self.updates += 1
        if new_worker_version is not None:
            self.worker_version = max(self.worker_version, new_worker_version)
            self.version = max(self.version, self.worker_version)  # one RPC may hold several updates
        info = UpdateInfo(self.version, prev, source, len(self.running()), len(self.waiting()))
        self.last_update = {"version": self.version, "aborted": [], "recomputed": 0, "source": source}
        if self.poisoned is not None:
            logger.info("vllm-rlpatch: a complete weight update landed; the engine generates again")
            self.poisoned = None
        logger.info("vllm-rlpatch: engine core: weights changed (%s) -> weight version %d (%d running, %d waiting)",
                    source, self.version, info.running, info.waiting)
        if inflight.active():
            try:
                self.last_update["inflight_done"] = inflight.after_update(self, source, info.running, prev)
            except Exception:
                logger.exception("vllm-rlpatch: the in-flight policy failed after weight update #%d", info.version)
        for p in policies():
            if p.on_update is not None:
                try:
                    p.on_update(self, info)
                except Exception:
                    logger.exception("vllm-rlpatch: policy %s failed after weight update #%d", p.name, info.version)
        # Requests that have not computed anything yet will compute with the new weights.
        for req in self.waiting():
            if getattr(req, "num_computed_tokens", 1) == 0:
                self.kv_version[req.request_id] = self.version
        return info

    def poison(self, m: mixed.MixedWeights) -> None:
        """The workers hold a mix of old and new weights: abort what runs, refuse new requests."""
        first = self.poisoned is None
        self.poisoned = m
        if first:
            logger.error("vllm-rlpatch: engine core refuses to generate until a complete weight update lands: %s",
                         m.message)
        if self.scheduler is not None:
            self.abort_running("the weights are a mix of old and new after a failed update")

    def hold_partial(self, layers: list[str]) -> None:
        """Layers whose parts arrive one RPC at a time (a trainer sending q, k and v of a fused layer in three
        RPCs) wait, unprocessed, for the rest: the model cannot run meanwhile. What runs is aborted and new
        requests are refused until they are complete (then the update counts once more)."""
        was, self.partial = self.partial, sorted(set(layers))
        if self.partial and not was:
            logger.info("vllm-rlpatch: engine core: %d layer(s) received part of their weights (%s); generation "
                        "waits for the rest", len(self.partial), ", ".join(self.partial[:4]))
        if self.partial and self.scheduler is not None:
            self.abort_running(f"refused: a weight update is arriving in parts ({', '.join(self.partial[:4])})")

    def check_workers(self, method: str, result: Any = None) -> mixed.MixedWeights | None:
        """After an RPC: did the workers' weight version move, and do they hold mixed weights? (asked as data:
        the in-process worker directly; a refit commit every rank answered ``ok`` from its answers, ``result``;
        others with one ``rlpatch_weight_state`` RPC)."""
        if self.in_process_worker is not None:
            partial: list[str] = []
            try:
                partial = weights.settle(self.in_process_worker, raise_mixed=False, keep_partial=True)
            except Exception:
                logger.debug("vllm-rlpatch: settling the worker after %r failed", method, exc_info=True)
            v = weights.weight_version(self.in_process_worker)
            if v > self.worker_version:
                self.updated(f"collective_rpc:{method}", v)
            self.hold_partial(partial)
            return mixed.worker_state()
        if not self.can_query:
            if method in update_method_names():
                self.updated(f"collective_rpc:{method}")
            return None
        core = self.core
        said = commit_answers(method, result)
        if said is not None:
            # every rank committed (or wrote a session's part) and said its version: no RPC (one round trip less
            # per update, and no wake of every worker's reader after it)
            version, final = said
            self.hold_partial([])  # the refit's prepare closed any direct-load session left open
            if version > self.worker_version:
                self.updated(f"collective_rpc:{method}", version)
            if final and self.idle():  # the readers rest (the workers': in their commit, or the release after it)
                workerctx.rest_response_readers(core.model_executor)
            return None
        try:
            # after an update's last RPC the workers' RPC readers rest instead of spinning (workerctx)
            rest = (method in update_method_names() or method == REFIT_ABORT) and self.idle()
            states = core.model_executor.collective_rpc(mixed.STATE_RPC, kwargs={"rest": True} if rest else None)
            if rest:
                workerctx.rest_response_readers(core.model_executor)
        except Exception as e:  # no rlpatch worker extension in this engine
            self.can_query = False
            logger.warning("vllm-rlpatch: cannot read the workers' weight version (%s: %s); weight updates are "
                           "then recognised by RPC name only (reload_weights, update_weights, "
                           "finish_weight_update)", type(e).__name__, e)
            return None
        v = max((int(x["version"]) for x in states if isinstance(x, dict)), default=0)
        if v > self.worker_version:
            self.updated(f"collective_rpc:{method}", v)
        self.hold_partial([n for x in states if isinstance(x, dict) for n in x.get("partial") or ()])
        return mixed.from_results(states)


    # ------------------------------------------------------------------ abort
    def abort_running(self, reason: str) -> list[str]:
        ids = [r.request_id for r in self.running()]
        if not ids:
            return []
        self.abort_ids(ids, reason)
        return ids

    def abort_ids(self, ids: list[str], reason: str) -> None:
        from vllm.v1.request import RequestStatus

        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        core = self.core
        send = getattr(core, "_send_abort_outputs", None)
        if callable(send) and getattr(core, "output_queue", None) is not None:
            send(aborted)
        else:  # in-process engine core: hand the finish outputs to the next step's result
            for item in aborted or ():
                rid, client = (item.request_id, item.client_index) if hasattr(item, "request_id") else item
                self.pending_aborts.append((client, rid))
        for rid in ids:
            self.kv_version.pop(rid, None)
            self.last_tag.pop(rid, None)
        logger.info("vllm-rlpatch: aborted %d request(s): %s", len(ids), reason)


_MISSING = object()


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def record_salt(request: Any, user: str | None, key: str | None) -> None:
    """Remember on ``request`` the user's own salt and the key it was salted with (:meth:`Guard.salt`)."""
    _set(request, "_rlpatch_user_salt", user)
    _set(request, "_rlpatch_salt_key", key)


def combine_salt(user: str | None, key: str | None) -> str | None:
    """The salt a request gets: the user's own salt (kept) plus the plugin's key, or either alone."""
    if key is None:
        return user
    return f"{user}\x1f{key}" if user else key


def add_policy(p: Policy) -> None:
    with _LOCK:
        _POLICIES[p.name] = p


def remove_policy(name: str) -> None:
    with _LOCK:
        _POLICIES.pop(name, None)


def policies() -> list[Policy]:
    with _LOCK:
        return list(_POLICIES.values())


def guard_for(core: Any, create: bool = True) -> Guard | None:
    g = _GUARDS.get(core)
    if g is None and create:
        with _LOCK:
            g = _GUARDS.get(core)
            if g is None:
                g = Guard(core)
                _GUARDS[core] = g
    if g is not None and g.scheduler is None:  # created during EngineCore.__init__, before the scheduler
        sched = getattr(core, "scheduler", None)
        if sched is not None:
            with _LOCK:
                g.scheduler = sched
                _BY_SCHEDULER[sched] = g
    return g


def guard_of_core(core: Any) -> Guard | None:
    """The guard of ``core`` if it has one (none is created)."""
    return _GUARDS.get(core)


def guard_of_scheduler(scheduler: Any) -> Guard | None:
    return _BY_SCHEDULER.get(scheduler)


def on_weight_event(ev, engine) -> None:
    """A worker in *this* process changed its weights."""
    if ev.side != "worker":
        return
    g = _BY_WORKER.get(id(engine))
    if g is None:
        return
    if _TLS.rpc_guard is g:
        return  # inside an RPC of this engine: check_workers() picks it up when the RPC returns
    g.updated(f"in-process worker: {ev.source}", ev.version)
