"""The engine's per-token support information and the trainer twin, on real vLLM (one engine per version).

One batch of 576 requests, each asking for ``rlpatch_support``: the grid T in {0.6, 1.0, 1.3} x top-p in
{1, 0.9, 0.5} x top-k in {0, 20} x min-p in {0, 0.05}, without and with repetition/presence/frequency
penalties (72 settings), 8 prompts x 25 tokens each (200 sampled tokens per setting). The worker captures the
logits its sampler received (tests/helpers_ext.py), so the twin runs on exactly what the engine sampled from;
the trainer's side is transformers in float32 on the same bf16 checkpoint (tests/reference.py, which does not
import vllm_rlpatch).
"""

import json
import math

import pytest
import torch

from support import reference as R
from support.env import model_path
from support.runs import run_script

pytestmark = pytest.mark.vllm

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "spell robot:", "the old teacher reads",
           "the small model updates the", "30 + 12 =", "the calm river"]
PENALTIES = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.2}
GRID = [dict(temperature=t, top_p=p, top_k=k, min_p=m, **(PENALTIES if pen else {}))
        for t in (0.6, 1.0, 1.3) for p in (1.0, 0.9, 0.5) for k in (0, 20) for m in (0.0, 0.05)
        for pen in (False, True)]
TOKENS = 25
ASK = {"rlpatch_support": True}


def _label(sp):
    return (f"T={sp['temperature']} p={sp['top_p']} k={sp['top_k']} min_p={sp['min_p']}"
            + (" pen" if "repetition_penalty" in sp else ""))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("support")
    reqs = []
    for g, sp in enumerate(GRID):
        for j, prompt in enumerate(PROMPTS):
            reqs.append({"prompt": prompt, "sampling": {**sp, "max_tokens": TOKENS, "ignore_eos": True, "logprobs": 0,
                                                        "seed": 1000 * g + j, "extra_args": ASK}})
    extra = [{"prompt": PROMPTS[0], "sampling": {"temperature": 0.8, "top_p": 0.9, "max_tokens": 6, "n": 2, "seed": 5,
                                                 "logprobs": 0, "extra_args": ASK}},
             {"prompt": PROMPTS[1], "sampling": {"temperature": 0.8, "top_p": 0.9, "max_tokens": 6, "seed": 6,
                                                 "logprobs": 0}}]
    spec = {"engine": {"model": model_path()}, "requests": reqs, "extra": extra, "capture": str(d / "logits.pt")}
    f = d / "spec.json"
    f.write_text(json.dumps(spec))
    r, log = run_script("support_engine.py", str(f), cwd=d)
    captured = torch.load(d / "logits.pt")
    by_external = {}
    for (rid, pos), row in captured.items():
        by_external.setdefault(rid, {})[pos] = row
    samples = []
    for g, sp in enumerate(GRID):
        for j in range(len(PROMPTS)):
            o = r["requests"][g * len(PROMPTS) + j]
            c = o["outputs"][0]
            ext = o["request_id"]
            rows = next((v for k, v in by_external.items() if k == ext or k.rsplit("-", 1)[0] == ext), None)
            samples.append({"setting": g, "sp": sp, "prompt": o["prompt_token_ids"], "tokens": c["token_ids"],
                            "logprobs": c["logprobs"], "support": c["support"],
                            "vllm_logits": None if rows is None else torch.stack([rows[p] for p in range(len(c["token_ids"]))])})
    return {"result": r, "log": log, "samples": samples}


@pytest.fixture(scope="module")
def trainer_logits(run):
    """The trainer's own fp32 logits at every sampled position (transformers, float32)."""
    model = R.load(model_path())
    samples = run["samples"]
    out = [None] * len(samples)
    with torch.no_grad():
        for b0 in range(0, len(samples), 64):  # right-padded batches: the real positions are unchanged
            batch = samples[b0:b0 + 64]
            seqs = [s["prompt"] + s["tokens"] for s in batch]
            width = max(len(x) for x in seqs)
            ids = torch.zeros(len(seqs), width, dtype=torch.long)
            mask = torch.zeros(len(seqs), width, dtype=torch.long)
            for i, x in enumerate(seqs):
                ids[i, :len(x)] = torch.tensor(x)
                mask[i, :len(x)] = 1
            logits = model(ids, attention_mask=mask).logits.float()
            for i, s in enumerate(batch):
                p = len(s["prompt"])
                out[b0 + i] = logits[i, p - 1: p + len(s["tokens"]) - 1]
    return out


