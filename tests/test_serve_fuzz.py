"""Bad input at the HTTP boundary: a property-based fuzz (hypothesis, fixed seed) of every /rlpatch/v1/* route of
one real `vllm serve`. Every bad request gets one clear 4xx (a JSON object with a one-line "error", never a 500
or a traceback), and the weights (fingerprint) and version stay as they were.

Per route >= 500 cases: malformed JSON, wrong types, huge payloads, wrong or missing token, a client that is
not on loopback. Sequences across calls: a real prepare (a fleet update of this server), then malformed commits,
then the update aborted and committed anyway; commits of transactions never prepared; aborts of unknown
transactions stay idempotent (200, nothing to undo). The counts go to benchmarks/results/serve_fuzz-*.json.

One server, newest CI version only (the routes' code does not depend on the vLLM version)."""

import http.client
import json
import os
import platform
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from support import reference as R  # noqa: E402
from support.env import model_path, skip_unless_newest, vllm_version  # noqa: E402
from support.servers import call, non_loopback_ip, vllm_serve  # noqa: E402
from vllm_rlpatch.refit import RefitError, push_weights  # noqa: E402
from vllm_rlpatch.refit.http import HttpTarget  # noqa: E402

pytestmark = pytest.mark.vllm

TOKEN = "fuzz-token-0123456789abcdef"
CASES = 500
P = "/rlpatch/v1"
# every route, from src/vllm_rlpatch/refit/http.py (GET: no body is read; POST: a JSON object)
GET_ROUTES = [P + "/weight_version", P + "/describe", P + "/fingerprint", P + "/refit/weight_state"]
POST_ROUTES = [P + "/refit", P + "/refit/prepare", P + "/refit/commit", P + "/refit/release", P + "/refit/abort",
               P + "/refit/align_version", P + "/refit/no_such_phase"]
TRIED: dict[str, dict[str, int]] = {}  # route -> {"cases", "4xx", "2xx"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    skip_unless_newest(vllm_version(), "the HTTP fuzz")
    with vllm_serve(tmp_path_factory.mktemp("fuzz") / "server.log", [],
                    env={"VLLM_RLPATCH_HTTP_TOKEN": TOKEN}) as (url, log, port):
        yield port, log


@pytest.fixture(scope="module")
def conns(server):
    port, _ = server
    ip = non_loopback_ip()
    out = {"lo": http.client.HTTPConnection("127.0.0.1", port, timeout=120)}
    if ip is not None:
        out["remote"] = http.client.HTTPConnection(ip, port, timeout=120)
    yield out
    for c in out.values():
        c.close()


def _state(conns):
    _, fp = call(conns["lo"], "GET", P + "/fingerprint", token=TOKEN)
    _, ws = call(conns["lo"], "GET", P + "/refit/weight_state", token=TOKEN)
    return fp["workers"], ws["workers"]


@pytest.fixture(scope="module")
def before(conns):
    return _state(conns)


# ------------------------------------------------------------------------------------------ strategies
SCALARS = st.none() | st.booleans() | st.integers(min_value=-(2 ** 70), max_value=2 ** 70) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
KEYS = ["req", "n", "keep", "txid", "version", "inflight", "tensors", "transport", "workers"]
HUGE = st.sampled_from([1 << 20, 8 << 20])


def _dumps(v) -> bytes:
    return json.dumps(v, allow_nan=True).encode()


@st.composite
def bodies(draw):
    """(kind, raw bytes) of a request body that is never a valid update of the weights."""
    kind = draw(st.sampled_from(["garbage", "truncated", "json", "object", "typed", "huge", "deep", "empty"]))
    if kind == "garbage":
        return kind, draw(st.binary(max_size=64))
    if kind == "truncated":
        text = _dumps(draw(st.dictionaries(st.sampled_from(KEYS), JSON, min_size=1, max_size=3)))
        return kind, text[:draw(st.integers(0, max(0, len(text) - 1)))]
    if kind == "json":
        return kind, _dumps(draw(JSON))
    if kind == "object":
        return kind, _dumps(draw(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=5)))
    if kind == "typed":  # the keys a phase reads, with a value of the wrong type (or a txid nobody prepared)
        req = draw(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=4))
        body = {"req": req if draw(st.booleans()) else draw(JSON), "n": draw(JSON), "keep": draw(JSON),
                "txid": draw(st.text(max_size=16) | JSON), "version": draw(JSON)}
        return kind, _dumps({k: v for k, v in body.items() if draw(st.booleans())})
    if kind == "huge":
        n = draw(HUGE)
        return kind, _dumps({draw(st.sampled_from(KEYS)): "x" * n, "tensors": [{"name": "w"}] * 16})
    if kind == "deep":
        d = draw(st.sampled_from([64, 5000, 200000]))
        return kind, b"[" * d + b"]" * d
    return kind, b""


