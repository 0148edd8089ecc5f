"""The engine-core side of a weight update: detect it on every path, count it, stamp outputs with it.

vLLM's scheduler (and with it the prefix cache and every running request's KV) lives in the engine core
(a process of its own, or process 0 with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). This hook gives each
``EngineCore`` a :class:`Guard` that

* **detects** weight updates whatever their path: every ``collective_rpc`` a client sends passes
  ``EngineCore.collective_rpc``; afterwards the guard compares the workers' weight version (counted by
  :mod:`vllm_rlpatch.hooks.weights` in each worker, so ``reload_weights``, the native update API and a
  trainer's direct ``model.load_weights`` all count). In-process workers (the uniproc executor) report
  through the weight-event listener at no cost; other executors are asked with one extra
  ``collective_rpc("rlpatch_weight_version")`` after an RPC the guard cannot classify by name. A
  trainer that loads weights into an in-process worker without any RPC (TRL-style colocation) is seen by
  the listener as well.
* **counts** them: ``guard.version`` is the engine's weight version (0 = the weights it started with).
* **stamps** outputs: the version current when a batch was *scheduled* (so async scheduling's batch in
  flight is attributed to the weights it ran with) and the version the request's KV was computed
  under travel to the front end inside ``EngineCoreOutput.kv_transfer_params`` (key
  :data:`TAG_KEY`, only when they change for a request), where :func:`_process_outputs_wrapper` pops
  them before vLLM sees them and every ``CompletionOutput`` gets ``rlpatch_weight_versions``: a list of
  :class:`VersionSpan` over its output-token indexes.
* **notifies** policies (:func:`add_policy`): the ``prefix_cache`` patch decides what happens to the
  prefix cache and to running requests; it also salts requests (:meth:`Guard.salt_key`).
* **carries** per-request data from the workers to the user (:func:`add_channel`): a channel reads what a
  worker attached to its ``ModelRunnerOutput`` in the engine core, puts it into the request's
  ``EngineCoreOutput`` (``kv_transfer_params`` key :data:`PAYLOAD_KEY`, popped in the front end before vLLM
  sees it) and sets it on the ``CompletionOutput`` (the ``sampling_support`` patch's per-token support).

One owner wraps these targets (no patch wraps them itself); patches say they need the hook with
:func:`require` / :func:`release`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

from vllm_rlpatch import _wrapping, compat
from vllm_rlpatch.hooks import inflight, mixed, weights, workerctx

logger = logging.getLogger("vllm.rlpatch")

OWNER = "engine_core_hook"
CORE = "vllm.v1.engine.core"
SCHED = "vllm.v1.core.sched.scheduler"
OUTPUTS = "vllm.v1.engine.output_processor"
TAG_KEY = "__vllm_rlpatch__"
PAYLOAD_KEY = "__vllm_rlpatch_payload__"

CORE_TARGETS = (
    f"{CORE}:EngineCore.collective_rpc",
    f"{CORE}:EngineCore.preprocess_add_request",
    f"{CORE}:EngineCore.add_request",
    f"{CORE}:EngineCore.step",
    f"{CORE}:EngineCore.step_with_batch_queue",
)
SCHED_TARGETS = (
    f"{SCHED}:Scheduler.schedule",
    f"{SCHED}:Scheduler.update_from_output",
    f"{SCHED}:Scheduler._preempt_request",
)
FRONTEND_TARGETS = (
    f"{OUTPUTS}:OutputProcessor.process_outputs",
    f"{OUTPUTS}:RequestState._new_completion_output",
)
TARGETS = CORE_TARGETS + SCHED_TARGETS + FRONTEND_TARGETS

# RPCs that never change weights (ours, and vLLM's own read-only ones): no worker-version check after them.
_READ_ONLY = frozenset({"rlpatch_ping", "rlpatch_status", "rlpatch_weight_version", mixed.STATE_RPC, "rlpatch_refit_describe",
                        "rlpatch_refit_layout", "rlpatch_refit_inject_fault", "rlpatch_fingerprint", "rlpatch_refit_release", "get_model", "check_health",
                        "get_kv_cache_spec", "determine_available_memory", "get_supported_tasks", "list_loras",
                        "get_cache_block_size_bytes", "is_sleeping", "update_max_model_len",
                        "compute_weight_checksums"})


# The refit API's worker RPCs (vllm_rlpatch.refit): prepare receives and checks, commit writes.
REFIT_PREPARE = "rlpatch_refit_prepare"
REFIT_COMMIT = "rlpatch_refit_commit"
REFIT_ABORT = "rlpatch_refit_abort"
REFIT_RELEASE = "rlpatch_refit_release"
REFIT_RPCS = frozenset({REFIT_PREPARE, REFIT_COMMIT, REFIT_ABORT})


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


@dataclasses.dataclass
class Channel:
    """Per-request data from the workers to the ``CompletionOutput`` (each callback runs in its process).

    engine_core:  ``(scheduler, model_runner_output, outputs)`` after ``Scheduler.update_from_output``;
                  calls :func:`put_payload` for the requests it has data for.
    frontend:     ``(request_state, payload, n_before)`` in the front end, for each payload of this channel
                  (``n_before``: the request's output tokens before this output's new ones).
    completion:   ``(request_state, completion_output)`` when vLLM builds a ``CompletionOutput``.
    """

    name: str
    engine_core: Callable[[Any, Any, dict], None] | None = None
    frontend: Callable[[Any, Any, int], None] | None = None
    completion: Callable[[Any, Any], None] | None = None


_LOCK = threading.RLock()
_USERS: set[str] = set()
_POLICIES: dict[str, Policy] = {}
_CHANNELS: dict[str, Channel] = {}
_GUARDS: "weakref.WeakKeyDictionary[Any, Guard]" = weakref.WeakKeyDictionary()
_BY_SCHEDULER: "weakref.WeakKeyDictionary[Any, Guard]" = weakref.WeakKeyDictionary()
_BY_WORKER: "weakref.WeakValueDictionary[int, Guard]" = weakref.WeakValueDictionary()
_active = False
_unsubscribe: Callable[[], None] | None = None


class _Tls(threading.local):
    rpc_guard: "Guard | None" = None
    local_event: bool = False


_TLS = _Tls()


def in_rpc() -> bool:
    """Is this thread handling a ``collective_rpc`` of an engine core (whose end settles weight updates)?"""
    return _TLS.rpc_guard is not None


class Guard:
    """Per-``EngineCore`` state. Touched from the engine core's main thread, except :meth:`salt_key` (read
    from vLLM's input thread too)."""

    def __init__(self, core: Any) -> None:
        self.core_ref = weakref.ref(core)
        self.scheduler = None  # set by guard_for() once the engine core has one
        self.version = 0
        self.worker_version = 0
        self.kv_version: dict[str, int] = {}  # request id -> version its KV is computed with
        self._last_tag: dict[str, tuple[int, int]] = {}
        self.pending_aborts: list[Any] = []  # in-process engine core: finish outputs to deliver
        self.state: dict[str, Any] = {}  # for policies
        self.updates = 0
        self._outputs_seen = 0
        self.in_process_worker = self._local_worker(core)
        self.can_query = True
        self.rpc: tuple[str, tuple, dict] | None = None  # the collective_rpc being handled
        self.inflight_override: str | None = None  # per-update in-flight policy (the refit API's `inflight`)
        self.last_update: dict[str, Any] = {}  # what the policies did at the latest update
        self.poisoned: mixed.MixedWeights | None = None  # refuse to generate until a good update lands
        self.session: str | None = None  # txid of a multi-call update in progress: no generation meanwhile
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
        for p in _policies():
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
        for p in _policies():
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

    def check_workers(self, method: str, result: Any = None) -> mixed.MixedWeights | None:
        """After an RPC: did the workers' weight version move, and do they hold mixed weights? (asked as data:
        the in-process worker directly; a refit commit every rank answered ``ok`` from its answers, ``result``;
        others with one ``rlpatch_weight_state`` RPC)."""
        if self.in_process_worker is not None:
            try:
                weights.settle(self.in_process_worker, raise_mixed=False)
            except Exception:
                logger.debug("vllm-rlpatch: settling the worker after %r failed", method, exc_info=True)
            v = weights.weight_version(self.in_process_worker)
            if v > self.worker_version:
                self.updated(f"collective_rpc:{method}", v)
            return mixed.worker_state()
        if not self.can_query:
            if method in update_method_names():
                self.updated(f"collective_rpc:{method}")
            return None
        core = self.core
        said = _commit_answers(method, result)
        if said is not None:
            # every rank committed (or wrote a session's part) and said its version: no RPC (one round trip less
            # per update, and no wake of every worker's reader after it)
            version, final = said
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
        return mixed.from_results(states)

    # ------------------------------------------------------------------ outputs
    def tag_outputs(self, version: int, outputs: dict[int, Any]) -> None:
        last = self._last_tag
        kv = self.kv_version
        for eco in outputs.values():
            for o in getattr(eco, "outputs", ()) or ():
                rid = o.request_id
                if o.new_token_ids:
                    tag = (version, kv.get(rid, version))
                    if last.get(rid) != tag:
                        last[rid] = tag
                        params = o.kv_transfer_params
                        if params is None:
                            o.kv_transfer_params = {TAG_KEY: tag}
                        else:
                            params[TAG_KEY] = tag
                if o.finish_reason is not None:
                    last.pop(rid, None)
                    kv.pop(rid, None)
        self._outputs_seen += 1
        if self._outputs_seen % 2048 == 0:  # requests aborted by clients produce no final output
            live = getattr(self.scheduler, "requests", None)
            if isinstance(live, dict):
                for d in (last, kv):
                    for rid in [r for r in d if r not in live]:
                        d.pop(rid, None)

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
            self._last_tag.pop(rid, None)
        logger.info("vllm-rlpatch: aborted %d request(s): %s", len(ids), reason)


