"""An unknown ``VLLM_RLPATCH_*`` name is a WARNING with the closest known name (README), logged once per
process by every command that reads the environment: ``doctor`` read it twice (once itself, once through the
plugin it registers) and logged it twice; ``patches`` never logged it. No engine: the CLI in a subprocess."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick

UNKNOWN = "VLLM_RLPATCH_FOO"
LOGGED = f"vllm-rlpatch: unknown environment variable {UNKNOWN} (ignored)"  # the log line, not doctor's report


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env[UNKNOWN] = "1"
    return subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", *argv], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.parametrize("command", ["patches", "doctor"])
def test_an_unknown_variable_is_logged_once_per_process(command):
    p = _cli(command)
    assert p.returncode == 0, p.stderr[-3000:]
    log = p.stdout + p.stderr
    assert log.count(LOGGED) == 1, log[-3000:]
    assert f"{LOGGED}; did you mean VLLM_RLPATCH_PROFILE?" in log
