"""verl 0.9.1's own weight sync (imported from the installed package) against real vLLM with the plugin, and the
one-line adapter ``vllm_rlpatch.integrations.verl`` (benchmarks/integrations/verl.py does the work; here with
the plugin on, the tied qwen2-tiny, one sync each way). vLLM 0.25.1 only (CI time; verl pins 0.24.0, the nearest
CI environment): the framework's environment is a cached copy of the test environment with
ci/envs/integrations/verl.txt installed."""

from __future__ import annotations

import json
import subprocess

import pytest

from support.env import clean_env
from support.frameworks import ROOT, framework_python, skip_unless_pinned_vllm

pytestmark = pytest.mark.vllm

BENCH = ROOT / "benchmarks" / "integrations" / "verl.py"


@pytest.fixture(scope="module")
def verl_py():
    skip_unless_pinned_vllm("verl")
    return framework_python("verl")


@pytest.fixture(scope="module")
def run(verl_py, tmp_path_factory):
    out = tmp_path_factory.mktemp("verl")
    p = subprocess.run([verl_py, str(BENCH), "--out", str(out), "--models", "qwen2-tiny", "--modes", "on",
                        "--repeats", "1"], capture_output=True, text=True, env=clean_env(), cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (f,) = out.glob("verl-*.json")
    (r,) = json.loads(f.read_text())["runs"]
    assert "error" not in r, r.get("tail")
    return r


def test_verl_own_sync_equals_fresh_load(run):
    assert run["as_is"]["errors"] == [None]
    assert run["as_is"]["vs_fresh"]["equal"], run["as_is"]["vs_fresh"]
    assert run["as_is"]["vs_fresh"]["stale_kv_tokens"] == 0  # no KV of the old weights served


def test_adapter_sync_equals_fresh_load(run):
    a = run["adapter"]
    assert a["errors"] == [None]
    assert a["vs_fresh"]["equal"], a["vs_fresh"]
    assert a["vs_fresh"]["stale_kv_tokens"] == 0
    assert a["report"]["state"] == "committed"


@pytest.mark.parametrize("call", ["delta_flush", "lora"])
def test_adapter_refuses_unsafe_call_state_unchanged(run, call):
    res = run["adapter"][f"unsafe_{call}"]
    assert res["refused"] is True, res
    assert res["state_unchanged"] is True, res


REFUSE = """
import vllm_rlpatch.integrations.verl as rl
from vllm_rlpatch.integrations.support import IntegrationError
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter
before = ServerAdapter.update_weights
rl.KNOWN = "<0.9"
try:
    rl.install()
    print("INSTALLED")
except IntegrationError as e:
    print("REFUSED", ServerAdapter.update_weights is before, "<0.9" in str(e))
"""


def test_unknown_verl_release_refused(verl_py):
    p = subprocess.run([verl_py, "-c", REFUSE], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert "REFUSED True True" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