_MISSING = object()


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def combine_salt(user: str | None, key: str | None) -> str | None:
    """The salt a request gets: the user's own salt (kept) plus the plugin's key, or either alone."""
    if key is None:
        return user
    return f"{user}\x1f{key}" if user else key


def _policies() -> list[Policy]:
    with _LOCK:
        return list(_POLICIES.values())


def _channels() -> list[Channel]:
    with _LOCK:
        return list(_CHANNELS.values())


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


# ---------------------------------------------------------------------------------------------- wrappers
def _commit_answers(method: str, result: Any) -> tuple[int, bool] | None:
    """(version, final) when ``result`` is a refit commit every rank answered ``ok``: ``committed`` with its
    version (final), or a session's part ``writing`` (the version unchanged: 0). None: ask the workers."""
    if method != REFIT_COMMIT or not isinstance(result, list) or not result:
        return None
    if not all(isinstance(r, dict) and r.get("ok") for r in result):
        return None
    states = {r.get("state") for r in result}
    if states == {"writing"}:
        return 0, False
    versions = [r.get("version") for r in result]
    if states == {"committed"} and all(isinstance(v, int) for v in versions):
        return max(versions), True
    return None


PACKED = "rlpatch_packed"


def _insecure_serialization() -> bool:
    try:
        return bool(int(os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")))
    except ValueError:
        return False


def pack_answers(result: list) -> list:
    """The workers' answers to an update RPC, each as one pickled blob, when vLLM's insecure serialization is
    on: vLLM then tags every leaf of a utility result with its type and the client converts each one (an
    answer has ~60 leaves: ~0.4 ms per update on an H100 host, measured by benchmarks/gpu/refit_full_gpu.py's
    probes). Without it vLLM sends plain msgpack, which is fast, and nothing is packed. Read back with
    :func:`unpack_answers` (the refit API does, wherever it calls these RPCs)."""
    if not _insecure_serialization():
        return result
    return [{PACKED: pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)} for r in result]


def unpack_answers(result: Any) -> Any:
    """:func:`pack_answers` undone (anything else is returned as it is). A packed answer that is not bytes-like
    raises: passed on, it would read as a failed update while the engine committed it."""
    if not isinstance(result, list):
        return result
    out = []
    for r in result:
        if isinstance(r, dict) and len(r) == 1 and PACKED in r:
            blob = r[PACKED]
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise TypeError(f"vllm-rlpatch: a packed refit answer arrived as {type(blob).__name__}, not bytes")
            r = pickle.loads(blob)
        out.append(r)
    return out


def _rpc_name(args, kwargs) -> str:
    method = args[0] if args else kwargs.get("method")
    return method if isinstance(method, str) else getattr(method, "__name__", "<callable>")


def _rpc_parts(args, kwargs) -> tuple[str, tuple, dict]:
    """(method, args, kwargs) of ``EngineCore.collective_rpc(method, timeout=None, args=(), kwargs=None)``."""
    method = _rpc_name(args, kwargs)
    rargs = args[2] if len(args) > 2 else kwargs.get("args", ())
    rkw = args[3] if len(args) > 3 else kwargs.get("kwargs")
    return method, tuple(rargs or ()), dict(rkw or {})


def _with_rpc_kwargs(args: tuple, kwargs: dict, extra: dict) -> tuple[tuple, dict]:
    """``EngineCore.collective_rpc``'s arguments with ``extra`` added to the RPC's own kwargs."""
    if len(args) > 3:
        return args[:3] + ({**(args[3] or {}), **extra},) + args[4:], kwargs
    return args, {**kwargs, "kwargs": {**(kwargs.get("kwargs") or {}), **extra}}


def _collective_rpc_wrapper(wrapped, instance, args, kwargs):
    t_enter = time.perf_counter()
    method, rargs, rkw = _rpc_parts(args, kwargs)
    if method in (REFIT_COMMIT, REFIT_RELEASE):
        # the update's last RPC rests the workers' RPC readers, only while no request is scheduled (Guard.idle)
        args, kwargs = _with_rpc_kwargs(args, kwargs, {"rest": guard_for(instance).idle()})
    if method in _READ_ONLY:
        return wrapped(*args, **kwargs)
    g = guard_for(instance)
    g.rpc = (method, rargs, rkw)
    g.inflight_override = rkw.get("inflight") if method in REFIT_RPCS else None
    try:
        _session_gate(g, method, rargs, rkw)
        if inflight.active() and starts_update(method):
            inflight.before_update(g, method)
        for p in _policies():
            if p.before_rpc is not None:
                p.before_rpc(g, method)
        outer = _TLS.rpc_guard
        _TLS.rpc_guard = g
        _TLS.local_event = False
        t_call = time.perf_counter()
        try:
            result = wrapped(*args, **kwargs)
        except Exception:
            # what did the failed RPC leave? (asked as data, not read out of the exception's text)
            try:
                left = g.check_workers(method)
            except Exception:
                left = None
                logger.debug("vllm-rlpatch: weight-state check after a failed %r failed", method, exc_info=True)
            if left is not None:
                g.poison(left)
            raise
        finally:
            _TLS.rpc_guard = outer
        t_return = time.perf_counter()
        mixed_after = None
        if method != REFIT_PREPARE:  # prepare writes nothing
            try:
                mixed_after = g.check_workers(method, result)
            except Exception:
                logger.exception("vllm-rlpatch: weight-version check after collective_rpc(%r) failed", method)
            if mixed_after is not None:
                g.poison(mixed_after)
        if mixed_after is not None and method not in REFIT_RPCS:
            # the RPC returned, but the weights it left are a mix (e.g. a framework method swallowed the
            # reload's error): tell its caller instead of returning as if all went well
            raise mixed.MixedWeightsError(mixed_after)
        if method in REFIT_RPCS and isinstance(result, list):
            m = mixed.from_results(result)
            if m is not None:
                g.poison(m)
            _session_after(g, method, rargs, rkw, result)
            if method == REFIT_COMMIT:
                # this process's monotonic clock (perf_counter) around the workers' call: the front end on the
                # same host splits its round trip with it (coordinator.rpc_split)
                info = {**g.last_update, "engine_version": g.version,
                        "clock": {"enter": t_enter, "call": t_call, "return": t_return, "exit": time.perf_counter()}}
                for r in result:
                    if isinstance(r, dict):
                        r["engine_core"] = info
            return pack_answers(result)
        return result
    finally:
        g.rpc = None
        g.inflight_override = None


def _session_gate(g: Guard, method: str, rargs: tuple, rkw: dict) -> None:
    """A multi-call update (refit session) writes in several RPCs: no request may compute in between. Its
    first part needs an idle engine (running requests are aborted with ``inflight="abort"``, else the part is
    refused); new requests are refused until the session commits or aborts."""
    if method != REFIT_PREPARE or not rargs or not isinstance(rargs[0], dict) or not rargs[0].get("session"):
        return
    txid = rargs[0].get("txid")
    if g.session == txid:
        return
    running = g.running()
    if running:
        if g.inflight_override == "abort":
            g.abort_running("a multi-call weight update started (inflight=abort)")
        else:
            raise RuntimeError(f"vllm-rlpatch: multi-call weight update refused: {len(running)} request(s) are running; "
                               "a session changes the weights over several calls, so it needs an idle engine (wait "
                               "for them, or pass inflight='abort' to finish them)")
    g.session = txid


def _session_after(g: Guard, method: str, rargs: tuple, rkw: dict, result: list) -> None:
    if g.session is None or not rargs or rargs[0] != g.session:
        return
    done = (method == REFIT_ABORT) or (method == REFIT_COMMIT and rkw.get("final", True))
    failed = any(isinstance(r, dict) and not r.get("ok") for r in result)
    if done or (method == REFIT_COMMIT and failed):
        g.session = None


def _preprocess_wrapper(wrapped, instance, args, kwargs):
    """Salt the EngineCoreRequest before vLLM hashes its prompt blocks (runs in vLLM's input thread)."""
    g = guard_for(instance)
    request = args[0] if args else kwargs.get("request")
    user = getattr(request, "cache_salt", None)
    key = g.salt_key()
    if key is not None and request is not None:
        request.cache_salt = combine_salt(user, key)
    result = wrapped(*args, **kwargs)
    req = result[0] if isinstance(result, tuple) else result
    if req is not None and hasattr(req, "request_id"):
        _set(req, "_rlpatch_user_salt", user)
        _set(req, "_rlpatch_salt_key", key)
    return result


def _add_request_wrapper(wrapped, instance, args, kwargs):
    g = guard_for(instance)
    req = args[0] if args else kwargs.get("request")
    if req is not None and hasattr(req, "request_id"):
        if hasattr(req, "block_hashes"):
            # The input thread salted it with the key current then; an update may have landed since.
            if getattr(req, "_rlpatch_salt_key", None) != g.salt_key():
                g.salt(req, rehash=True)
        g.kv_version[req.request_id] = g.version
    result = wrapped(*args, **kwargs)
    if req is not None and hasattr(req, "request_id"):
        if g.poisoned is not None:
            g.abort_ids([req.request_id], f"refused: {g.poisoned.message}")
        elif g.session is not None:
            g.abort_ids([req.request_id], "refused: a multi-call weight update is in progress")
    return result


def _inject_pending_aborts(g: Guard, outputs: Any) -> Any:
    if not g.pending_aborts:
        return outputs
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    pending, g.pending_aborts = g.pending_aborts, []
    outputs = dict(outputs or {})
    for client, rid in pending:
        eco = outputs.get(client)
        if eco is None:
            eco = outputs[client] = EngineCoreOutputs()
        eco.outputs = [*(eco.outputs or []), EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT)]
        eco.finished_requests = {*(eco.finished_requests or ()), rid}
    return outputs


