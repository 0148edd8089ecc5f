"""A real `vllm serve` for a test module: started with the CPU sizing, waited for, its log kept, stopped with its
whole process group. `vllm serve` itself runs from tests/scripts/vllm_serve.py (the console script of the CPU
wheels dies at start; `python -m vllm.entrypoints.openai.api_server` ignores --api-server-count)."""

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from support.env import SCRIPTS, clean_env, model_path

CPU_SIZING = ["--dtype", "bfloat16", "--max-model-len", "256", "--kv-cache-memory-bytes", str(32 << 20),
              "--enforce-eager", "--gpu-memory-utilization", "0.5"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def healthy(p: subprocess.Popen, url: str, log_path, start_s: float = 420):
    """Wait until the server process ``p`` answers ``url``/health (fail with its log if it exits or never does);
    on exit stop its whole process group."""
    try:
        deadline = time.time() + start_s
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
        yield
    finally:
        os.killpg(p.pid, 15)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)


@contextlib.contextmanager
def vllm_serve(log_path, args: list[str], env: dict[str, str] | None = None, start_s: float = 420):
    """Yields (url, log_path, port) once /health answers; the server binds every interface."""
    port = free_port()
    with open(log_path, "w") as log:
        p = subprocess.Popen([sys.executable, str(SCRIPTS / "vllm_serve.py"), "--model", model_path(), "--host",
                              "0.0.0.0", "--port", str(port), *CPU_SIZING, *args],
                             stdout=log, stderr=subprocess.STDOUT, env=clean_env(**(env or {})),
                             start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        with healthy(p, url, log_path, start_s):
            yield url, log_path, port


def non_loopback_ip() -> str | None:
    for probe in ("10.255.255.255", "192.0.2.1"):  # UDP connect sends nothing; it picks the source address
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((probe, 9))
                ip = s.getsockname()[0]
                if not ip.startswith("127."):
                    return ip
        except OSError:
            continue
    return None


def call(conn, method: str, path: str, body=None, token: str | None = None, raw: bytes | None = None,
         headers: dict | None = None):
    """One request on a persistent ``http.client`` connection: (status, parsed JSON or the raw text)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    if token is not None:
        hdrs["Authorization"] = f"Bearer {token}"
    for attempt in (1, 2):
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode("utf-8", "replace")
            break
        except (OSError, http.client.HTTPException):
            # the server answered early and closed (a refusal before the body was read): a new connection
            conn.close()
            if attempt == 2:
                raise
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text
