"""RL defaults on each entry point (LLM/EngineArgs, AsyncEngineArgs/AsyncLLM, the `vllm serve` CLI):
logprobs_mode, generation_config, the prefix-cache policy's config side and async scheduling; the
plugin's default unless the user passed it, with provenance; stock when disabled.

Each case runs in a fresh interpreter so the `.pth` start-up hook is exercised as users get it."""

import json

import pytest

from support.env import SCRIPTS, model_path
from support.runs import run_py

ALL_MODES = ["engine_args", "engine_args:raw+auto", "async_engine_args", "async_engine_args:raw+auto", "cli",
             "cli:raw+auto", "engine_args:head", "cli:head"]
ENTRY = ["engine_args", "async_engine_args", "cli"]


def _run(modes, **env):
    import subprocess
    import sys

    from support.env import clean_env

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


@pytest.mark.parametrize("mode", ENTRY)
def test_generation_config_is_neutral_by_default(enabled, mode):
    """The shipped models' generation_config.json says temperature 0.6 / top-p 0.8 / top-k 20: with the
    plugin those do not become the engine's default sampling."""
    r = enabled[0][mode]
    assert r["generation_config"] == "vllm" and r["default_sampling"] == {}
    p = r["provenance"]["generation_config"]
    assert (p["source"], p["owner"], p["stock"]) == ("plugin", "rl_defaults", "auto")


@pytest.mark.parametrize("mode", ENTRY)
def test_async_scheduling_and_prefix_caching_left_to_vllm_with_provenance(enabled, mode):
    p = enabled[0][mode]["provenance"]
    assert p["async_scheduling"]["source"] == "stock" and p["async_scheduling"]["owner"] == "rl_defaults"
    assert p["enable_prefix_caching"]["source"] == "stock" and p["enable_prefix_caching"]["owner"] == "prefix_cache"
    assert "salt" in p["enable_prefix_caching"]["reason"]


@pytest.mark.parametrize("mode", [f"{m}:raw+auto" for m in ENTRY])
def test_explicit_raw_and_auto_stay(enabled, mode):
    r = enabled[0][mode]
    assert r["logprobs_mode"] == "raw_logprobs" and r["generation_config"] == "auto"
    assert r["default_sampling"] == {"temperature": 0.6, "top_p": 0.8, "top_k": 20}
    assert r["provenance"]["logprobs_mode"]["source"] == "user"
    assert r["provenance"]["generation_config"]["source"] == "user"


def test_explicit_generation_config_warns_once_with_the_rl_consequence(enabled):
    lines = [l for l in enabled[1].splitlines() if "generation_config='auto' was set explicitly" in l]
    assert len(lines) == 1 and "WARNING" in lines[0] and "trainer may not know" in lines[0], lines


def test_explicit_raw_warns_once_with_the_rl_consequence(enabled):
    log = enabled[1]
    lines = [l for l in log.splitlines() if "logprobs_mode='raw_logprobs' was set explicitly" in l]
    assert len(lines) == 1, lines  # three entry points, one process: one WARNING
    assert "NOT the behaviour policy's" in lines[0] and "WARNING" in lines[0]


def test_decisions_are_logged_once(enabled):
    log = enabled[1]
    assert sum("vllm-rlpatch: logprobs_mode='processed_logprobs' (plugin" in l for l in log.splitlines()) == 1


def test_kill_switch_restores_stock():
    out, log = _run(ENTRY, VLLM_RLPATCH_ENABLED="0")
    for r in out.values():
        assert r["logprobs_mode"] == "raw_logprobs" and r["worker_extension_cls"] == ""
        assert r["generation_config"] == "auto" and r["default_sampling"]["temperature"] == 0.6
        assert r["provenance"] == {}
    assert "applied=[]" in log


def test_rl_defaults_toggle_restores_stock_logprobs_and_generation_config():
    out, _ = _run(["engine_args", "cli"], VLLM_RLPATCH_RL_DEFAULTS="0")
    for r in out.values():
        assert r["logprobs_mode"] == "raw_logprobs" and "logprobs_mode" not in r["provenance"]
        assert r["generation_config"] == "auto" and "generation_config" not in r["provenance"]
        assert r["worker_extension_cls"].endswith("RLPatchWorkerExtension")  # other patches unaffected


def test_prefix_cache_off_disables_caching_unless_the_user_enabled_it():
    out, log = _run([*ENTRY, *(f"{m}:pc" for m in ENTRY)], VLLM_RLPATCH_PREFIX_CACHE="off")
    for m in ENTRY:
        assert out[m]["enable_prefix_caching"] is False
        assert out[m]["provenance"]["enable_prefix_caching"]["source"] == "plugin"
        assert out[f"{m}:pc"]["enable_prefix_caching"] is True
        assert out[f"{m}:pc"]["provenance"]["enable_prefix_caching"]["source"] == "user"
    warn = [l for l in log.splitlines() if "enable_prefix_caching=True was set explicitly" in l]
    assert len(warn) == 1 and "salts requests" in warn[0], warn


def test_prefix_cache_mode_is_validated():
    r = run_py("from vllm.engine.arg_utils import EngineArgs; EngineArgs(model='x')",
               VLLM_RLPATCH_PREFIX_CACHE="sometimes")
    assert r.returncode != 0
    assert "VLLM_RLPATCH_PREFIX_CACHE='sometimes' is not valid; use one of: salt, reset, off, stock" in r.stderr


def test_invalid_env_value_is_a_clear_error():
    r = run_py("from vllm.engine.arg_utils import EngineArgs; EngineArgs(model='x')",
               VLLM_RLPATCH_RL_DEFAULTS="sometimes")
    assert r.returncode != 0
    assert "VLLM_RLPATCH_RL_DEFAULTS='sometimes' is not a boolean" in r.stderr


@pytest.mark.parametrize("mode", ["engine_args", "async_engine_args", "cli"])
def test_fp32_head_unless_the_user_set_a_head_dtype(enabled, mode):
    """vLLM >= 0.32: the config's head_dtype becomes float32 (vLLM then projects in fp32 itself); < 0.32 has
    no head dtype for generation models, so the plugin's LogitsProcessor does it (the config keeps bf16)."""
    from packaging.version import Version

    out, log = enabled
    r = out[mode]
    p = r["provenance"]["head_dtype"]
    assert (p["source"], p["owner"], p["value"]) == ("plugin", "fp32_lm_head", "float32"), p
    native = Version(r["vllm"].split("+")[0]) >= Version("0.32")
    assert r["head_dtype"] == ("torch.float32" if native else "torch.bfloat16"), r
    if mode != "cli":
        return
    user = out["cli:head"] if mode == "cli" else out["engine_args:head"]
    for u in (user, out["engine_args:head"]):
        assert u["head_dtype"] == "torch.bfloat16" and u["provenance"]["head_dtype"]["source"] == "user", u
    assert "head_dtype='bfloat16' was set explicitly and is kept" in log