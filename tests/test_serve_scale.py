"""Scale-out on one host: `vllm serve --api-server-count 2 --data-parallel-size 2` (two API server processes
behind one port, two engine cores). One refit over HTTP lands on one API server process; it reaches every
engine, both API server processes answer with the new version, and the version spans of responses from each
process are right (the new weights sampled those tokens: logprobs against a reference model of them).

Which process answered: the kernel hands each TCP connection to one of the processes listening on the port; a
persistent connection's /rlpatch/v1/weight_version names the process ("api_server": its pid), and every later
request on that connection goes to the same process. Newest CI version only (CI time)."""

import http.client
import json
import subprocess
import sys

import pytest

from support import reference as R
from support.env import SCRIPTS, clean_env, model_path, skip_unless_newest, vllm_version
from support.servers import call, vllm_serve

pytestmark = pytest.mark.vllm

P = "/rlpatch/v1"
PROMPTS = ["the quick cat sees", "12 + 7 =", "a b c d", "one two three"]
SCALE = ["--api-server-count", "2", "--data-parallel-size", "2"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    skip_unless_newest(vllm_version(), "the scale-out server")
    # no VLLM_RLPATCH_HTTP_TOKEN: the API server processes generate one token between them
    with vllm_serve(tmp_path_factory.mktemp("scale") / "server.log", SCALE) as (url, log, port):
        yield url, log, port


def _token(port) -> str:
    from vllm_rlpatch.refit.http import token_path

    with open(token_path(port)) as fh:
        return fh.read().strip()


@pytest.fixture(scope="module")
def per_process(server):
    """A function returning {pid: a persistent connection to that API server process}, both processes found,
    fresh at each call: the server closes an idle connection after a few seconds (uvicorn's keep-alive), and a
    new connection may land on the other process."""
    _, _, port = server
    tok = _token(port)
    opened = []

    def connect() -> dict:
        found, spare = {}, []
        for _ in range(64):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            opened.append(conn)
            status, body = call(conn, "GET", P + "/weight_version", token=tok)
            assert status == 200, body  # every process answers to the token in the file
            if body["api_server"] in found:
                spare.append(conn)
            else:
                found[body["api_server"]] = conn
            if len(found) == 2:
                break
        for c in spare:
            c.close()
        assert len(found) == 2, f"64 connections all went to {list(found)}"
        return found

    yield connect
    for c in opened:
        c.close()


def _completions(conn, n_tokens=12):
    body = {"model": model_path(), "prompt": PROMPTS, "max_tokens": n_tokens, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    status, out = call(conn, "POST", "/v1/completions", body)
    assert status == 200, out
    return out["choices"]


def _check_state(conns, tok, version, engines=2):
    fps = set()
    for pid, conn in conns.items():
        status, v = call(conn, "GET", P + "/weight_version", token=tok)
        assert status == 200 and v["api_server"] == pid
        assert v["workers"] == [version] * engines and v["version"] == version, (pid, v)
        _, fp = call(conn, "GET", P + "/fingerprint", token=tok)
        assert len(fp["workers"]) == engines
        fps.add(json.dumps(fp["workers"][0], sort_keys=True))
        assert all(w == fp["workers"][0] for w in fp["workers"]), "the engines hold different weights"
    assert len(fps) == 1, "the API server processes see different weights"
    return fps.pop()


def test_both_api_servers_and_both_engines_take_one_refit(server, per_process, tmp_path):
    url, log, port = server
    tok = _token(port)
    fp0 = _check_state(per_process(), tok, 0)
    for conn in per_process().values():
        assert all(c["rlpatch_weight_versions"] == [[0, 12, 0, 0]] for c in _completions(conn))
    new = R.perturbed_copy(model_path(), str(tmp_path / "B"), scale=1.0, seed=7)
    spec = tmp_path / "trainer.json"
    spec.write_text(json.dumps({"url": url, "weights": new, "kw": {"transport": "shm"}}))
    p = subprocess.run([sys.executable, str(SCRIPTS / "http_trainer.py"), str(spec)], capture_output=True,
                       text=True, timeout=600, env=clean_env())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(lines[-1][7:])
    assert r["ok"] and r["version"] == 1, r
    assert len(r["report"]["workers"]) == 2, r["report"]  # one worker per engine core, both committed
    assert _check_state(per_process(), tok, 1) != fp0
    model = R.load(new)
    answers = {pid: _completions(conn) for pid, conn in per_process().items()}  # both asked before the slow part
    for pid, choices in answers.items():
        for ch, prompt in zip(choices, PROMPTS):
            assert ch["rlpatch_weight_versions"] == [[0, 12, 1, 1]], (pid, ch)
            ids = ch.get("prompt_token_ids") or R.tokenize(model_path(), prompt)
            ref = R.token_logprobs(model, ids, ch["token_ids"])
            assert R.mismatch(ch["logprobs"]["token_logprobs"], ref)["token_mult_prob_error"] <= 1.02, (pid, ch)


def test_a_fleet_update_through_either_process_reaches_both_engines(server, per_process, tmp_path):
    """The fleet phases (prepare, commit, release) as calls to the server: each may land on either process."""
    url, _, port = server
    tok = _token(port)
    new = R.perturbed_copy(model_path(), str(tmp_path / "C"), scale=1.0, seed=8)
    spec = tmp_path / "trainer.json"
    spec.write_text(json.dumps({"url": url, "weights": new, "kw": {"transport": "shm"}, "fleet": True}))
    p = subprocess.run([sys.executable, str(SCRIPTS / "http_trainer.py"), str(spec)], capture_output=True,
                       text=True, timeout=600, env=clean_env())
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(lines[-1][7:])
    assert r["ok"] and r["report"]["state"] == "committed" and r["version"] == 2, r
    _check_state(per_process(), tok, 2)
    for pid, conn in per_process().items():
        assert all(c["rlpatch_weight_versions"] == [[0, 12, 2, 2]] for c in _completions(conn)), pid
