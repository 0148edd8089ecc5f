"""The suite's pytest fixtures and hooks only; the helpers tests share live in tests/support/ (imported as
``support.<module>``)."""

import json
import os

import pytest
from _pytest.reports import TestReport
from _pytest.runner import runtestprotocol
from support.env import vllm_version

from vllm_rlpatch import plugin

plugin.compose()  # the composition root hands the patch list to the registry

# The suite tests the plugin, not torch.compile: with enforce_eager vLLM still compiles a few helpers with
# torch.compile at start-up, and on these CPUs inductor's ISA checks alone spawn Python subprocesses. With
# dynamo off an engine starts in ~21 s instead of ~34 s (vLLM 0.25.1 and 0.32.0 measured here), over ~30
# engines per vLLM version. The bare-LLM test switches it back on (it checks vLLM as a user runs it);
# RLPATCH_TEST_TORCH_COMPILE=1 keeps it on everywhere.
if os.environ.get("RLPATCH_TEST_TORCH_COMPILE", "0") != "1":
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture(scope="session")
def version() -> str:
    return vllm_version()


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
