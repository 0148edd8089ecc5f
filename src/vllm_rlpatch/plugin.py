"""The ``vllm.general_plugins`` entry point: ``rlpatch = vllm_rlpatch.plugin:register``.

vLLM calls :func:`register` once per process (process 0 inside ``EngineArgs.__post_init__``, the CLI
process in ``add_cli_args``, the engine core in ``EngineCore.__init__``, each worker in ``init_worker``).
It validates the ``VLLM_RLPATCH_*`` environment, applies every patch spec through the registry, logs one
INFO summary line (pid, role, vLLM version, applied / skipped / failed) and, if
``VLLM_RLPATCH_STATUS_DIR`` is set, writes ``<pid>.json``.

vLLM swallows exceptions raised while *loading* an entry point but not those raised while running it;
this function therefore never raises unless asked to (an invalid ``VLLM_RLPATCH_*`` value, strict mode, or
an explicitly enabled patch that failed): silent skipping is what it exists to prevent.

Processes forked after registration inherit vLLM's ``plugins_loaded`` flag and our applied patches, so
``register`` is not called again there; an at-fork hook reports the inherited status under the child's pid.

This is also the composition root: :func:`compose` hands the patch list to the registry (which sits below the
patches and cannot import them). ``register`` calls it; so does any other entry point that reads the registry
without registering (``vllm_rlpatch.status()``, the tools). Importing the module has no side effect.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

from vllm_rlpatch import _role, envs, registry
from vllm_rlpatch._startup import declare_env_names
from vllm_rlpatch.hooks import explicit
from vllm_rlpatch.patches import ALL_PATCHES, refit_http
from vllm_rlpatch.versions import vllm_info

logger = logging.getLogger("vllm.rlpatch")

_LOCK = threading.Lock()
_COMPOSE_LOCK = threading.Lock()
_composed = False
_registered_pid: int | None = None
_fork_role_pending = False  # this process was forked from a registered one and has not been named yet
_register_seconds: float | None = None
_fork_hook_installed = False

# Frames that call vLLM's load_general_plugins(), innermost first match decides the role.
_ROLE_FRAMES = (
    ("init_worker", "worker"),
    ("EngineCore.__init__", "engine_core"),
    ("add_cli_args", "cli"),
    ("__post_init__", "frontend"),
    ("_run", "model_inspection"),
)


# A process vLLM forks (GPU hosts: the engine core, multiprocess workers) inherits the plugin and vLLM's own
# "plugins loaded" flag, so vLLM never loads the plugins there again: the child names itself from the frame that
# started it, still on its stack right after the fork.
_FORK_FRAMES = (
    ("CoreEngineProcManager.__init__", "engine_core"),
    ("make_worker_process", "worker"),
)


def _role_from_stack(f: Any, table: tuple[tuple[str, str], ...]) -> str | None:
    """The role of the first vLLM frame from ``f`` outwards whose qualified name ends with a needle of ``table``."""
    while f is not None:
        code = f.f_code
        qual = getattr(code, "co_qualname", code.co_name)
        if "/vllm/" in code.co_filename.replace("\\", "/"):
            for needle, role in table:
                if qual.endswith(needle):
                    return role
        f = f.f_back
    return None


def _fork_role() -> str | None:
    return _role_from_stack(sys._getframe(1), _FORK_FRAMES)


def _detect_role() -> str:
    return _role_from_stack(sys._getframe(3), _ROLE_FRAMES) or "other"


def process_role() -> str:
    return _role.get()


def register_seconds() -> float | None:
    return _register_seconds


def _summary(statuses) -> str:
    by_state: dict[str, list[str]] = {}
    for s in statuses:
        by_state.setdefault(s.state, []).append(s.name)
    info = vllm_info()
    skipped = by_state.get("disabled", []) + by_state.get("not_needed", []) + by_state.get("unsupported", [])
    return (f"vllm-rlpatch: pid={os.getpid()} role={_role.get()} vllm={info.raw_version} ({info.distribution}) "
            f"applied=[{','.join(by_state.get('applied', []))}] skipped=[{','.join(skipped)}] "
            f"failed=[{','.join(by_state.get('failed', []))}]")


def _write_status_file(statuses, extra: dict[str, Any] | None = None) -> None:
    d = envs.STATUS_DIR.get()
    if not d:
        return
    try:
        os.makedirs(d, exist_ok=True)
        payload = {"pid": os.getpid(), "ppid": os.getppid(), "role": _role.get(), "vllm": vllm_info().raw_version,
                   "register_seconds": _register_seconds,
                   "patches": [s.as_dict() for s in statuses], **(extra or {})}
        tmp = os.path.join(d, f".{os.getpid()}.json.tmp")
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=1)
        os.replace(tmp, os.path.join(d, f"{os.getpid()}.json"))
    except OSError as e:
        logger.warning("vllm-rlpatch: cannot write status file in %s: %s", d, e)


def _vllm_logging_configured() -> bool:
    return bool(logging.getLogger("vllm").handlers) or os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0"


def _log_summary(line: str) -> None:
    """Log the per-process summary at INFO, even where vLLM would swallow it: vLLM 0.32 loads plugins in
    process 0 inside ``suppress_logging()`` and before it has configured its ``vllm`` logger. The user's
    level (``VLLM_LOGGING_LEVEL`` / their logging config) still rules."""
    if not _vllm_logging_configured():
        if logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()) <= logging.INFO:
            stamp = time.strftime("%m-%d %H:%M:%S")
            print(f"INFO {stamp} [vllm_rlpatch] {line}", file=sys.stderr, flush=True)
        return
    if logger.isEnabledFor(logging.INFO):
        logger.info(line)
    elif logger.getEffectiveLevel() <= logging.INFO and not logger.disabled:
        fn, lno, func, sinfo = logger.findCaller()
        logger.handle(logger.makeRecord(logger.name, logging.INFO, fn, lno, line, (), None, func, None, sinfo))


def _after_fork_in_child() -> None:
    global _registered_pid
    parent = _registered_pid
    if parent is None or parent == os.getpid():
        return
    global _fork_role_pending
    _registered_pid = os.getpid()
    named = _fork_role()
    # named now from the launching frame, else when (if) vLLM loads its plugins here (register() below)
    _fork_role_pending = named is None
    _role.set(named or f"forked:{_role.get()}")
    _report_inherited(f"inherited from pid {parent} via fork", {"forked_from": parent})


def _report_inherited(how: str, extra: dict[str, Any]) -> None:
    """The summary line and status file of a process that inherited its patches through fork. The parent
    validated the environment; a value made invalid since (os.environ changed in-process) costs the report,
    said in a WARNING, never the process (this runs in an at-fork hook or inside vLLM's plugin loading)."""
    try:
        statuses = registry.status()
    except envs.EnvError as e:
        logger.warning("vllm-rlpatch: pid %d (%s) cannot report its patch status: %s", os.getpid(), how, e)
        return
    _log_summary(f"{_summary(statuses)} ({how})")
    _write_status_file(statuses, extra)


def _configure_logging() -> None:
    level = envs.LOG_LEVEL.get()
    if level:
        logger.setLevel(level.upper())


def register() -> None:
    """Apply all patches in this process (idempotent per process). The entry point vLLM calls."""
    _register(None)


def register_as(role: str) -> None:
    """Like :func:`register`, for our own tools (``doctor``) that load the plugin outside vLLM's hooks."""
    _register(role)


def _register(role: str | None) -> None:
    global _registered_pid, _register_seconds, _fork_hook_installed, _fork_role_pending
    with _LOCK:
        if _registered_pid == os.getpid():
            if _fork_role_pending:
                # a forked process (vLLM forks its engine core on a GPU host) inherited the patches; when vLLM
                # loads its plugins here, the process says what it is (not "forked:frontend")
                _fork_role_pending = False
                detected = role or _detect_role()
                if detected != "other":
                    _role.set(detected)
                    _report_inherited("patches inherited via fork", {"forked": True})
            return
        t0 = time.perf_counter()
        _role.set(role or _detect_role())
        declare_env_names()
        _configure_logging()
        compose()
        envs.validate_environment()  # raises EnvError on an invalid value
        if envs.ENABLED.get():
            try:
                explicit.install()  # no-op when the .pth start-up hook already did it
            except Exception as e:  # vLLM without arg_utils? the config patches will report it
                logger.debug("vllm-rlpatch: explicit-argument capture unavailable: %r", e)
        statuses = registry.apply_all()  # raises PatchError under strict mode
        _registered_pid = os.getpid()
        _register_seconds = time.perf_counter() - t0
        _log_summary(_summary(statuses))
        for s in statuses:
            logger.debug("vllm-rlpatch:   %-18s %-11s %s", s.name, s.state, s.reason)
        _write_status_file(statuses)
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook_installed = True


# ---------------------------------------------------------------------------------------------- composition
def _install_refit_routes(app: Any) -> None:
    from vllm_rlpatch.refit import http  # torch and FastAPI: loaded only in an API server that builds its app

    http.install_routes(app)


def compose() -> None:
    """Wire the runtime, once per process: the registry gets the patch list (and with it ``envs`` the patch
    toggles), the ``refit_http`` patch the refit routes. Importing this module wires nothing: every entry point
    calls this first (:func:`register`, ``vllm_rlpatch.status()``, the tools, the tests). With the toggles
    known, each unknown ``VLLM_RLPATCH_*`` name is reported here, once per process."""
    global _composed
    with _COMPOSE_LOCK:
        if _composed:
            return
        registry.use(ALL_PATCHES)
        refit_http.set_route_installer(_install_refit_routes)
        _composed = True
    envs.warn_unknown()
