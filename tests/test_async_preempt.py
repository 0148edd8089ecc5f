"""vllm#42043 (async scheduling drops the first valid token after a forced preemption), reproduced on vLLM's
real AsyncScheduler (tests/scripts/async_preempt.py; the CPU platform cannot run async scheduling end to
end, the GPU run is in benchmarks/results/async_safety-*.json)."""

import pytest
from packaging.version import Version

from support.env import model_path
from support.runs import run_script

pytestmark = pytest.mark.vllm


def _run(**env):
    return run_script("async_preempt.py", model_path(), timeout=300, **env)


def test_no_valid_token_is_dropped_after_a_forced_preemption(version):
    r, log = _run()
    assert r["drained"] == [100, 102]  # the token sampled after the recompute is kept
    assert r["in_flight"] == [100, 102]  # the output in flight at the preemption is dropped (stale)


def test_unpatched_reproduces_the_bug_where_upstream_has_it(version):
    r, log = _run(VLLM_RLPATCH_ASYNC_PREEMPT_DISCARD="0")
    if Version(version.split("+")[0]) < Version("0.22"):
        assert r["drained"] == [100], r  # vllm#42043: the first valid token after the resume is gone
    else:
        assert r["drained"] == [100, 102], r  # fixed upstream (vllm#42117, 0.22.0): the patch retires itself
        assert "async_preempt_discard" in log.split("skipped=[", 1)[1].split("]", 1)[0]
