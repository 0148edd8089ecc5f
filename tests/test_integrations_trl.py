"""TRL's own GRPOTrainer (colocate mode) against real vLLM with the plugin, and the one-line adapter
(vllm_rlpatch.integrations.trl.use_push_weights).

Everything TRL runs comes from the installed package (ci/envs/integrations/trl.txt, in a cached copy of the
test environment: tests/support/frameworks.py): the trainer builds its own colocated vLLM engine and trains; its
own ``VLLMGeneration.sync_weights`` moves the trained policy into the engine; then the adapter does the same
through ``push_weights`` inside TRL's training loop. After each sync the engine's greedy tokens and logprobs on
two long prompts (their KV computed with the old weights first) must equal a fresh engine loaded from the
trainer's weights, with no KV of the old weights reused. The adapter must refuse an unknown TRL release (a
dist-info of a release it does not know, first on sys.path) and a trainer without vLLM, and a policy with a NaN
is refused by push_weights before any write (the engine answers as before). The script is the benchmark's
(benchmarks/integrations/trl.py), run phase by phase; one model (the tied qwen2-tiny), one training step; vLLM
0.25.1 only (TRL 1.16 supports vLLM 0.22-0.31).
"""

import json
import subprocess

import pytest

from support.env import TESTS, clean_env, model_path
from support.frameworks import framework_python, skip_unless_pinned_vllm

pytestmark = pytest.mark.vllm

SCRIPT = TESTS.parent / "benchmarks" / "integrations" / "trl.py"


def _phase(py, tmp, name, *args):
    out = tmp / f"{name}.json"
    # TRL builds its engine without enforce_eager: torch.compile stays on, as for a user (the suite's
    # TORCHDYNAMO_DISABLE=1, conftest.py, would make vLLM's aot_compile fail at engine start)
    env = {k: v for k, v in clean_env().items() if k != "TORCHDYNAMO_DISABLE"}
    proc = subprocess.run([py, str(SCRIPT), *args, "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    skip_unless_pinned_vllm("trl")
    py = framework_python("trl")
    tmp = tmp_path_factory.mktemp("trl")
    on = _phase(py, tmp, "on", "--phase", "on", "--model", model_path("qwen2-tiny"), "--steps", "1",
                "--work", str(tmp / "work"))
    fresh = _phase(py, tmp, "fresh", "--phase", "fresh", "--dirs", on["weights_trl_sync"], on["weights_adapter"])
    return on, fresh


def _same(a, b):
    assert a["tokens"] == b["tokens"]
    for la, lb in zip(a["logprobs"], b["logprobs"]):
        assert la == pytest.approx(lb, abs=1e-6)


def test_trl_trains_with_its_own_sync_and_the_engine_equals_a_fresh_load(run):
    on, fresh = run
    assert on["train_trl_sync"]["ok"], on["train_trl_sync"]["error"]
    assert on["mismatch_trl_sync"] and all(r["tokens"] > 0 for r in on["mismatch_trl_sync"])
    _same(on["probe_trl_sync"], fresh[on["weights_trl_sync"]])
    assert on["probe_trl_sync"]["cached"] == [0, 0]  # nothing of the old weights' KV
    assert min(on["probe_trl_sync_again"]["cached"]) > 0  # caching still works within one version


def test_adapter_syncs_inside_trls_loop_and_the_engine_equals_a_fresh_load(run):
    on, fresh = run
    assert on["train_adapter"]["ok"], on["train_adapter"]["error"]
    assert on["mismatch_adapter"] and all(r["token_mult_prob_error"] < 1.05 for r in on["mismatch_adapter"])
    rep = on["adapter_report"]
    assert rep["state"] == "committed" and rep["guarantee"] == "rollback"
    assert "strict_reload" in rep["checks"] or "plan_copy" in rep["checks"]
    v0, v1 = on["weight_version_before_after"]
    assert v1 == v0 + 1  # one update, one version
    _same(on["probe_adapter"], fresh[on["weights_adapter"]])
    assert on["probe_adapter"]["cached"] == [0, 0]  # the plugin's policy: no old KV, without a cache reset
    assert min(on["probe_adapter_again"]["cached"]) > 0


def test_adapter_refuses_unknown_release_no_vllm_and_nan_leaving_state_unchanged(run):
    ref = run[0]["refusals"]
    assert ref["unknown_version"]["refused"] and ref["unknown_version"]["trainer_unchanged"]
    assert "1.99.0" in ref["unknown_version"]["message"]
    assert ref["no_vllm"]["refused"]
    nan = ref["nan"]
    assert nan["refused"] and nan["state"] == "unchanged" and nan["engine_unchanged"]
    assert nan["version"][0] == nan["version"][1]
