"""Refit over HTTP: routes on ``vllm serve`` (installed through the ``refit_http`` patch, wired by the plugin) and the client target.

Routes (JSON only, never pickle; every one needs ``Authorization: Bearer <token>``, and by default the
client must be on loopback, see ``VLLM_RLPATCH_HTTP_REMOTE``):

    GET  /rlpatch/v1/weight_version   {"version": N, "workers": [...], "api_server": pid of the answering process}
    GET  /rlpatch/v1/describe         per-worker schema (names, shapes, dtypes), device, rank
    GET  /rlpatch/v1/fingerprint      per-worker fingerprint of every parameter and buffer
    POST /rlpatch/v1/refit            body: the refit request (metadata + transport spec); returns the outcome

The phases of a fleet update (``push_weights([url_a, url_b, ...])``, :mod:`.fleet`), one call each, run by the
server's coordinator (:func:`~.coordinator.coordinate_phase`); each returns the phase's outcome (an RPC that
raised: HTTP 500, ``{"error", "kind"}``):

    POST /rlpatch/v1/refit/prepare        {"req": the refit request}: every worker validates and stages
    POST /rlpatch/v1/refit/commit         {"req": {"txid", "version", "inflight"}, "n": workers, "keep": true}
    POST /rlpatch/v1/refit/release        {"txid", "version"}: the fleet committed; the backups are dropped
    POST /rlpatch/v1/refit/abort          {"txid"}: drop a prepared update, or roll a kept commit back
    POST /rlpatch/v1/refit/align_version  {"version"}: raise every worker's weight version to it
    GET  /rlpatch/v1/refit/weight_state   {"workers": [{"version", "mixed"}, ...]}

The token is ``VLLM_RLPATCH_HTTP_TOKEN`` if set; otherwise the server generates one and writes it to
``~/.cache/vllm-rlpatch/http-token-<port>`` (mode 0600), where a client on the same host finds it.
With ``--api-server-count`` > 1 the API server processes share that token (the first writes it). With
data-parallel engines every route asks each engine core (vLLM's ``collective_rpc`` answers with the first
engine's only). A refused update or a malformed phase body answers 400 / 409 (the outcome plus a one-line
``error``), which :class:`HttpTarget` reads like a 200 outcome.
"""

import asyncio
import hmac
import json
import logging
import math
import os
import secrets
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from vllm_rlpatch import envs
from vllm_rlpatch.hooks import engine_core
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit import transports
from vllm_rlpatch.refit.coordinator import PHASES, coordinate_on_async, coordinate_phase, rpc_error_to_refit, run_async
from vllm_rlpatch.refit.target import EngineUnreachable, Target, is_loopback

logger = logging.getLogger("vllm.rlpatch")

PREFIX = "/rlpatch/v1"


def token_path(port: int | str) -> str:
    base = os.path.join(os.path.expanduser("~"), ".cache", "vllm-rlpatch")
    return os.path.join(base, f"http-token-{port}")


def _server_token(port: Any, siblings: bool = False) -> tuple[str, str]:
    """The routes' token: ``VLLM_RLPATCH_HTTP_TOKEN``, else a new one written to :func:`token_path`. ``siblings``
    (``--api-server-count`` > 1: one port, several API server processes started by one parent): the first
    process writes the token and the others read it, so that every process answers to the one token in the
    file."""
    tok = envs.HTTP_TOKEN.get()
    if tok:
        return tok, "VLLM_RLPATCH_HTTP_TOKEN"
    import atexit

    path = token_path(port)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tok = _sibling_token(path) if siblings else _write_token(path)

    def _remove(p=path, t=tok):  # only our own token (a later server on this port wrote its own)
        try:
            with open(p) as fh:
                if fh.read().strip() == t:
                    os.unlink(p)
        except OSError:
            pass

    atexit.register(_remove)
    return tok, path


