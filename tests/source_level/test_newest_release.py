"""vLLM's newest release is a CUDA-only wheel: check at source level that every target the plugin wraps
still exists in its Python tree (the wheel is downloaded once and cached outside the repo)."""

import os

import pytest

from vllm_rlpatch.tools import upstream
from vllm_rlpatch.tools.targets import all_targets, resolve_in_source

NEWEST = os.environ.get("VLLM_RLPATCH_TEST_NEWEST_VLLM", "0.34.0")


@pytest.fixture(scope="module")
def tree():
    return upstream.pristine_tree(NEWEST)


def test_version_of_tree(tree):
    text = (tree / "vllm" / "_version.py").read_text()
    assert NEWEST in text


# Targets a release removed on purpose, with what that means for the patch (each still fails here if it resolves
# again: then the entry is stale).
GONE = {
    "0.34.0": {
        **dict.fromkeys(
            ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
             "vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput.get_output",
             "vllm.v1.sample.sampler:Sampler.sample", "vllm.v1.sample.sampler:Sampler.apply_temperature"),
            "vLLM 0.34 removed the V1 GPU runner and its sampler (Model Runner V2 is the only GPU runner): "
            "sampling_support's V1 half has nothing to wrap there; its MRv2 targets are checked in test_mrv2.py"),
        "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p_triton":
            "vLLM 0.34 moved the Triton top-k/top-p entry to topk_topp_triton.py: mrv2_top_p reports "
            "`unsupported` on 0.34 until it targets the new location",
    },
}


@pytest.mark.parametrize("target", all_targets(NEWEST))
def test_target_resolves_in_newest_release(tree, target):
    ok, detail = resolve_in_source(tree, target)
    gone = GONE.get(NEWEST, {}).get(target)
    if gone is not None:
        assert not ok, f"vLLM {NEWEST}: {target} resolves again; drop its GONE entry"
        pytest.skip(gone)
    assert ok, f"vLLM {NEWEST}: {detail} (API drift: the patch would report `unsupported`)"


def test_resolver_reports_missing_targets(tree):
    ok, detail = resolve_in_source(tree, "vllm.engine.arg_utils:EngineArgs.no_such_method")
    assert not ok and "missing" in detail
    ok, _ = resolve_in_source(tree, "vllm.engine.arg_utils:AsyncEngineArgs.__init__")
    assert ok