def _stacked(samples, logits):
    """Every sequence at once (the twin takes one parameter set per sequence): logits [576, L, V], tokens,
    per-sequence params, prompts, returned logprobs, engine support, and each sequence's setting index."""
    return (torch.stack(list(logits)), torch.tensor([s["tokens"] for s in samples]), [s["sp"] for s in samples],
            [s["prompt"] for s in samples], torch.tensor([s["logprobs"] for s in samples], dtype=torch.float64),
            [s["support"] for s in samples], torch.tensor([s["setting"] for s in samples]))


def test_every_token_carries_the_engines_support_information(run, version):
    r = run["result"]
    assert r["logprobs_mode"] == "processed_logprobs"
    assert all(all(h.values()) for h in r["hooks"]), r["hooks"]  # the worker's sampler and runner are hooked
    for s in run["samples"]:
        sup = s["support"]
        assert sup is not None and len(sup["log_mass_kept"]) == len(s["tokens"]) == TOKENS
        assert sup["engine"] == {"vllm": version, "runner": "v1", "device": "cpu"}
        assert all(x is not None and x <= 0.0 for x in sup["log_mass_kept"])
        assert all(n >= 1 for n in sup["kept_count"])
        if s["sp"]["top_p"] == 1.0 and s["sp"]["top_k"] == 0 and s["sp"]["min_p"] == 0.0:
            assert max(abs(x) for x in sup["log_mass_kept"]) < 1e-5  # nothing truncated: the whole mass
        if s["sp"]["top_k"] == 20:
            assert max(sup["kept_count"]) <= 20 + 2  # ties at the k-th value are kept
    parent, plain = r["extra"]
    assert len(parent["outputs"]) == 2 and all(len(c["support"]["log_mass_kept"]) == len(c["token_ids"])
                                                for c in parent["outputs"])
    assert plain["outputs"][0]["support"] is None  # not asked for: nothing computed, nothing attached


def _vllm_logits(run):
    assert all(s["vllm_logits"] is not None for s in run["samples"]), "logits of some request were not captured"
    return [s["vllm_logits"] for s in run["samples"]]


def test_lp_T_minus_the_engines_log_mass_is_the_returned_logprob_on_the_engines_logits(run):
    """lp_processed(token) == lp_T(token) - log_mass_kept, with lp_T the full-vocabulary logprob (after penalties
    and temperature) of the logits vLLM itself computed."""
    from vllm_rlpatch.trainer import processed_logprobs

    logits, tok, sps, prompts, returned, sup, _ = _stacked(run["samples"], _vllm_logits(run))
    lp, det = processed_logprobs(logits, tok, sps, prompt_token_ids=prompts, engine_info=sup, return_details=True)
    assert bool(det["engine_info_used"].all()) and bool(torch.isfinite(lp).all())
    manual = det["lp_T"].double() - torch.tensor([x["log_mass_kept"] for x in sup], dtype=torch.float64)
    worst = max(float((lp.double() - returned).abs().max()), float((manual - returned).abs().max()))
    assert worst <= 1e-5, worst


def test_the_twin_matches_vllm_on_the_logits_vllm_computed(run):
    """Without the engine's information the twin reproduces the engine's processing: every returned processed
    logprob to <= 1e-5 in fp32, no token outside its support, the same kept-set size and mass."""
    from vllm_rlpatch.trainer import processed_logprobs

    logits, tok, sps, prompts, returned, sup, setting = _stacked(run["samples"], _vllm_logits(run))
    lp, det = processed_logprobs(logits, tok, sps, prompt_token_ids=prompts, engine=sup[0]["engine"],
                                 return_details=True)
    assert det["engine"] == "vllm={vllm} runner=v1 device=cpu".format(**sup[0]["engine"]) and det["engine_verified"]
    diff = (lp.double() - returned).abs().amax(1)
    bad = {_label(GRID[int(g)]) for g in setting[diff > 1e-5]}
    assert not bad, (float(diff.max()), sorted(bad))
    counts = torch.tensor([x["kept_count"] for x in sup])
    lm = torch.tensor([x["log_mass_kept"] for x in sup], dtype=torch.float64)
    assert int(det["outside_support"].sum()) == 0
    assert int((det["kept_count"] != counts).sum()) == 0
    assert float((det["log_mass_kept"].double() - lm).abs().max()) <= 1e-5
    assert tok.numel() == len(GRID) * 200


