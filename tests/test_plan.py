"""The copy plan, the post-write window check and the window backup on real vLLM model classes, built on CPU
without an engine (tests/scripts/plan_cpu.py): the plan path the GPU takes, exercised on every CI version.

vLLM's CPU engines repack their weights after loading (so a CPU engine always takes the layerwise path); the
model built here is loaded by its own ``load_weights`` only, so its parameters keep the checkpoint layout, as
on a GPU."""

import pytest

from support import reference as R
from support.env import model_path
from support.runs import run_script

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", params=["llama-tiny", "qwen2-tiny"])
def result(request, tmp_path_factory):
    name = request.param
    b = R.perturbed_copy(model_path(name), str(tmp_path_factory.mktemp("w") / f"{name}-B"), scale=1.0, seed=7)
    r, _ = run_script("plan_cpu.py", model_path(name), b, timeout=600)
    return r


def test_capture_verify_and_replay_equal_a_fresh_load(result):
    r = result
    assert r["verify"] is None and r["copies"] >= r["names"] and r["all_whole_source"], r
    assert r["params"] < r["names"]  # fused layers: several trainer tensors land in one parameter (qkv, gate_up)
    assert r["tied"] == (r["model"] == "Qwen2ForCausalLM")
    assert r["preconditions_ok"] is None
    assert r["replay_changed_something"] and r["replay_equals_fresh_load"], r["replay_differ"]


def test_window_digests_are_the_sources_and_catch_a_corrupt_window(result):
    assert result["window_digests_match"] and result["corruption_detected"]


def test_a_repointed_parameter_invalidates_the_plan(result):
    assert result["live_primed"] == [None, None]
    assert "no longer lives where the plan recorded it" in result["live_after_repoint"]
    assert result["live_after_restore"] is None


def test_a_parameter_replaced_on_the_model_invalidates_the_plan(result):
    r = result
    assert r["holders"] >= r["params"]
    qual, why = r["live_after_replace"]
    assert why.startswith(f"{qual}: the model's tensor there was replaced"), r["live_after_replace"]
    assert r["live_same_storage"] is None and r["live_after_put_back"] == [None, None]


def test_validate_then_write_proves_its_preconditions(result):
    r = result
    assert "not contiguous" in r["pre_noncontiguous"]
    assert "dtype torch.float32 != torch.bfloat16" in r["pre_dtype"] and r["pre_dtype_cast_ok"] is None
    assert "overlaps the model's parameters" in r["pre_overlap"]


def test_a_fault_after_the_first_write_is_rolled_back_from_the_arena(result):
    r = result
    assert r["fault"] == "injected fault after the first write" and r["written_before_fault"] == 2
    assert r["restored_bit_identical"] and r["backup_bytes"] > 0
    assert r["arena_reused"] and r["arena_capacity"] >= r["backup_bytes"]
