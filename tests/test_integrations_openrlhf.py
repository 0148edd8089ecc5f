"""OpenRLHF's worker extension against real vLLM with the plugin, and the one-line adapter
(``worker_extension_cls="vllm_rlpatch.integrations.openrlhf.WorkerWrap"``).

Two parts:

* engine-free, in CI's default run (seconds): the adapter's version check refuses an OpenRLHF release it does not
  know (a dist-info of that release first on sys.path), names the releases it knows, accepts a known one, and
  accepts an unknown one only with ``VLLM_RLPATCH_OPENRLHF_ANY_VERSION=1``;
* the engine run (two engines, ~1.5-3 min on a 2-core CPU box plus a cold build of the OpenRLHF environment): it
  is the integrations sweep's job (``bash ci/integrations.sh`` runs the same script for every model), so here it
  runs only with ``VLLM_RLPATCH_INTEGRATIONS=1``, on vLLM 0.25.1 (ci/envs/integrations/openrlhf.txt)::

      VLLM_RLPATCH_INTEGRATIONS=1 PYTHONPATH=src:tests python -m pytest tests/test_integrations_openrlhf.py -q

  An engine built with the adapter as its ``worker_extension_cls`` (vLLM imports it) takes OpenRLHF's sync
  sequence (``broadcast_to_vllm``: the prefix-cache
  reset, then one ``update_weight`` per parameter, the last one marked) with the broadcast replayed (no process
  group can be built on CPU); the engine must then equal a fresh engine loaded from the trainer's weights (greedy
  tokens and logprobs on two long prompts whose KV was computed with the old weights), count one weight version
  per sync, and refuse a NaN, a parameter sent twice, a float32 tensor and an unknown OpenRLHF release with the
  engine unchanged. The script is the benchmark's (benchmarks/integrations/openrlhf.py), run phase by phase, on
  the tied qwen2-tiny.
"""

import json
import os
import subprocess
import sys

import pytest

from support.env import TESTS, clean_env, model_path
from support.frameworks import framework_python, skip_unless_pinned_vllm
from vllm_rlpatch.integrations import openrlhf as adapter
from vllm_rlpatch.integrations.support import IntegrationError

pytestmark = pytest.mark.vllm

SCRIPT = TESTS.parent / "benchmarks" / "integrations" / "openrlhf.py"
RUN_ENGINES = os.environ.get("VLLM_RLPATCH_INTEGRATIONS") == "1"


def _fake_release(tmp_path, version):
    info = tmp_path / f"openrlhf-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: openrlhf\nVersion: {version}\n")
    sys.path.insert(0, str(tmp_path))


@pytest.fixture
def release(tmp_path, monkeypatch):
    monkeypatch.delenv(adapter.ALLOW_ENV, raising=False)
    added = []

    def place(version):
        d = tmp_path / version
        _fake_release(d, version)
        added.append(str(d))

    yield place
    for d in added:
        sys.path.remove(d)


def test_unknown_openrlhf_release_is_refused_with_the_known_ones(release, monkeypatch):
    release("0.99.0")
    with pytest.raises(IntegrationError) as e:
        adapter.require_openrlhf()
    assert "0.99.0" in str(e.value) and adapter.KNOWN in str(e.value) and adapter.ALLOW_ENV in str(e.value)
    monkeypatch.setenv(adapter.ALLOW_ENV, "1")
    adapter.require_openrlhf()  # the user's override


def test_known_openrlhf_release_is_accepted(release):
    release("0.11.2")
    adapter.require_openrlhf()


def _phase(py, tmp, name, *args):
    out = tmp / f"{name}.json"
    env = {**clean_env(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([py, str(SCRIPT), *args, "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not RUN_ENGINES:
        pytest.skip("the OpenRLHF engine run is the integrations sweep's (set VLLM_RLPATCH_INTEGRATIONS=1)")
    skip_unless_pinned_vllm("openrlhf")
    py = framework_python("openrlhf")
    tmp = tmp_path_factory.mktemp("openrlhf")
    ad = _phase(py, tmp, "adapter", "--phase", "engine", "--model", model_path("qwen2-tiny"), "--ext",
                "vllm_rlpatch.integrations.openrlhf.WorkerWrap", "--work", str(tmp / "work"))
    fresh = _phase(py, tmp, "fresh", "--phase", "fresh", "--dirs", ad["weights"])
    return ad, fresh[ad["weights"]]


def test_adapter_sync_equals_a_fresh_load_in_one_version(run):
    ad, fresh = run
    assert ad["sync"]["ok"], ad["sync"].get("error")
    rep = ad["sync"]["result"]
    assert rep["state"] == "committed" and rep["guarantee"] in ("rollback", "validate-then-write")
    assert ad["versions"][1] == ad["versions"][0] + 1  # one update, one version
    after = ad["probe_after"]["result"]
    assert after["tokens"] == fresh["tokens"]
    for a, b in zip(after["logprobs"], fresh["logprobs"]):
        assert a == pytest.approx(b, abs=1e-6)
    assert after["cached"] == [0, 0]  # nothing of the old weights' KV
    assert min(ad["probe_after_again"]["result"]["cached"]) > 0  # caching still works within one version


def test_adapter_refuses_unsafe_calls_leaving_the_engine_unchanged(run):
    ref = run[0]["refusals"]
    for case in ("nan", "sent_twice", "float32", "unknown_version"):
        r = ref[case]
        assert r["refused"], case
        assert r["engine_unchanged"], case
        assert r["versions"][0] == r["versions"][1], case
    assert "RefitError" in ref["nan"]["error"]
    for case in ("sent_twice", "float32", "unknown_version"):
        assert "IntegrationError" in ref[case]["error"], case
    assert "0.99.0" in ref["unknown_version"]["error"]
    assert ref["after_refusals"]["ok"] and ref["after_refusals"]["result"]["state"] == "committed"