def _write_token(path: str) -> str:
    tok = secrets.token_urlsafe(32)
    fd = os.open(path + ".tmp", os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(tok)
    os.replace(path + ".tmp", path)
    return tok


def _parent_key() -> str:
    """This process's parent, as pid and start time (a reused pid is another parent)."""
    ppid = os.getppid()
    try:
        with open(f"/proc/{ppid}/stat") as fh:
            start = fh.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        start = "?"
    return f"{ppid}:{start}"


def _sibling_token(path: str) -> str:
    """Under a lock on ``path.lock`` (which names the parent whose processes share the token): reuse the token
    a sibling wrote, else write one."""
    import fcntl

    key = _parent_key()
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
    with os.fdopen(fd, "r+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        owner = lock.read().strip()
        if owner == key and os.path.exists(path):
            with open(path) as fh:
                tok = fh.read().strip()
            if tok:
                return tok
        tok = _write_token(path)
        lock.seek(0)
        lock.truncate()
        lock.write(key)
        return tok


# ------------------------------------------------------------------------------------------ server
# (no `from __future__ import annotations` in this module: FastAPI reads the handlers' annotations at run
# time, and `request: Request` must resolve to the class, not to a string naming a local import)
def install_routes(app: Any) -> None:
    """Add the refit routes to a vLLM FastAPI app (idempotent)."""
    if getattr(app.state, "rlpatch_routes", False):
        return
    from fastapi import APIRouter, Request
    from fastapi.responses import JSONResponse

    args = getattr(app.state, "args", None)
    port = getattr(args, "port", None) or "default"
    token, where = _server_token(port, siblings=(getattr(args, "api_server_count", None) or 1) > 1)
    allow_remote = envs.HTTP_REMOTE.get()
    router = APIRouter()

    def deny(request: Request) -> JSONResponse | None:
        client = request.client.host if request.client else None
        if not allow_remote and not is_loopback(client):
            return JSONResponse({"error": f"refit routes accept loopback clients only (client {client}); set "
                                          "VLLM_RLPATCH_HTTP_REMOTE=1 on the server to allow others"}, status_code=403)
        auth = request.headers.get("authorization", "")
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "missing or wrong bearer token (Authorization: Bearer <token>; the server's "
                                          "token is VLLM_RLPATCH_HTTP_TOKEN or the file it logged at start-up)"},
                                status_code=401)
        return None

    _read_routes(router, deny, Request)
    _refit_route(router, deny, Request, JSONResponse)
    _phase_routes(router, deny, Request, JSONResponse)
    app.include_router(router)
    app.state.rlpatch_routes = True
    logger.info("vllm-rlpatch: refit routes at %s/* (%s clients; bearer token from %s)", PREFIX,
                "any" if allow_remote else "loopback", where)


def _engine(request):
    return request.app.state.engine_client


async def _collective(engine, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
    """``collective_rpc`` on every engine core behind this API server, answers in engine order. vLLM's
    ``AsyncLLM.collective_rpc`` sends a data-parallel client's call to every engine but returns the first
    engine's answers only: a refit must see every worker's answer (and a version or fingerprint every
    engine's), so with several engines each one is asked and answers on its own."""
    core = getattr(engine, "engine_core", None)
    engines = list(getattr(core, "core_engines", None) or ())
    if len(engines) < 2 or not hasattr(core, "_call_utility_async"):
        return await engine.collective_rpc(method, args=args, kwargs=kwargs)
    per_engine = await asyncio.gather(*[core._call_utility_async("collective_rpc", method, None, args, kwargs,
                                                                 engine=e) for e in engines])
    return [answer for answers in per_engine for answer in answers]


def _read_routes(router, deny, Request) -> None:
    @router.get(PREFIX + "/weight_version")
    async def weight_version(request: Request):
        if (d := deny(request)) is not None:
            return d
        vs = await _collective(_engine(request), "rlpatch_weight_version")
        # api_server: this process (with --api-server-count > 1, the kernel hands each connection to one of them)
        return {"version": max(int(v) for v in vs), "workers": [int(v) for v in vs], "api_server": os.getpid()}

    @router.get(PREFIX + "/describe")
    async def describe(request: Request):
        if (d := deny(request)) is not None:
            return d
        return {"workers": await _collective(_engine(request), "rlpatch_refit_describe")}

    @router.get(PREFIX + "/fingerprint")
    async def fingerprint(request: Request):
        if (d := deny(request)) is not None:
            return d
        return {"workers": await _collective(_engine(request), "rlpatch_fingerprint")}


def _bad_request(request, req: Any, JSONResponse):
    if not isinstance(req, dict):
        return JSONResponse({"error": "the refit request is not a JSON object"}, status_code=400)
    for key in ("txid", "tensors"):
        if key not in req:
            return JSONResponse({"error": f"the refit request has no {key!r}"}, status_code=400)
    why = _wire_refusal(req)
    if why is None:
        why = transports.http_refusal(req.get("transport") or {},
                                      is_loopback(request.client.host if request.client else None))
    if why is not None:
        return JSONResponse({"error": why}, status_code=400)
    return None


def _is(v: Any, *types: type) -> bool:
    return isinstance(v, types) and not (isinstance(v, bool) and bool not in types)


# a refit request's keys as JSON types (RefitRequest.from_wire's fields; null allowed where the worker has a default)
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "txid": (str,), "mode": (str, type(None)), "guarantee": (str, type(None)), "inflight": (str, type(None)),
    "backup": (str, type(None)), "template": (str, type(None)), "tensors": (list, type(None)),
    "transport": (dict, type(None)), "fingerprints": (list, type(None)), "nonfinite": (list, type(None)),
    "deadline": (int, float, type(None)), "partial": (bool,), "allow_cast": (bool,), "verify": (bool,),
    "session": (bool,)}
