"""logprobs_mode on each entry point (LLM/EngineArgs, AsyncEngineArgs/AsyncLLM, the `vllm serve` CLI):
the plugin's default unless the user passed it, with provenance; stock when disabled.

Each case runs in a fresh interpreter so the `.pth` start-up hook is exercised as users get it."""

import json

import pytest

from conftest import SCRIPTS, model_path, run_py

ALL_MODES = ["engine_args", "engine_args:raw", "async_engine_args", "async_engine_args:raw", "cli", "cli:raw"]


def _run(modes, **env):
    import subprocess
    import sys

    from conftest import clean_env

    proc = subprocess.run([sys.executable, str(SCRIPTS / "config_paths.py"), ",".join(modes), model_path()],
                          capture_output=True, text=True, timeout=600, env=clean_env(**env))
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            out[r["mode"]] = r
    assert proc.returncode == 0 and len(out) == len(modes), proc.stdout[-3000:] + proc.stderr[-5000:]
    return out, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def enabled():
    return _run(ALL_MODES)


@pytest.mark.parametrize("mode", ["engine_args", "async_engine_args", "cli"])
def test_default_is_processed_with_plugin_provenance(enabled, mode):
    r = enabled[0][mode]
    assert r["logprobs_mode"] == "processed_logprobs"
    p = r["provenance"]["logprobs_mode"]
    assert (p["source"], p["owner"], p["stock"]) == ("plugin", "rl_defaults", "raw_logprobs")
    assert p["detection"].startswith("captured at"), "explicit-argument capture must be active (.pth hook)"


@pytest.mark.parametrize("mode", ["engine_args:raw", "async_engine_args:raw", "cli:raw"])
def test_explicit_raw_stays_raw(enabled, mode):
    r = enabled[0][mode]
    assert r["logprobs_mode"] == "raw_logprobs"
    assert r["provenance"]["logprobs_mode"]["source"] == "user"


def test_explicit_raw_warns_once_with_the_rl_consequence(enabled):
    log = enabled[1]
    lines = [l for l in log.splitlines() if "logprobs_mode='raw_logprobs' was set explicitly" in l]
    assert len(lines) == 1, lines  # three entry points, one process: one WARNING
    assert "NOT the behaviour policy's" in lines[0] and "WARNING" in lines[0]


def test_decisions_are_logged_once(enabled):
    log = enabled[1]
    assert sum("vllm-rlpatch: logprobs_mode='processed_logprobs' (plugin" in l for l in log.splitlines()) == 1


def test_kill_switch_restores_stock():
    out, log = _run(["engine_args", "async_engine_args", "cli"], VLLM_RLPATCH_ENABLED="0")
    for r in out.values():
        assert r["logprobs_mode"] == "raw_logprobs" and r["worker_extension_cls"] == ""
        assert r["provenance"] == {}
    assert "applied=[]" in log


def test_rl_defaults_toggle_restores_stock_logprobs():
    out, _ = _run(["engine_args", "cli"], VLLM_RLPATCH_RL_DEFAULTS="0")
    for r in out.values():
        assert r["logprobs_mode"] == "raw_logprobs" and "logprobs_mode" not in r["provenance"]
        assert r["worker_extension_cls"].endswith("RLPatchWorkerExtension")  # other patches unaffected


def test_invalid_env_value_is_a_clear_error():
    r = run_py("from vllm.engine.arg_utils import EngineArgs; EngineArgs(model='x')",
               VLLM_RLPATCH_RL_DEFAULTS="sometimes")
    assert r.returncode != 0
    assert "VLLM_RLPATCH_RL_DEFAULTS='sometimes' is not a boolean" in r.stderr
