"""What tests/test_fleet.py and tests/test_fleet_ray.py share: one run of their fleet script (two perturbed
copies of the model, B and C, as the updates; its `RESULT` with the weights' folders added) and the readers of
its recorded generations."""

import json

from support import reference as R
from support.env import model_path
from support.runs import run_script

EXT = "helpers_ext.FrameworkExtension"


def run_fleet_script(tmp_path_factory, name: str, script: str, timeout: float) -> dict:
    """Run tests/scripts/SCRIPT on a spec with weights B and C (in a fresh temporary folder ``name``) and
    fault injection on; return its result with ``weights`` (name -> folder) added."""
    d = tmp_path_factory.mktemp(name)
    w = {"B": R.perturbed_copy(model_path(), str(d / "B"), scale=1.0, seed=7),
         "C": R.perturbed_copy(model_path(), str(d / "C"), scale=1.0, seed=8)}
    spec = {"weights": w, "engine": {"model": model_path(), "worker_extension_cls": EXT}}
    f = d / "spec.json"
    f.write_text(json.dumps(spec))
    r, log = run_script(script, str(f), cwd=d, timeout=timeout, VLLM_RLPATCH_FAULT_INJECTION="1",
                        VLLM_RLPATCH_FP32_LM_HEAD="0")
    r["weights"] = w
    return r


def requests(g):
    assert "requests" in g, g
    return g["requests"]


def tokens(g):
    return [q["token_ids"] for q in requests(g)]


def lps(g):
    return [q["logprobs"] for q in requests(g)]


def vs_reference(g, weights_dir):
    """The mismatch (reference.mismatch) of a generation's logprobs with what a fresh load of ``weights_dir``
    gives (float32 transformers)."""
    model = R.load(weights_dir)
    got, ref = [], []
    for q in requests(g):
        got += q["logprobs"]
        ref += R.token_logprobs(model, q["prompt_token_ids"], q["token_ids"])
    return R.mismatch(got, ref)