# one tensor's record (TensorMeta.from_dict)
_META_TYPES: dict[str, tuple[type, ...]] = {"name": (str,), "dtype": (str,), "shape": (list,), "nbytes": (int,),
                                            "segment": (int,), "offset": (int,), "fingerprint": (str, type(None)),
                                            "nonfinite": (int, type(None))}


def _wire_refusal(req: dict[str, Any]) -> str | None:
    """What makes a refit request that came as JSON unreadable for the workers (None: nothing): a key of the wrong
    type, a number out of range, a tensor record that is not one. The workers check what the values mean."""
    for key, types in _WIRE_TYPES.items():
        if key in req and not _is(req[key], *types):
            return f"the refit request's {key!r} is not {' or '.join(t.__name__ for t in types)}"
    for key in ("version", "workers"):
        if req.get(key) is not None and not _int_in(req[key], 0 if key == "version" else 1):
            return f"the refit request's {key!r} is not an int >= {0 if key == 'version' else 1} (or null)"
    if req.get("inflight") is not None and req["inflight"] not in envs.INFLIGHT_MODES:
        return f"the refit request's 'inflight' is not one of {', '.join(envs.INFLIGHT_MODES)}"
    if req.get("deadline") is not None and not math.isfinite(req["deadline"]):
        return "the refit request's 'deadline' is not a finite time"
    for i, meta in enumerate(req.get("tensors") or ()):
        if not isinstance(meta, dict) or not all(k in meta for k in ("name", "dtype", "shape", "nbytes")):
            return f"the refit request's tensors[{i}] is not an object with name, dtype, shape, nbytes"
        for key, types in _META_TYPES.items():
            if key in meta and not _is(meta[key], *types):
                return f"the refit request's tensors[{i}].{key} is not {' or '.join(t.__name__ for t in types)}"
        if not all(_int_in(x, 0) for x in meta["shape"]) or not all(
                _int_in(meta.get(k, 0), 0) for k in ("nbytes", "segment", "offset")):
            return f"the refit request's tensors[{i}] has a size, offset or dimension out of range"
    return None


def _refit_route(router, deny, Request, JSONResponse) -> None:
    @router.post(PREFIX + "/refit")
    async def refit(request: Request):
        if (d := deny(request)) is not None:
            return d
        try:
            req = await request.json()
        except Exception:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if (d := _bad_request(request, req, JSONResponse)) is not None:
            return d
        engine = _engine(request)
        out = await coordinate_on_async(engine, req, lambda g: run_async(g, _rpc(engine)))
        if not out.get("ok") and out.get("state") != "mixed":  # (mixed: the front end already says so, louder)
            # The trainer gets this in its report, but it may be gone (killed mid-transfer): the server says it too.
            logger.warning("vllm-rlpatch: weight update %s from %s not applied (weights %s): %s", req["txid"],
                           request.client.host if request.client else "?", out.get("state", "unchanged"),
                           out.get("message"))
        return _outcome(out, JSONResponse)


def _outcome(out: dict[str, Any], JSONResponse):
    """An update's outcome as the answer: one the engine refused (bad request, unknown transaction, asleep, ...)
    and that left the weights unchanged is a 4xx (400: the request is invalid, 409: it does not fit the
    engine's state) with the outcome and its first line under "error"; the others 200. The client
    (:class:`HttpTarget`) reads the outcome from either."""
    kind = out.get("kind")
    if out.get("ok") or out.get("state") not in (None, "unchanged") or kind not in ("validation", "refused"):
        return out
    line = (str(out.get("message") or "the weight update was refused").splitlines() or [""])[0]
    return JSONResponse({**out, "error": line}, status_code=400 if kind == "validation" else 409)


