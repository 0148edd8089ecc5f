"""A fleet of URLs: push_weights(["http://a", "http://b"]) runs each phase of the update as one call to the
server's /rlpatch/v1/refit/<phase> route (vllm_rlpatch.refit.http), whose coordinator drives the engine. Here
the real routes (FastAPI app + uvicorn on loopback, the real HTTP client, the real fleet) in front of scripted
engines (tests/test_fleet_protocol.py's FakeEngine, no vLLM): the phases, their order and outcomes, the front end
taking a mixed outcome on the server, a fleet mixing an in-process engine and a URL, an unreachable server
named within timeout_s, and the routes' checks. A real `vllm serve` in a fleet: tests/test_serve.py."""

import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from test_fleet_protocol import TENSORS, FakeEngine, _phases
from vllm_rlpatch.hooks import mixed
from vllm_rlpatch.refit import RefitError, fleet
from vllm_rlpatch.refit.http import HttpTarget

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick

TOKEN = "t" * 32


class EngineClient:
    """Stands for the server's engine client (``AsyncLLM``): collective_rpc into one scripted worker."""

    def __init__(self, engine: FakeEngine):
        self.engine = engine

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "rlpatch_refit_describe":
            return self.engine.describe()  # (already one entry per worker)
        if method == "rlpatch_weight_version":
            return [self.engine.weights_version]
        return self.engine.rpc(method, tuple(args), dict(kwargs or {}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, phases=True):
        import uvicorn
        from fastapi import FastAPI

        from vllm_rlpatch.refit.http import install_routes

        self.app = FastAPI()
        self.client = EngineClient(FakeEngine())
        self.app.state.engine_client = self.client
        old = os.environ.get("VLLM_RLPATCH_HTTP_TOKEN")
        os.environ["VLLM_RLPATCH_HTTP_TOKEN"] = TOKEN
        try:
            install_routes(self.app)
        finally:
            if old is None:
                os.environ.pop("VLLM_RLPATCH_HTTP_TOKEN")
            else:
                os.environ["VLLM_RLPATCH_HTTP_TOKEN"] = old
        app = self.app
        if not phases:  # a server whose vllm-rlpatch predates fleet updates: FastAPI's 404 on those routes
            from fastapi.responses import JSONResponse

            async def app(scope, receive, send):
                if scope["type"] == "http" and "/rlpatch/v1/refit/" in scope["path"]:
                    return await JSONResponse({"detail": "Not Found"}, status_code=404)(scope, receive, send)
                return await self.app(scope, receive, send)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.time() + 20
        while not self.server.started and time.time() < end:
            time.sleep(0.05)
        assert self.server.started

    def reset(self, *a, **kw) -> FakeEngine:
        self.client.engine = FakeEngine(*a, **kw)
        mixed.clear(self.client)
        return self.client.engine

    def target(self, timeout_s=30.0) -> HttpTarget:
        return HttpTarget(self.url, token=TOKEN, timeout_s=timeout_s)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    ss = [Server(), Server()]
    yield ss
    for s in ss:
        s.stop()


def push(targets, **kw):
    return fleet.push_weights(targets, TENSORS, transport="shm", **kw)


def test_a_good_update_over_http_commits_every_server_at_one_version(servers, monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_HTTP_TOKEN", TOKEN)  # what a URL string's client sends
    a, b = servers[0].reset(), servers[1].reset()
    b.weights_version = 2
    rep = push([s.url for s in servers])
    assert rep.ok and rep.state == "committed" and rep.versions == [3, 3], rep
    assert [e["name"] for e in rep.engines] == [f"engine{i} ({s.url})" for i, s in enumerate(servers)]
    for e in (a, b):  # every server prepared before any committed; backups released after all committed
        assert _phases(e) == ["rlpatch_refit_prepare", "rlpatch_refit_commit", "rlpatch_refit_release"]
    assert a.segments == b.segments  # packed once, by the trainer: both servers' engines read the same segments
    assert fleet.weight_version([s.url for s in servers]) == [3, 3]


def test_a_refusal_in_one_servers_prepare_aborts_both(servers):
    a, b = servers[0].reset(), servers[1].reset(refuse=True)
    with pytest.raises(RefitError) as ei:
        push([s.target() for s in servers])
    assert ei.value.state == "unchanged" and "\n" not in str(ei.value)
    assert f"engine1 ({servers[1].url}) prepare: no room for the backup" in str(ei.value)
    assert "rlpatch_refit_commit" not in a.calls + b.calls
    assert _phases(a)[-1] == _phases(b)[-1] == "rlpatch_refit_abort"  # (the report may ask versions after it)
    assert (a.weights_version, b.weights_version) == (0, 0)


def test_a_commit_failure_rolls_back_and_the_versions_are_aligned_over_http(servers):
    a, b = servers[0].reset(), servers[1].reset(fail_commit=True)
    rep = push([s.target() for s in servers], raise_on_error=False)
    assert (rep.ok, rep.state) == (False, "restored") and a.state == b.state == "clean", rep
    assert a.weights_version == b.weights_version == 2  # a: commit + rollback; b: aligned to it
    assert "rlpatch_refit_align_version" in b.calls


def test_a_mixed_outcome_makes_the_servers_front_end_refuse_requests(servers):
    """No backups: the failed update leaves both engines mixed; each server's own front end (its engine
    client, which refuses requests while mixed) is told there, in its commit or abort phase. A good update
    clears it."""
    servers[0].reset("validate-then-write"), servers[1].reset("validate-then-write", fail_commit=True)
    with pytest.raises(RefitError) as ei:
        push([s.target() for s in servers])
    assert ei.value.state == "mixed"
    assert all(mixed.poisoned(s.client) is not None for s in servers)
    servers[0].client.engine.state = servers[1].client.engine.state = "clean"
    servers[1].client.engine.fail_commit = False
    rep = push([s.target() for s in servers])
    assert rep.ok and all(mixed.poisoned(s.client) is None for s in servers)


def test_a_fleet_of_an_in_process_engine_and_a_url(servers):
    local, remote = FakeEngine(), servers[0].reset()
    local.weights_version = 4
    rep = push([local, servers[0].target()])
    assert rep.ok and rep.versions == [5, 5], rep
    assert local.segments == remote.segments
    assert _phases(local) == _phases(remote) == ["rlpatch_refit_prepare", "rlpatch_refit_commit",
                                                 "rlpatch_refit_release"]


def test_an_unreachable_server_is_an_error_naming_it_within_timeout_s(servers):
    a = servers[0].reset()
    gone = f"http://127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RefitError) as ei:
        push([servers[0].target(), HttpTarget(gone, token=TOKEN)], timeout_s=5.0)
    assert time.monotonic() - t0 < 5.0
    assert f"engine1 ({gone})" in str(ei.value) and "unreachable" in str(ei.value), str(ei.value)
    assert "rlpatch_refit_commit" not in a.calls


def _call(url, method, path, body=None, token=TOKEN):
    req = urllib.request.Request(url + "/rlpatch/v1" + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_phase_routes_check_token_phase_and_body(servers):
    s = servers[0]
    e = s.reset()
    e.weights_version = 7
    assert _call(s.url, "GET", "/refit/weight_state", token="x" * 32)[0] == 401
    assert _call(s.url, "POST", "/refit/abort", {"txid": "x"}, token="")[0] == 401
    assert _call(s.url, "GET", "/refit/weight_state") == (200, {"ok": True, "workers": [{"version": 7,
                                                                                          "mixed": None}]})
    code, body = _call(s.url, "POST", "/refit/launch", {})
    assert code == 404 and "no refit phase 'launch'" in body["error"]
    code, body = _call(s.url, "POST", "/refit/commit", {"req": {"txid": "x"}})
    assert code == 400 and "'n'" in body["error"]
    code, body = _call(s.url, "POST", "/refit/prepare", {"req": {"txid": "x", "tensors": [],
                                                                 "transport": {"kind": "cuda_ipc"}}})
    assert code == 400 and "not accepted over HTTP" in body["error"]
    assert _call(s.url, "POST", "/refit/align_version", {"version": 9}) == (200, {"ok": True, "workers": [9]})
    assert _call(s.url, "POST", "/refit/abort", {"txid": "nothing"})[1]["state"] == "unchanged"
    assert e.calls == ["rlpatch_weight_state", "rlpatch_refit_align_version", "rlpatch_refit_abort"]


def test_a_server_without_the_phase_routes_is_named_with_the_cause():
    """A server whose vllm-rlpatch predates fleet updates answers 404 to /refit/<phase>: one line saying so."""
    s = Server(phases=False)
    try:
        with pytest.raises(RefitError) as ei:
            push([FakeEngine(), s.target()])
    finally:
        s.stop()
    msg = str(ei.value)
    assert f"engine1 ({s.url}) prepare: POST /rlpatch/v1/refit/prepare: HTTP 404" in msg, msg
    assert ei.value.state == "unchanged", ei.value.state  # prepare writes nothing: engine0 was aborted
    assert "predates fleet updates" in msg and "\n" not in msg
