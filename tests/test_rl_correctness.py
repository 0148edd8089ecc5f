"""Rollout logprobs vs a trainer-side reference, and the prefix cache across weight updates, on real vLLM.

Every number here compares what vLLM returned (tests/scripts/rl_engine.py, which does not import
vllm_rlpatch) with a float32 transformers reference of the same weights (tests/reference.py, which does not
import it either). ``token_mult_prob_error`` is NeMo-RL's metric: mean exp(|logprob_vllm - logprob_ref|).

One engine per configuration (module-scoped): the plugin's defaults (salt), ``reset`` (with vLLM's own bf16
head), ``off``. Stock vLLM, each fix alone and the tied-embedding model are measured by the ``parity``
command (tests/test_parity.py), whose numbers are checked against this same reference.
"""

import json

import pytest

from support import reference as R
from support.env import model_path
from support.runs import run_script

pytestmark = pytest.mark.vllm

SHORT = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:", "the old teacher reads",
         "the small model updates the", "30 + 12 =", "the calm river"]
_BASE = ["the quick cat sees the old dog on the mat. 12 + 7 = 19. count: 3 4 5 6 7. the small robot reads the red "
         "token in the garden. spell cache: c a c h e. the calm teacher keeps the new batch near the river. 21 + 4 =",
         "the bright student finds the stale reward on the server. 30 + 12 = 42. count: 10 11 12 13. the large "
         "worker moves the fresh policy under the tree. spell model: m o d e l. the red engine checks the calm "
         "cache at the station. the old",
         "spell token: t o k e n. the new trainer samples the bright batch in the cache. 5 + 9 = 14. the quick "
         "policy finds the old worker near the river. count: 4 5 6 7 8. the stale garden"]
