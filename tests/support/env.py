"""The environment a test runs in: the vLLM version, the host's CPU, the embedded models' paths, and an
``os.environ`` for a subprocess with no ``VLLM_RLPATCH_*`` variable of the caller's and tests/ importable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = TESTS / "scripts"

# vLLM as installed, minus nothing it needs to run on this host: every RL patch off, host fixes kept.
STOCK = {"VLLM_RLPATCH_PROFILE": "stock"}

# The newest vLLM of the CI matrix. Tests of our command-line tools (their logic does not depend on the vLLM
# version: the engine runs the same patches every other test covers per version) run there only (CI time).
NEWEST_CI = "0.32.0"


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def skip_unless_newest(version: str, what: str) -> None:
    if version.split("+")[0] != NEWEST_CI:
        pytest.skip(f"{what} runs on the newest CI version ({NEWEST_CI}) only (CI time)")


def amx_host() -> bool:
    """Does this host's CPU have AMX tiles? Read from the CPU flags (``amx_tile`` in /proc/cpuinfo), not from
    torch or vLLM, so the tests' expectations do not come from the code under test."""
    try:
        with open("/proc/cpuinfo") as fh:
            return any(line.startswith("flags") and "amx_tile" in line.split() for line in fh)
    except OSError:
        return False


def amx_sigill_here() -> bool:
    """A host where *stock* vLLM (the plugin's kill switch thrown, so not even cpu_amx_permission) dies with
    SIGILL in its AMX attention kernel: an AMX CPU and vLLM >= 0.28 (seen on 0.28.0 and 0.32.0; 0.20/0.25
    happened to run because a oneDNN GEMM requested the permission first). Tests that need vLLM as installed
    use the `stock` profile instead (VLLM_RLPATCH_PROFILE=stock keeps the host fixes) and run everywhere."""
    from packaging.version import Version

    return amx_host() and Version(vllm_version().split("+")[0]) >= Version("0.28")


def model_path(name: str = "llama-tiny") -> str:
    from vllm_rlpatch.models import path

    return path(name)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env
