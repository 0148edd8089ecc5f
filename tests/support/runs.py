"""Running tests/scripts and engines in fresh interpreters (the plugin's process-global state stays out of
the pytest process), with the environment of :func:`support.env.clean_env`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from support.env import SCRIPTS, clean_env
from support.logs import explain_deaths, process_tails, result_json, summaries_in


class EngineRun:
    def __init__(self, proc: subprocess.CompletedProcess, status_dir: Path):
        self.proc = proc
        self.log = proc.stdout + proc.stderr
        m = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        self.result = result_json(m[-1]) if m else None
        self.status_dir = status_dir

    def summaries(self) -> list[dict]:
        return summaries_in(self.log)

    def status_files(self) -> list[dict]:
        if not self.status_dir.exists():
            return []
        return [json.loads(p.read_text()) for p in sorted(self.status_dir.glob("*.json"))]

    def check(self):
        assert self.proc.returncode == 0 and self.result is not None, self.log[-6000:] + "\n" + process_tails(self.log)
        return explain_deaths(self.result, self.log)


def run_engine(tmp_path: Path, spec: dict, timeout: float = 600, **env: str) -> EngineRun:
    status_dir = tmp_path / "status"
    e = clean_env(VLLM_RLPATCH_STATUS_DIR=str(status_dir), **env)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_engine.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=e, cwd=str(tmp_path))
    return EngineRun(proc, status_dir)


def run_script(script: str, *args: str, cwd=None, timeout: float = 900, **env: str) -> tuple[dict, str]:
    """Run tests/scripts/SCRIPT in a fresh interpreter; return (its `RESULT {...}` line, stdout+stderr).
    An error in the result that says the engine died carries every vLLM process's last log lines."""
    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                       timeout=timeout, env=clean_env(**env), cwd=None if cwd is None else str(cwd))
    log = p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, log[-6000:] + "\n" + process_tails(log)
    return explain_deaths(result_json(lines[-1]), log), log


def run_py(code: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))
