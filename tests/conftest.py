import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.reports import TestReport
from _pytest.runner import runtestprotocol

import vllm_rlpatch.plugin  # noqa: F401 - the composition root hands the patch list to the registry

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "scripts"

# The suite tests the plugin, not torch.compile: with enforce_eager vLLM still compiles a few helpers with
# torch.compile at start-up, and on these CPUs inductor's ISA checks alone spawn Python subprocesses. With
# dynamo off an engine starts in ~21 s instead of ~34 s (vLLM 0.25.1 and 0.32.0 measured here), over ~30
# engines per vLLM version. The bare-LLM test switches it back on (it checks vLLM as a user runs it);
# RLPATCH_TEST_TORCH_COMPILE=1 keeps it on everywhere.
if os.environ.get("RLPATCH_TEST_TORCH_COMPILE", "0") != "1":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

SUMMARY_RE = re.compile(r"vllm-rlpatch: pid=(\d+) role=(\S+) vllm=(\S+) \(([^)]*)\) applied=\[([^\]]*)\] "
                        r"skipped=\[([^\]]*)\] failed=\[([^\]]*)\]")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


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


# vLLM as installed, minus nothing it needs to run on this host: every RL patch off, host fixes kept.
STOCK = {"VLLM_RLPATCH_PROFILE": "stock"}


def model_path(name: str = "llama-tiny") -> str:
    from vllm_rlpatch.models import path

    return path(name)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def summaries_in(log: str) -> list[dict]:
    """The plugin's per-process summary lines in a vLLM log, as dicts."""
    return [dict(zip(("pid", "role", "vllm", "dist", "applied", "skipped", "failed"), g))
            for g in SUMMARY_RE.findall(log)]


def result_json(line: str):
    """The JSON of a script's ``RESULT {...}`` line; text another thread wrote onto the same line after it
    (Ray forwards its actors' output to the driver's stdout) is ignored."""
    return json.JSONDecoder().raw_decode(line[len("RESULT "):].lstrip())[0]


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
        return _explain_deaths(self.result, self.log)


def run_engine(tmp_path: Path, spec: dict, timeout: float = 600, **env: str) -> EngineRun:
    status_dir = tmp_path / "status"
    e = clean_env(VLLM_RLPATCH_STATUS_DIR=str(status_dir), **env)
    proc = subprocess.run([sys.executable, str(SCRIPTS / "run_engine.py"), json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, env=e, cwd=str(tmp_path))
    return EngineRun(proc, status_dir)


_PROC_RE = re.compile(r"^\(([A-Za-z_][\w-]*)(?:[^)]*?)pid=(\d+)\)\s?")
_DEATH_WORDS = ("EngineDeadError", "EngineCore encountered", "died unexpectedly", "EngineGenerateError")


def process_tails(log: str, n: int = 12) -> str:
    """The last ``n`` lines each vLLM process wrote (engine core and workers prefix theirs with
    ``(Name pid=N)``; the rest is the front end), plus every line that reports a process death: what an
    `EngineDeadError` ("see stack trace above") refers to, when no stack trace is above it."""
    by_proc: dict[str, list[str]] = {}
    deaths = []
    for line in log.splitlines():
        m = _PROC_RE.match(line)
        key = f"{m.group(1)} pid={m.group(2)}" if m else "front end"
        by_proc.setdefault(key, []).append(line)
        if any(w in line for w in ("died unexpectedly", "Illegal instruction", "Segmentation fault", "exit code: -")):
            deaths.append(line)
    parts = ["--- process deaths ---", *(deaths or ["(none reported)"])]
    for key, lines in by_proc.items():
        parts.append(f"--- last {min(n, len(lines))} lines of {key} ---")
        parts.extend(lines[-n:])
    return "\n".join(parts)


def _explain_deaths(obj, log: str):
    """Append the processes' last log lines to every reported error that says the engine died."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "error" and isinstance(v, str) and any(w in v for w in _DEATH_WORDS):
                obj[k] = v + "\n" + process_tails(log)
            else:
                _explain_deaths(v, log)
    elif isinstance(obj, list):
        for v in obj:
            _explain_deaths(v, log)
    return obj


def run_script(script: str, *args: str, cwd=None, timeout: float = 900, **env: str) -> tuple[dict, str]:
    """Run tests/scripts/SCRIPT in a fresh interpreter; return (its `RESULT {...}` line, stdout+stderr).
    An error in the result that says the engine died carries every vLLM process's last log lines."""
    p = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                       timeout=timeout, env=clean_env(**env), cwd=None if cwd is None else str(cwd))
    log = p.stdout + p.stderr
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, log[-6000:] + "\n" + process_tails(log)
    return _explain_deaths(result_json(lines[-1]), log), log


def run_py(code: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**env))


@pytest.fixture(scope="session")
def version() -> str:
    return vllm_version()


# The newest vLLM of the CI matrix. Tests of our command-line tools (their logic does not depend on the vLLM
# version: the engine runs the same patches every other test covers per version) run there only (CI time).
NEWEST_CI = "0.32.0"


def skip_unless_newest(version: str, what: str) -> None:
    if version.split("+")[0] != NEWEST_CI:
        pytest.skip(f"{what} runs on the newest CI version ({NEWEST_CI}) only (CI time)")


# ---------------------------------------------------------------------------------------------------------
# `@pytest.mark.forked`: run the test in a forked child (tests that change process-global patch state).
# pytest-forked does not work with pytest 9, so this is the same idea in a few lines.
def pytest_configure(config):
    config.addinivalue_line("markers", "forked: run this test in a forked subprocess")


def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker("forked") is None:
        return None
    ihook = item.ihook
    ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            reports = runtestprotocol(item, log=False, nextitem=None)
            payload = [item.config.hook.pytest_report_to_serializable(config=item.config, report=rep)
                       for rep in reports]
            data = json.dumps(payload).encode()
        except BaseException as e:  # noqa: BLE001 - report anything to the parent
            data = json.dumps({"crash": repr(e)}).encode()
            code = 1
        with os.fdopen(w, "wb") as fh:
            fh.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    try:
        payload = json.loads(data) if data else {"crash": f"child died (wait status {status})"}
    except ValueError:
        payload = {"crash": f"unreadable child report (wait status {status})"}
    if isinstance(payload, dict):
        reports = [TestReport(item.nodeid, item.location, {}, "failed",
                              f"forked test crashed: {payload['crash']}", "call", [])]
    else:
        reports = [item.config.hook.pytest_report_from_serializable(config=item.config, data=d) for d in payload]
        for rep in reports:  # JSON turned the (path, lineno, reason) tuple of a skip into a list
            if isinstance(rep.longrepr, list):
                rep.longrepr = tuple(rep.longrepr)
    for rep in reports:
        ihook.pytest_runtest_logreport(report=rep)
    ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True