def _step_wrapper(wrapped, instance, args, kwargs):
    outputs, executed = wrapped(*args, **kwargs)
    g = _GUARDS.get(instance)
    if g is not None and g.pending_aborts:
        outputs = _inject_pending_aborts(g, outputs)
    return outputs, executed


def _schedule_wrapper(wrapped, instance, args, kwargs):
    g = _BY_SCHEDULER.get(instance)
    if g is not None:
        for p in _policies():
            if p.before_schedule is not None:
                p.before_schedule(g)
    out = wrapped(*args, **kwargs)
    if g is not None:
        try:
            out._rlpatch_version = g.version  # the weights this batch runs with
        except AttributeError:
            pass
    return out


def _update_from_output_wrapper(wrapped, instance, args, kwargs):
    outputs = wrapped(*args, **kwargs)
    g = _BY_SCHEDULER.get(instance)
    if g is not None and outputs and any(p.tags_outputs for p in _policies()):
        so = args[0] if args else kwargs.get("scheduler_output")
        g.tag_outputs(getattr(so, "_rlpatch_version", g.version), outputs)
    if outputs and _CHANNELS:
        mro = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
        for ch in _channels():
            if ch.engine_core is not None:
                try:
                    ch.engine_core(instance, mro, outputs)
                except Exception:
                    logger.exception("vllm-rlpatch: output channel %s failed in the engine core", ch.name)
    return outputs


