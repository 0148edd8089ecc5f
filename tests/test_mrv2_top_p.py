"""The mrv2_top_p patch: vLLM's Triton top-k/top-p kernel, run by Triton's interpreter on the CPU with CUDA's
launch constants, keeps one token fewer than the nominal top-p unpatched and the nominal set patched
(tests/scripts/mrv2_top_p_interp.py). The kernel source is the installed vLLM's; one version in CI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_rlpatch.patches import BY_NAME, mrv2_top_p
from vllm_rlpatch.registry import decide

HERE = Path(__file__).resolve().parent
vllm = pytest.importorskip("vllm")
HAS_TRITON = pytest.importorskip("vllm.triton_utils.importing").HAS_TRITON
pytestmark = pytest.mark.skipif(vllm.__version__.split("+")[0] != "0.32.0",
                                reason="the kernel check runs on the 0.32.0 CI env only")


def test_kernel_source_has_the_bug_and_the_edits_apply():
    src = open(mrv2_top_p.kernel_source_path(), encoding="utf-8").read()
    assert mrv2_top_p.has_bug(src)
    fixed = mrv2_top_p.patched_source(src)
    assert not mrv2_top_p.has_bug(fixed) and fixed.count("p_pivot = min_range") == mrv2_top_p.FALLBACK_SITES
    with pytest.raises(ValueError):
        mrv2_top_p.patched_source(fixed)  # an already patched (or upstream-changed) source is refused


def test_registered_and_decided_on():
    assert BY_NAME["mrv2_top_p"] is mrv2_top_p.SPEC and mrv2_top_p.SPEC.fixed_in is None
    # on this CPU host vLLM has no Triton backend: the kernel is never used (the probe says so)
    state, reason = decide(mrv2_top_p.SPEC)
    assert (state, HAS_TRITON) in ((None, True), ("not_needed", False)), (state, reason)


def test_interpreter_repro_fails_unpatched_and_passes_patched():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(HERE / "scripts" / "mrv2_top_p_interp.py")], env=env,
                       capture_output=True, text=True, timeout=600)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-2000:]
    for case in ("constructed", "constructed_topk"):
        assert out["unpatched"][case]["rows_differ"] == out["unpatched"][case]["rows"]
        assert out["unpatched"][case]["kept_minus_nominal"] == {"-1": out["unpatched"][case]["rows"]}
        assert out["patched"][case]["rows_differ"] == 0