LONG = [(p + " ") * 4 + p for p in _BASE]  # ~300 tokens: nine 32-token blocks are cached per prompt
TOPP = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 24, "logprobs": 0}
TOPK = {"temperature": 0.8, "top_k": 20, "max_tokens": 24, "logprobs": 0}
T1 = {"temperature": 1.0, "max_tokens": 24, "logprobs": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    out = {}
    for name in ("llama-tiny", "qwen2-tiny"):
        out[name] = {"A": model_path(name),
                     "B": R.perturbed_copy(model_path(name), str(d / f"{name}-B"), scale=1.0, seed=7),
                     "C": R.perturbed_copy(model_path(name), str(d / f"{name}-C"), scale=1.0, seed=8)}
    return out


def _engine(tmp_path, ops, model, env, engine_extra=None):
    spec = {"engine": {"model": model, **(engine_extra or {})}, "ops": ops}
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    r, log = run_script("rl_engine.py", str(f), cwd=tmp_path, **env)
    r["log"] = log
    r["by_name"] = {o["name"]: o for o in r["ops"]}
    for o in r["ops"]:
        assert "error" not in o or o["op"] == "rpc", o
    return r


HEAD = {"op": "rpc", "name": "head", "method": "head_probe"}


def _ops(w, framework=True):
    ops = [HEAD, {"op": "generate", "name": "topp", "prompts": SHORT * 2, "sampling": TOPP},
           {"op": "generate", "name": "topk", "prompts": SHORT * 2, "sampling": TOPK},
           {"op": "generate", "name": "A", "prompts": LONG, "sampling": T1},
           {"op": "reload", "path": w["B"]},
           {"op": "generate", "name": "B", "prompts": LONG, "sampling": T1},
           {"op": "generate", "name": "B2", "prompts": LONG, "sampling": T1}]
    if framework:
        ops += [{"op": "rpc", "name": "framework", "method": "framework_load_weights",
                 "args": [w["C"] + "/model.safetensors"]},
                {"op": "generate", "name": "C", "prompts": LONG, "sampling": T1}]
    return ops


EXT = {"worker_extension_cls": "helpers_ext.FrameworkExtension"}


@pytest.fixture(scope="module")
def salt_run(tmp_path_factory, weights):
    return _engine(tmp_path_factory.mktemp("salt"), _ops(weights["llama-tiny"]), model_path(), {}, EXT)


@pytest.fixture(scope="module")
def reset_run(tmp_path_factory, weights):
    """Also the fp32 head turned off: vLLM's own bf16 logits, measured by the head probe."""
    return _engine(tmp_path_factory.mktemp("reset"), [HEAD] + _ops(weights["llama-tiny"], framework=False)[3:],
                   model_path(), {"VLLM_RLPATCH_PREFIX_CACHE": "reset", "VLLM_RLPATCH_FP32_LM_HEAD": "0"}, EXT)


@pytest.fixture(scope="module")
def off_run(tmp_path_factory, weights):
    return _engine(tmp_path_factory.mktemp("off"), _ops(weights["llama-tiny"], framework=False)[3:], model_path(),
                   {"VLLM_RLPATCH_PREFIX_CACHE": "off"})


def _error(run, name, weights_dir, sampling, processed=True):
    """Pool every token of op ``name`` and compare with the reference of ``weights_dir``."""
    model = R.load(weights_dir)
    kw = {k: sampling[k] for k in ("temperature", "top_k", "top_p") if k in sampling}
    got, ref = [], []
    for q in run["by_name"][name]["requests"]:
        c = q["outputs"][0]
        got += c["logprobs"]
        ref += R.token_logprobs(model, q["prompt_token_ids"], c["token_ids"], processed=processed, **kw)
    return R.mismatch(got, ref)


# ------------------------------------------------------------------------------------------ logprobs
# Processed logprobs alone leave the bf16 rounding of vLLM's logits (logits ~9 x bf16 epsilon, divided by T):
# measured 1.008-1.014 on these models at T=0.7 over repeats. The fp32 lm_head removes most of the rest
# (1.001-1.002 measured; stock vs each fix: tests/test_parity.py).
ALL_FIXES_BOUND = 1.005


@pytest.mark.parametrize("case,sampling", [("topp", TOPP), ("topk", TOPK)])
def test_rollout_logprobs_are_the_behaviour_policy(salt_run, weights, case, sampling):
    """T=0.7/top-p 0.9 and T=0.8/top-k 20: with the plugin the returned logprobs match the trainer-side fp32
    reference of the sampled distribution."""
    assert salt_run["logprobs_mode"] == "processed_logprobs"
    m = _error(salt_run, case, weights["llama-tiny"]["A"], sampling)
    assert m["n"] >= 120 and m["n_outside"] <= max(2, m["n"] // 50), m  # bf16 vs fp32 nucleus edge: rare
    assert m["token_mult_prob_error"] <= ALL_FIXES_BOUND, m


def test_the_lm_head_projects_in_fp32(salt_run, reset_run):
    """The worker's real model.compute_logits on random hidden states: with the plugin the logits are fp32 and
    equal F.linear(h.float(), w.float()); with VLLM_RLPATCH_FP32_LM_HEAD=0 (vLLM's own head) they are bf16,
    rounded by up to ~0.01-0.03 at these magnitudes."""
    (on,) = salt_run["by_name"]["head"]["result"]
    assert on["weight_dtype"] == "torch.bfloat16" and on["logits_dtype"] == "torch.float32", on
    assert on["max_diff_fp32"] <= 1e-5, on
    (off,) = reset_run["by_name"]["head"]["result"]
    assert off["logits_dtype"] == "torch.bfloat16", off
    assert off["max_diff_fp32"] > 1e-3 and off["max_diff_model_dtype"] == 0.0, off


# ------------------------------------------------------------------------------------------ staleness
def _cached(run, name):
    return [q["num_cached_tokens"] for q in run["by_name"][name]["requests"]]


def _versions(run, name):
    return {tuple(s[2:]) for q in run["by_name"][name]["requests"] for s in q["outputs"][0]["spans"]}


@pytest.mark.parametrize("mode", ["salt", "reset", "off"])
def test_after_an_update_every_logprob_matches_the_new_weights(mode, salt_run, reset_run, off_run, weights):
    run = {"salt": salt_run, "reset": reset_run, "off": off_run}[mode]
    assert run["enable_prefix_caching"] is (mode != "off")
    for name in ("B", "B2"):
        m = _error(run, name, weights["llama-tiny"]["B"], T1)
        # the largest single-token error is the bf16 engine's rounding against a float32 reference, host-dependent
        # (1.61 measured on a 2-core CPU without AVX-512: vLLM 0.20.2, caching off); KV of the old weights is
        # caught below (cached tokens, version spans)
        assert m["token_mult_prob_error"] <= 1.02 and m["max"] < 2.0, (mode, name, m)
        assert _versions(run, name) == {(1, 1)}
    assert max(_cached(run, "B")) == 0  # nothing from the old weights reused
    if mode != "off":  # ... but the cache still works within a weight version (GRPO's n samples share KV)
        assert min(_cached(run, "B2")) >= 192
    assert "weights changed (collective_rpc:reload_weights) -> weight version 1" in run["log"]


def test_a_framework_update_path_is_detected_too(salt_run, weights):
    """A trainer's own worker method calling model.load_weights (an RPC name the plugin cannot know): the
    engine core sees the workers' version move, salts, and stamps the new version. (On CPU, where vLLM has
    repacked the parameters, the refit_guard patch routes the load through a layerwise reload: without it
    vLLM 0.25/0.32 reject it half-way, see tests/test_refit.py.)"""
    (res,) = salt_run["by_name"]["framework"]["result"]
    assert res["ok"], res
    assert _versions(salt_run, "C") == {(2, 2)}
    assert max(_cached(salt_run, "C")) == 0
    m = _error(salt_run, "C", weights["llama-tiny"]["C"], T1)
    assert m["token_mult_prob_error"] <= 1.02, m
    assert "weights changed (collective_rpc:framework_load_weights) -> weight version 2" in salt_run["log"]


def test_decisions_are_logged_by_the_engine_core(salt_run, reset_run):
    assert "prefix cache policy salt, in-flight requests at a weight update: recompute" in salt_run["log"]
    assert "new requests salted with weight version 1" in salt_run["log"]
    assert "prefix cache (reset), in-flight (recompute): prefix cache reset" in reset_run["log"]