def put_payload(output: Any, channel: str, payload: Any) -> None:
    """Attach ``payload`` (msgpack-able) for ``channel`` to one ``EngineCoreOutput``."""
    params = output.kv_transfer_params
    if params is None:
        output.kv_transfer_params = params = {}
    params.setdefault(PAYLOAD_KEY, {})[channel] = payload


def _preempt_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    g = _BY_SCHEDULER.get(instance)
    req = args[0] if args else kwargs.get("request")
    if g is not None and req is not None and getattr(req, "num_computed_tokens", 1) == 0:
        # It will be recomputed from scratch: with the weights of now, under the salt of now.
        if getattr(req, "_rlpatch_salt_key", None) != g.salt_key():
            g.salt(req, rehash=True)
        g.kv_version[req.request_id] = g.version
    return result


# ---------------------------------------------------------------------------------------------- front end
def _process_outputs_wrapper(wrapped, instance, args, kwargs):
    ecos = args[0] if args else kwargs.get("engine_core_outputs")
    if ecos:
        states = instance.request_states
        for eco in ecos:
            params = eco.kv_transfer_params
            if not params or (TAG_KEY not in params and PAYLOAD_KEY not in params):
                continue
            tag = params.pop(TAG_KEY, None)
            payloads = params.pop(PAYLOAD_KEY, None)
            if not params:
                eco.kv_transfer_params = None
            st = states.get(eco.request_id)
            if st is None:
                continue
            det = getattr(st, "detokenizer", None)
            n = det.num_output_tokens() if det is not None else 0
            if tag is not None:
                starts = st.__dict__.setdefault("_rlpatch_starts", [])
                starts.append((n, int(tag[0]), int(tag[1])))
            for name, payload in (payloads or {}).items():
                ch = _CHANNELS.get(name)
                if ch is not None and ch.frontend is not None:
                    try:
                        ch.frontend(st, payload, n)
                    except Exception:
                        logger.exception("vllm-rlpatch: output channel %s failed in the front end", name)
    return wrapped(*args, **kwargs)


