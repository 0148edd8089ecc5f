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


@pytest.mark.parametrize("target", all_targets(NEWEST))
def test_target_resolves_in_newest_release(tree, target):
    ok, detail = resolve_in_source(tree, target)
    assert ok, f"vLLM {NEWEST}: {detail} (API drift: the patch would report `unsupported`)"


def test_resolver_reports_missing_targets(tree):
    ok, detail = resolve_in_source(tree, "vllm.engine.arg_utils:EngineArgs.no_such_method")
    assert not ok and "missing" in detail
    ok, _ = resolve_in_source(tree, "vllm.engine.arg_utils:AsyncEngineArgs.__init__")
    assert ok