AUTH = st.sampled_from(["right", "missing", "wrong", "basic", "bearer-empty", "bearer-extra"])


def _headers(auth: str, junk: str) -> dict:
    return {"right": {"Authorization": f"Bearer {TOKEN}"}, "missing": {},
            "wrong": {"Authorization": f"Bearer {junk or 'x'}"}, "basic": {"Authorization": f"Basic {TOKEN}"},
            "bearer-empty": {"Authorization": "Bearer "},
            "bearer-extra": {"Authorization": f"Bearer {TOKEN}{junk or 'x'}"}}[auth]


def _record(route: str, status: int) -> None:
    t = TRIED.setdefault(route, {"cases": 0, "4xx": 0, "2xx": 0})
    t["cases"] += 1
    t["4xx" if 400 <= status < 500 else "2xx" if status < 300 else "other"] = \
        t.get("4xx" if 400 <= status < 500 else "2xx" if status < 300 else "other", 0) + 1


def _clear_error(status, body) -> bool:
    """One clear 4xx: a JSON object whose error is one line (FastAPI's own 405/422 say "detail")."""
    if not 400 <= status < 500 or not isinstance(body, dict):
        return False
    msg = body.get("error", body.get("detail"))
    return msg is not None and "Traceback" not in json.dumps(msg) and (not isinstance(msg, str) or "\n" not in msg)


def _raises_version(raw: bytes) -> bool:
    """A well-formed align_version above the version held (0): valid input that changes the version."""
    try:
        v = json.loads(raw).get("version")
    except (ValueError, AttributeError, RecursionError):
        return False
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < 2 ** 63


FUZZ = settings(max_examples=CASES, derandomize=True, database=None, deadline=None,
                suppress_health_check=list(HealthCheck))


def _expect_refusal(conns, route, method, auth, junk, where, raw, path=None):
    """A request that must not pass: not loopback (403), a bad token (401), else the route's own 4xx."""
    conn = conns.get(where) or conns["lo"]
    status, body = call(conn, method, path or route, raw=raw, headers=_headers(auth, junk))
    _record(route, status)
    if where == "remote" and "remote" in conns:
        assert status == 403, (route, auth, status, body)
    elif auth != "right":
        assert status == 401, (route, auth, status, body)
    return status, body


# ------------------------------------------------------------------------------------------ one route at a time
@pytest.mark.parametrize("route", GET_ROUTES)
def test_get_routes_refuse_what_they_must(conns, before, route):
    """GET routes: right token from loopback answers 200 whatever the query and body; anything else 401/403."""

    @FUZZ
    @given(auth=AUTH, junk=st.text(max_size=40).filter(lambda s: s.isprintable() and s.isascii()),
           where=st.sampled_from(["lo", "remote"]), body=bodies(),
           query=st.dictionaries(st.sampled_from(["version", "txid", "n", "x"]), st.text(max_size=10), max_size=2))
    def run(auth, junk, where, body, query):
        q = "&".join(f"{k}={v.encode().hex()}" for k, v in query.items())
        status, resp = _expect_refusal(conns, route, "GET", auth, junk, where,
                                       body[1] if body[0] != "huge" else None, path=route + (f"?{q}" if q else ""))
        if status == 200:
            assert auth == "right" and (where == "lo" or "remote" not in conns), (route, auth, where)
        else:
            assert _clear_error(status, resp), (route, status, resp)

    run()
    assert TRIED[route]["cases"] >= CASES
    assert _state(conns) == before


@pytest.mark.parametrize("route", POST_ROUTES)
def test_post_routes_answer_bad_input_with_one_clear_4xx(conns, before, route):
    """POST routes: every malformed, mistyped, huge or unauthorised body gets one clear 4xx; an abort of an
    unknown transaction is idempotent (200, nothing to undo); the weights and version never move."""

    @FUZZ
    @given(auth=AUTH, junk=st.text(max_size=40).filter(lambda s: s.isprintable() and s.isascii()),
           where=st.sampled_from(["lo", "lo", "remote"]), body=bodies())
    def run(auth, junk, where, body):
        hypothesis.assume(not (route.endswith("/align_version") and _raises_version(body[1])))
        status, resp = _expect_refusal(conns, route, "POST", auth, junk, where, body[1])
        if status < 300:  # only an abort of a transaction nobody prepared, or a release of the version held
            assert auth == "right" and route.endswith(("/abort", "/release")) and resp.get("ok"), (body, resp)
            assert route.endswith("/release") or resp.get("state") == "unchanged", (body, resp)
        else:
            assert _clear_error(status, resp), (route, body[0], body[1][:200], status, resp)

    run()
    assert TRIED[route]["cases"] >= CASES
    assert _state(conns) == before