def spans_of(starts: list[tuple[int, int, int]], end: int) -> list[VersionSpan]:
    out: list[VersionSpan] = []
    for i, (s, v, kv) in enumerate(starts):
        e = starts[i + 1][0] if i + 1 < len(starts) else end
        if out and out[-1].end == s and (out[-1].version, out[-1].kv_version) == (v, kv):
            out[-1] = out[-1]._replace(end=e)
        elif e > s or (i + 1 == len(starts) and not out):
            out.append(VersionSpan(s, e, v, kv))
    return out


def _new_completion_output_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    for ch in _channels():
        if ch.completion is not None:
            try:
                ch.completion(instance, out)
            except Exception:
                logger.exception("vllm-rlpatch: output channel %s failed on a CompletionOutput", ch.name)
    starts = instance.__dict__.get("_rlpatch_starts")
    if starts:
        det = getattr(instance, "detokenizer", None)
        end = det.num_output_tokens() if det is not None else len(getattr(out, "token_ids", ()) or ())
        try:
            out.rlpatch_weight_versions = spans_of(starts, end)
        except AttributeError:
            pass
    return out


# ---------------------------------------------------------------------------------------------- install
def _on_weight_event(ev, engine) -> None:
    """A worker in *this* process changed its weights."""
    if ev.side != "worker":
        return
    g = _BY_WORKER.get(id(engine))
    if g is None:
        return
    if _TLS.rpc_guard is g:
        return  # inside an RPC of this engine: check_workers() picks it up when the RPC returns
    g.updated(f"in-process worker: {ev.source}", ev.version)