MAX_INT = 2 ** 63 - 1  # a weight version or worker count the engine's RPCs carry (msgpack: a signed 64-bit int)


def _int_in(v: Any, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_INT


def _phase_refusal(phase: str, args: dict[str, Any]) -> str | None:
    """What is wrong with a phase's body beyond its keys' types (None: nothing)."""
    if phase == "commit":
        req = args["req"]
        if not isinstance(req.get("txid"), str):
            return "refit/commit: the request has no 'txid' (str)"
        if req.get("version") is not None and not _int_in(req.get("version"), 0):
            return "refit/commit: 'version' is a weight version (an int >= 0) or null"
        if req.get("inflight") is not None and req.get("inflight") not in envs.INFLIGHT_MODES:
            return f"refit/commit: 'inflight' is one of {', '.join(envs.INFLIGHT_MODES)} or null"
        if not _int_in(args["n"], 1):
            return "refit/commit: 'n' is the engine's worker count (an int >= 1)"
        if not isinstance(args.get("keep", True), bool):
            return "refit/commit: 'keep' is true or false"
    if phase == "align_version" and not _int_in(args["version"], 0):
        return "refit/align_version: 'version' is a weight version (an int >= 0)"
    if phase == "release" and not _int_in(args["version"], 0):
        return "refit/release: 'version' is the committed weight version (an int >= 0)"
    return None


async def _release_refusal(engine, version: int, JSONResponse):
    """A release makes the front end take the update (and clear a mixed state): only when every worker holds
    the released version, unmixed (a kept commit of it), never on a stray call (409)."""
    try:
        state = await run_async(coordinate_phase(engine, "weight_state", {}), _rpc(engine))
    except Exception as e:  # noqa: BLE001 - an RPC raised: the client's error, one line
        err = rpc_error_to_refit(e, "refit release")
        return JSONResponse({"error": (str(err).splitlines() or [""])[0], "kind": err.kind}, status_code=500)
    held = [(w.get("version"), w.get("mixed")) for w in state.get("workers") or ()]
    if not held or any(v != version or m is not None for v, m in held):
        return JSONResponse({"error": f"refit/release: version {version} is not what the workers hold (version, "
                                      f"mixed per worker: {held}); nothing to release"}, status_code=409)
    return None


# the phases of a fleet update (vllm_rlpatch.refit.fleet), one call each, and what each one's body holds
_PHASE_BODIES = {"prepare": {"req": dict}, "commit": {"req": dict, "n": int},
                 "release": {"txid": str, "version": int}, "abort": {"txid": str}, "align_version": {"version": int}}


async def _run_phase(request, phase: str, args: dict[str, Any], JSONResponse):
    engine = _engine(request)
    try:
        out = await run_async(coordinate_phase(engine, phase, args), _rpc(engine))
    except Exception as e:  # noqa: BLE001 - an RPC raised (dead worker, ...): the client's error, one line
        err = e if isinstance(e, P.RefitError) else rpc_error_to_refit(e, f"refit {phase}")
        return JSONResponse({"error": (str(err).splitlines() or [""])[0], "kind": err.kind}, status_code=500)
    if phase in ("prepare", "commit", "abort") and not out.get("ok"):
        logger.warning("vllm-rlpatch: fleet update %s: %s from %s failed (weights %s): %s",
                       (args.get("req") or args).get("txid"), phase,
                       request.client.host if request.client else "?", out.get("state"), out.get("message"))
    return _outcome(out, JSONResponse)


def _phase_routes(router, deny, Request, JSONResponse) -> None:
    need = _PHASE_BODIES

    @router.get(PREFIX + "/refit/weight_state")
    async def refit_weight_state(request: Request):
        if (d := deny(request)) is not None:
            return d
        return await _run_phase(request, "weight_state", {}, JSONResponse)

    @router.post(PREFIX + "/refit/{phase}")
    async def refit_phase(phase: str, request: Request):
        if (d := deny(request)) is not None:
            return d
        if phase not in need:
            return JSONResponse({"error": f"no refit phase {phase!r}: POST one of {', '.join(need)} (GET "
                                          "weight_state)"}, status_code=404 if phase not in PHASES else 405)
        try:
            args = await request.json()
        except Exception:
            return JSONResponse({"error": "the body is not JSON"}, status_code=400)
        if not isinstance(args, dict):
            return JSONResponse({"error": "the body is not a JSON object"}, status_code=400)
        for key, typ in need[phase].items():
            if not isinstance(args.get(key), typ) or isinstance(args.get(key), bool):
                return JSONResponse({"error": f"refit/{phase}: the body needs {key!r} ({typ.__name__})"},
                                    status_code=400)
        if phase == "prepare" and (d := _bad_request(request, args["req"], JSONResponse)) is not None:
            return d
        if (why := _phase_refusal(phase, args)) is not None:
            return JSONResponse({"error": why}, status_code=400)
        if phase == "release" and (
                d := await _release_refusal(_engine(request), args["version"], JSONResponse)) is not None:
            return d
        return await _run_phase(request, phase, args, JSONResponse)


def _rpc(engine):
    async def rpc(method, args, kwargs):
        return engine_core.unpack_answers(await _collective(engine, method, args, kwargs))

    return rpc


# ------------------------------------------------------------------------------------------ client
class HttpTarget(Target):
    """``http://host:port`` of a ``vllm serve`` started with the plugin."""

    kind = "http"

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        u = urllib.parse.urlparse(self.url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
        self.timeout_s = timeout_s
        self._token = token
        self.front = None

    def token(self) -> str:
        if self._token:
            return self._token

        tok = envs.HTTP_TOKEN.get()
        if tok:
            return tok
        path = token_path(self.port)
        if self.same_host() and os.path.exists(path):
            with open(path) as fh:
                return fh.read().strip()
        raise P.RefitError(f"no token for {self.url}: pass token=..., set VLLM_RLPATCH_HTTP_TOKEN, or run on the "
                           f"server's host (it writes {path})", kind="refused")

    def same_host(self) -> bool:
        if is_loopback(self.host):
            return True
        try:
            addrs = {a[4][0] for a in socket.getaddrinfo(self.host, None)}
            local = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        except OSError:
            return False
        return bool(addrs & local)

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + PREFIX + path, data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token()}",
                                              "Content-Type": "application/json"})
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            got: dict[str, Any] = {}
            try:
                body_ = json.loads(e.read())
                got = body_ if isinstance(body_, dict) else {}
                detail = got.get("error")
            except Exception:
                detail = e.reason
            if e.code in (400, 409) and "ok" in got and "state" in got:  # an update's outcome (the engine refused)
                return got
            kind = "refused" if e.code in (401, 403) else (got.get("kind") or "validation")
            if e.code == 404 and path.startswith("/refit/") and not got.get("error"):
                detail = (f"{self.url} has no {PREFIX}{path} route: the server's vllm-rlpatch predates fleet "
                          "updates (upgrade it there), does not run, or VLLM_RLPATCH_REFIT_HTTP=0")
                kind = "refused"
            elif e.code == 404 and not got.get("error"):
                detail = (f"{self.url} has no {PREFIX} routes: the server does not run vllm-rlpatch (or "
                          "VLLM_RLPATCH_REFIT_HTTP=0)")
                kind = "refused"
            raise P.RefitError(f"{method} {PREFIX}{path}: HTTP {e.code}: {detail}", kind=kind) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise EngineUnreachable(f"{self.url}: no answer within {timeout:.1f} s") from None
            raise EngineUnreachable(f"{self.url} is unreachable: {e.reason}") from None
        except TimeoutError:  # (socket.timeout) connected, but the answer did not come in time
            raise EngineUnreachable(f"{self.url}: no answer within {timeout:.1f} s") from None
        except (ConnectionError, OSError) as e:  # the server went away mid-answer
            raise EngineUnreachable(f"{self.url} is unreachable: {type(e).__name__}: {e}") from None

    def phase(self, phase: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One phase of a fleet update as one call to the server (``/rlpatch/v1/refit/<phase>``), run by its
        coordinator."""
        if phase == "weight_state":
            return self._call("GET", "/refit/weight_state", timeout_s=timeout_s)
        return self._call("POST", f"/refit/{phase}", args, timeout_s=timeout_s)

    def describe(self) -> list[dict[str, Any]]:
        return self._call("GET", "/describe")["workers"]

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/refit", req)

    def version(self) -> int:
        return int(self._call("GET", "/weight_version")["version"])

    def fingerprint(self) -> list[dict[str, Any]]:
        return self._call("GET", "/fingerprint")["workers"]
