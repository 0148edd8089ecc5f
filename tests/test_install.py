"""The package as a user installs it: the wheel, built from this checkout, in a fresh virtual environment that
has no vLLM (and no torch). The wheel must carry the vLLM entry point and the `.pth` start-up hook; every
command must say in one line what is missing instead of a traceback.

Independent of the vLLM version, so it runs once, with the newest CI version's Python (CI time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.env import skip_unless_newest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, version):
    skip_unless_newest(version, "the install test (independent of the vLLM version)")
    d = tmp_path_factory.mktemp("install")
    wheels = d / "wheels"
    b = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-3000:]
    (wheel,) = wheels.glob("vllm_rlpatch-*.whl")
    env_dir = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=300)
    py = env_dir / "bin" / "python"
    i = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert i.returncode == 0, i.stderr[-3000:]
    return {"py": py, "exe": env_dir / "bin" / "vllm-rlpatch", "wheel": wheel, "dir": d}


def _run(venv, *args, cwd=None):
    return subprocess.run([str(venv["exe"]), *map(str, args)], capture_output=True, text=True, timeout=300,
                          cwd=cwd or venv["dir"], env={"PATH": "/usr/bin:/bin", "HOME": str(venv["dir"])})


def test_the_wheel_carries_the_entry_point_and_the_startup_hook(venv):
    import zipfile

    names = zipfile.ZipFile(venv["wheel"]).namelist()
    assert "vllm_rlpatch_startup.pth" in names
    assert any(n.startswith("vllm_rlpatch/models/llama-tiny/") for n in names)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(venv["wheel"]).read(ep).decode()
    assert "[vllm.general_plugins]" in text and "rlpatch = vllm_rlpatch.plugin:register" in text
    code = ("import json, sysconfig, pathlib; from importlib import metadata; "
            "eps = [e.value for e in metadata.entry_points(group='vllm.general_plugins')]; "
            "pth = pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm_rlpatch_startup.pth'); "
            "import sys; print(json.dumps({'eps': eps, 'pth': pth.exists(), 'hooked': 'vllm_rlpatch._startup' in sys.modules}))")
    r = subprocess.run([str(venv["py"]), "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["eps"] == ["vllm_rlpatch.plugin:register"] and got["pth"], got
    assert got["hooked"], got  # the .pth file ran at interpreter start-up


def test_doctor_without_vllm_says_so_in_one_line(venv):
    p = _run(venv, "doctor")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    missing = [ln for ln in lines if "vLLM" in ln and "NOT INSTALLED" in ln]
    assert len(missing) == 1 and "pip install vllm" in missing[0], p.stdout
    assert "start-up hook" not in p.stdout and "None" not in p.stdout and "fp32" not in p.stdout, p.stdout
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("args", [
    ["demo"], ["parity"], ["doctor", "--model", "llama-tiny"], ["rollout-dump", "--out", "x.jsonl"],
    ["kv-pin", "--model", "llama-tiny"],
])
def test_every_command_that_runs_vllm_exits_2_with_one_line(venv, args):
    p = _run(venv, *args)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, (p.returncode, p.stdout[-1000:], p.stderr[-2000:])
    assert "vLLM is not installed" in err[0] and "pip install vllm" in err[0], err


def test_the_commands_that_need_no_vllm_work_or_name_the_problem(venv, tmp_path):
    p = _run(venv, "bounds", tmp_path / "missing.jsonl", tmp_path / "missing2.jsonl", "--metric", "length_mean")
    assert p.returncode == 2 and "missing.jsonl: no such file" in p.stderr, p.stderr
    h = _run(venv, "rollout-diff", "--help")
    assert h.returncode == 0 and "rollout-diff" in h.stdout, (h.returncode, h.stderr)
    t = _run(venv, "patches")
    assert t.returncode == 0 and "cpu_amx_permission" in t.stdout, t.stderr[-2000:]