_WRAPPERS: dict[str, Callable] = {
    f"{CORE}:EngineCore.collective_rpc": _collective_rpc_wrapper,
    f"{CORE}:EngineCore.preprocess_add_request": _preprocess_wrapper,
    f"{CORE}:EngineCore.add_request": _add_request_wrapper,
    f"{CORE}:EngineCore.step": _step_wrapper,
    f"{CORE}:EngineCore.step_with_batch_queue": _step_wrapper,
    f"{SCHED}:Scheduler.schedule": _schedule_wrapper,
    f"{SCHED}:Scheduler.update_from_output": _update_from_output_wrapper,
    f"{SCHED}:Scheduler._preempt_request": _preempt_wrapper,
    f"{OUTPUTS}:OutputProcessor.process_outputs": _process_outputs_wrapper,
    f"{OUTPUTS}:RequestState._new_completion_output": _new_completion_output_wrapper,
}


def _missing(targets: list[str]) -> None:
    logger.warning("vllm-rlpatch: %s missing in this vLLM; that part of the weight-update handling is off",
                   ", ".join(targets))


_LAZY = [_wrapping.LateWraps(module, {t: w for t, w in _WRAPPERS.items() if t.partition(":")[0] == module}, OWNER,
                             on_missing=_missing) for module in (CORE, SCHED, OUTPUTS)]


def require(user: str) -> None:
    """A patch needs the hook: install it (idempotent), wrapping each module when vLLM imports it."""
    global _active, _unsubscribe
    with _LOCK:
        _USERS.add(user)
        if _active:
            return
        _active = True
        for lz in _LAZY:
            lz.apply()
        _unsubscribe = weights.on_weight_update(_on_weight_event)


def release(user: str) -> None:
    global _active, _unsubscribe
    with _LOCK:
        _USERS.discard(user)
        if _USERS:
            return
        _active = False
        for lz in _LAZY:
            lz.revert()
        if _unsubscribe is not None:
            _unsubscribe()
            _unsubscribe = None


def add_policy(p: Policy) -> None:
    with _LOCK:
        _POLICIES[p.name] = p


def remove_policy(name: str) -> None:
    with _LOCK:
        _POLICIES.pop(name, None)


def add_channel(ch: Channel) -> None:
    with _LOCK:
        _CHANNELS[ch.name] = ch


def remove_channel(name: str) -> None:
    with _LOCK:
        _CHANNELS.pop(name, None)