# ------------------------------------------------------------------------------------------ sequences
class _Interposed(HttpTarget):
    """This server as a fleet's engine, its commit phase replaced: after the real prepare, the drawn malformed
    commits go in (each must be refused), then the phase fails, so the fleet aborts the prepared update."""

    def __init__(self, url, commits):
        super().__init__(url, token=TOKEN)
        self.commits, self.txid, self.seen = commits, None, []

    def phase(self, phase, args, timeout_s=None):
        if phase != "commit":
            return super().phase(phase, args, timeout_s)
        self.txid = args["req"]["txid"]
        for body in self.commits:
            self.seen.append(call(_CONN[0], "POST", P + "/refit/commit", raw=body(args),
                                  headers=_headers("right", "")))
        raise RefitError("the fuzz stops this update before it commits", kind="refused")


_CONN: list = []


INFLIGHT = ("recompute", "abort", "keep", "refuse")


def _int_ok(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2 ** 63


def _malformed_commit():
    bad_req = st.fixed_dictionaries({"txid": st.text(max_size=8) | JSON}, optional={"version": JSON,
                                                                                     "inflight": JSON})
    return st.one_of(
        st.builds(lambda r: lambda a: _dumps({"req": r, "n": 1}), bad_req),  # another txid, bad fields
        st.builds(lambda n: lambda a: _dumps({"req": a["req"], "n": n}),
                  JSON.filter(lambda v: not (_int_ok(v) and v >= 1))),
        # (null, a version >= 0 and a known inflight mode are valid: such a commit would commit)
        st.builds(lambda v: lambda a: _dumps({"req": {**a["req"], "version": v}, "n": 1}),
                  JSON.filter(lambda v: v is not None and not _int_ok(v))),
        st.builds(lambda k: lambda a: _dumps({"req": {**a["req"], "inflight": k}, "n": 1}),
                  (st.text(max_size=8) | JSON).filter(lambda k: k is not None and k not in INFLIGHT)),
        st.builds(lambda b: lambda a: b, bodies().map(lambda kb: kb[1])))


def test_sequences_prepare_then_malformed_commits_then_abort(server, conns, before, tmp_path_factory):
    """A real prepare (the fleet path with shm), then malformed commits (each refused, the weights unchanged),
    then the fleet aborts it; a commit of the aborted update and of never-prepared ones is refused too."""
    from safetensors.torch import load_file

    port, _ = server
    _CONN[:] = [conns["lo"]]
    new = R.perturbed_copy(model_path(), str(tmp_path_factory.mktemp("w") / "B"), scale=1.0, seed=7)
    sd = sorted(load_file(os.path.join(new, "model.safetensors")).items())
    route = P + "/refit/commit (after a prepare)"

    @settings(max_examples=12, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(commits=st.lists(_malformed_commit(), min_size=40, max_size=45))
    def run(commits):
        t = _Interposed(f"http://127.0.0.1:{port}", commits)
        with pytest.raises(RefitError) as e:
            push_weights([t], sd, transport="shm")
        assert t.txid is not None, e.value
        for status, resp in t.seen:
            _record(route, status)
            assert _clear_error(status, resp), (status, resp)
        for txid in (t.txid, t.txid + "-never", "never-prepared"):  # aborted; never prepared
            status, resp = call(conns["lo"], "POST", P + "/refit/commit", {"req": {"txid": txid, "version": 9},
                                                                           "n": 1}, token=TOKEN)
            _record(P + "/refit/commit (aborted or never prepared)", status)
            assert _clear_error(status, resp), (txid, status, resp)
            status, resp = call(conns["lo"], "POST", P + "/refit/abort", {"txid": txid}, token=TOKEN)
            _record(P + "/refit/abort (aborted or unknown, again)", status)
            assert status == 200 and resp["ok"] and resp["state"] == "unchanged", resp
        assert _state(conns) == before

    run()
    assert TRIED[route]["cases"] >= CASES


def test_write_the_counts(server):
    """The cases tried per route, printed and written to benchmarks/results/."""
    out = {"vllm": vllm_version(), "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
           "seed": "hypothesis derandomize=True", "cases_per_route": TRIED,
           "unchanged_state_violations": 0, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for route, t in sorted(TRIED.items()):
        print(f"{route}: {t}")
    assert all(t["cases"] >= CASES for r, t in TRIED.items() if "again" not in r and "never" not in r), TRIED
    if os.environ.get("SERVE_FUZZ_RESULTS"):  # (a run for the record: benchmarks/results/serve_fuzz-*.json)
        Path(os.environ["SERVE_FUZZ_RESULTS"]).write_text(json.dumps(out, indent=1))