def test_on_the_trainers_own_logits_with_the_engines_information(run, trainer_logits):
    """0 non-finite tokens, and token_mult_prob_error no worse than the plugin's `all` configuration before a
    refit (1.001 in parity)."""
    from vllm_rlpatch.trainer import processed_logprobs

    logits, tok, sps, prompts, returned, sup, setting = _stacked(run["samples"], trainer_logits)
    lp = processed_logprobs(logits, tok, sps, prompt_token_ids=prompts, engine_info=sup).double()
    assert bool(torch.isfinite(lp).all())
    err = torch.exp((lp - returned).abs())
    per_setting = {_label(sp): float(err[setting == g].mean()) for g, sp in enumerate(GRID)}
    pooled = float(err.mean())
    print(f"\nwith engine information: token_mult_prob_error {pooled:.5f} over {tok.numel()} tokens; "
          f"worst setting {max(per_setting.items(), key=lambda kv: kv[1])}")
    assert pooled <= 1.0015, (pooled, per_setting)
    assert max(per_setting.values()) <= 1.005, per_setting


def test_on_the_trainers_own_logits_without_it(run, trainer_logits):
    """At most 0.1% of the tokens fall outside the twin's own support (handled: renormalized over the kept set
    plus the token); sampled tokens just below its boundary (a near-tie the engine's logits resolved the other
    way) take the lowest kept token's place; every logprob is finite."""
    from vllm_rlpatch.trainer import processed_logprobs

    logits, tok, sps, prompts, returned, sup, setting = _stacked(run["samples"], trainer_logits)
    lp, det = processed_logprobs(logits, tok, sps, prompt_token_ids=prompts, engine=sup[0]["engine"],
                                 return_details=True)
    lp = lp.double()
    assert bool(torch.isfinite(lp).all())
    out, edge = det["outside_support"], det["at_boundary"]
    lpT, lm = det["lp_T"].double()[out], det["log_mass_kept"].double()[out]
    assert torch.allclose(lp[out], lpT - torch.logaddexp(lm, lpT), atol=1e-5)
    err = torch.exp((lp - returned).abs())
    where = sorted({_label(GRID[int(g)]) for g in setting[(out | edge).any(1)]})
    print(f"\nwithout engine information: {int(out.sum())}/{tok.numel()} tokens outside the twin's support, "
          f"{int(edge.sum())} at its boundary (near-ties: {where}); token_mult_prob_error {float(err.mean()):.5f} "
          f"(at the boundary {float(err[edge].mean()) if bool(edge.any()) else float('nan'):.4f})")
    assert int(out.sum()) <= 0.001 * tok.numel(), (int(out.sum()), where)
    assert int((out | edge).sum()) <= 0.005 * tok.numel()
    assert float(err.mean()) <= 1.0015
    if bool(edge.any()):
        assert float(err[edge].max()) <= 1.1  # the swap puts them where the engine had them


def test_with_the_toggle_off_no_sampler_or_runner_hook_is_installed():
    """``VLLM_RLPATCH_SAMPLING_SUPPORT=0``: the plugin registers as a worker would, vLLM's sampler and runner are
    imported, and none of the patch's targets is wrapped (on: all of them are, on the V1-runner versions)."""
    import os
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from vllm_rlpatch import plugin, _wrapping\n"
        "from vllm_rlpatch.patches import sampling_support as S\n"
        "plugin.register_as('worker')\n"
        "import vllm.v1.sample.sampler, vllm.v1.worker.gpu_model_runner\n"
        "ts = [S.T_SAMPLE_TOKENS, S.T_ASYNC_OUTPUT, S.T_SAMPLE, S.T_TEMPERATURE]\n"
        "print(json.dumps({t: _wrapping.is_wrapped(t) for t in ts}))\n")
    out = {}
    for flag in ("0", "1"):
        env = {**os.environ, "VLLM_RLPATCH_SAMPLING_SUPPORT": flag}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        out[flag] = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any(out["0"].values()), out["0"]
    assert all(out["1"].values()), out["1"]
