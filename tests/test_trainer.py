"""vllm_rlpatch.trainer: fp32_lm_head on a real transformers model (the embedded models in bf16), and
processed_logprobs (the twin of vLLM's sampler processing) against vLLM's own operations, without an engine."""

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from support.env import model_path

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick


@pytest.fixture()
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path("qwen2-tiny"), dtype=torch.bfloat16).eval()


def _hidden_and_logits(m, ids):
    out = m(ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def test_the_head_projects_in_fp32_and_nothing_else_changes(model):
    from vllm_rlpatch.trainer import fp32_lm_head, is_fp32_lm_head, restore_lm_head

    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    w = model.lm_head.weight
    assert model.config.tie_word_embeddings and w is model.get_input_embeddings().weight
    with torch.no_grad():
        h, bf16_logits = _hidden_and_logits(model, ids)
    assert bf16_logits.dtype == torch.bfloat16
    assert fp32_lm_head(model) is model and is_fp32_lm_head(model)
    fp32_lm_head(model)  # idempotent
    with torch.no_grad():
        h2, logits = _hidden_and_logits(model, ids)
    assert torch.equal(h, h2)  # the body is untouched
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(h.float(), w.float()))
    assert (logits - bf16_logits.float()).abs().max() > 1e-3  # bf16 rounding is what it removes
    assert w.dtype == torch.bfloat16 and model.lm_head.weight is w  # parameters untouched (tied too)
    restore_lm_head(model)
    assert not is_fp32_lm_head(model)
    with torch.no_grad():
        assert _hidden_and_logits(model, ids)[1].dtype == torch.bfloat16


def test_gradients_flow_to_the_bf16_weight(model):
    from vllm_rlpatch.trainer import fp32_lm_head

    fp32_lm_head(model).train()
    ids = torch.tensor([[3, 17, 42, 99]])
    loss = model(ids, labels=ids).loss
    loss.backward()
    g = model.lm_head.weight.grad
    assert g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all() and g.abs().sum() > 0


def test_a_head_that_is_not_a_plain_linear_is_refused():
    from vllm_rlpatch.trainer import fp32_lm_head

    class Quantized(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    class M(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.lm_head = head

    with pytest.raises(TypeError, match="not a plain torch.nn.Linear"):
        fp32_lm_head(M(Quantized(4, 8)))
    with pytest.raises(TypeError, match="no output projection"):
        fp32_lm_head(torch.nn.Sequential())
    lin = torch.nn.Linear(4, 8, bias=True).to(torch.bfloat16)
    fp32_lm_head(M(lin))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float(), lin.bias.float()))


# ------------------------------------------------------------------------------------------------------------
# processed_logprobs: the twin of vLLM's sampler processing, against vLLM's own operations (no engine)
# ------------------------------------------------------------------------------------------------------------
PEN = {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.2}


def _vllm_processed(logits, tok, sps, prompts):
    """[B, L, V] -> the processed logprob of each token and the masked logits, computed with vLLM's own V1 CPU
    operations (apply_penalties, the min-p processor's arithmetic, apply_top_k_top_p_pytorch)."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.utils import apply_penalties
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    B, L, V = logits.shape
    out = torch.empty(B, L, dtype=torch.float64)
    masked = torch.empty(B, L, V)
    for b in range(B):
        sp = sps[b]
        x = logits[b].float().clone()
        rep, pres, freq = (sp.get("repetition_penalty", 1.0), sp.get("presence_penalty", 0.0),
                           sp.get("frequency_penalty", 0.0))
        if rep != 1 or pres or freq:
            outs = [[int(t) for t in tok[b, :j]] for j in range(L)]
            ot = torch.full((L, max(1, L)), V, dtype=torch.long)
            for j, o in enumerate(outs):
                if o:
                    ot[j, :len(o)] = torch.tensor(o)
            apply_penalties(x, torch.tensor([prompts[b]] * L), ot, torch.full((L,), pres), torch.full((L,), freq),
                            torch.full((L,), rep))
        t = sp.get("temperature", 1.0)
        x.div_(torch.full((L,), 1.0 if t < 1e-5 else t).unsqueeze(1))
        if sp.get("min_p", 0.0) > 0:  # MinPLogitsProcessor.apply
            probs = torch.nn.functional.softmax(x, dim=-1)
            adjusted = torch.amax(probs, dim=-1, keepdim=True).mul_(torch.full((L, 1), sp["min_p"]))
            x.masked_fill_(probs < adjusted, -float("inf"))
        k, p = sp.get("top_k", 0), sp.get("top_p", 1.0)
        x = apply_top_k_top_p_pytorch(x, torch.full((L,), k, dtype=torch.int32) if 0 < k < V else None,
                                      torch.full((L,), p) if p < 1 else None, allow_cpu_sync=True)
        masked[b] = x
        out[b] = x.log_softmax(-1)[torch.arange(L), tok[b]].double()
    return out, masked


def _grid():
    return [dict(temperature=t, top_p=p, top_k=k, min_p=m, **(PEN if pen else {}))
            for t in (0.6, 1.0, 1.3) for p in (1.0, 0.9, 0.5) for k in (0, 20) for m in (0.0, 0.05)
            for pen in (False, True)]


@pytest.mark.parametrize("V,scale,candidates", [(512, 3.0, 1024), (4096, 0.7, 64), (20000, 0.5, 64)],
                         ids=["peaked", "bisection", "flat-bisection"])
def test_processed_logprobs_is_vllms_processing(V, scale, candidates):
    """On the same logits the twin gives vLLM's processed logprob for every token vLLM keeps (<= 1e-5), flags
    every token vLLM masks, over the grid (T, top-p, top-k, min-p, penalties); also when the nucleus is wider
    than the candidate list (bisection on the value) and rows sit on a boundary (the exact replica)."""
    from vllm_rlpatch.trainer import processed_logprobs

    g = torch.Generator().manual_seed(V)
    grid = _grid()[::1 if V == 512 else 5]
    L = 12 if V == 512 else 4
    logits = torch.randn(len(grid), L, V, generator=g) * scale
    tok = torch.randint(0, V, (len(grid), L), generator=g)
    tok[:, ::2] = logits[:, ::2].argmax(-1)  # half of them the top token: always kept
    prompts = [torch.randint(0, V, (6,), generator=g).tolist() for _ in grid]
    ref, _ = _vllm_processed(logits, tok, grid, prompts)
    lp, det = processed_logprobs(logits, tok, grid, prompt_token_ids=prompts, return_details=True,
                                 _candidates=candidates, boundary_tolerance=0.0)
    kept = torch.isfinite(ref)
    assert float((lp.double() - ref)[kept].abs().max()) <= 1e-5
    flagged = det["outside_support"] | det["at_boundary"]
    assert torch.equal(flagged, ~kept)
    assert bool(torch.isfinite(lp).all())


def test_processed_logprobs_gradient_is_the_kept_sets_softmax():
    """d lp / d logits = (onehot - softmax over the kept set) * dx/dl (temperature and the repetition
    penalty's factor), against autograd through a dense computation with vLLM's mask."""
    from vllm_rlpatch.trainer import processed_logprobs

    g = torch.Generator().manual_seed(3)
    sps = [dict(temperature=0.7, top_p=0.9, **PEN), dict(temperature=1.3, top_k=20, min_p=0.05)]
    V, L = 300, 6
    logits = torch.randn(2, L, V, generator=g) * 3
    tok = logits.argmax(-1)
    tok[:, 1] = logits[:, 1].topk(3).indices[:, 2]
    prompts = [[1, 2, 3, 4], [5, 6]]
    _, masked = _vllm_processed(logits, tok, sps, prompts)
    keep = torch.isfinite(masked)
    # dense, differentiable: the same penalties and temperature with torch ops, vLLM's kept set as the mask
    lg = logits.clone().requires_grad_(True)
    rows = []
    for b, sp in enumerate(sps):
        x = lg[b]
        if "repetition_penalty" in sp:
            hit = torch.zeros(L, V, dtype=torch.bool)
            counts = torch.zeros(L, V)
            for j in range(L):
                for t in tok[b, :j]:
                    counts[j, t] += 1
                hit[j, prompts[b]] = True
            hit |= counts > 0
            r = torch.tensor(sp["repetition_penalty"])
            scale = torch.where(hit, torch.where(x > 0, 1.0 / r, r), torch.ones(()))
            x = x * scale - sp["frequency_penalty"] * counts - sp["presence_penalty"] * (counts > 0)
        x = x / sp["temperature"]
        z = torch.logsumexp(x.masked_fill(~keep[b], float("-inf")), -1)
        rows.append(x.gather(1, tok[b].unsqueeze(1)).squeeze(1) - z)
    torch.stack(rows).sum().backward()
    ref_grad = lg.grad.clone()
    lg2 = logits.clone().requires_grad_(True)
    lp = processed_logprobs(lg2, tok, sps, prompt_token_ids=prompts)
    lp.sum().backward()
    assert torch.allclose(lg2.grad, ref_grad, atol=1e-5), float((lg2.grad - ref_grad).abs().max())
    # with the engine's information: the gradient of lp_T (full-vocabulary softmax), the mass a constant
    lg3 = logits[:1].clone().requires_grad_(True)
    processed_logprobs(lg3, tok[:1], sps[1], engine_info=torch.full((1, L), -0.25)).sum().backward()
    x = logits[:1].clone().requires_grad_(True)
    ((x / 1.3).log_softmax(-1).gather(2, tok[:1].unsqueeze(2))).sum().backward()
    assert torch.allclose(lg3.grad, x.grad, atol=1e-5)


def test_engine_information_is_used_per_token_and_nan_falls_back_to_the_twin():
    from vllm_rlpatch.trainer import processed_logprobs

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 64, generator=g) * 2
    tok = logits.argmax(-1)
    sp = {"temperature": 0.8, "top_p": 0.7}
    twin, det = processed_logprobs(logits, tok, sp, return_details=True)
    info = torch.full((2, 5), -0.3)
    info[1, 2] = float("nan")
    lp, det2 = processed_logprobs(logits, tok, sp, engine_info=info, return_details=True)
    lpT = (logits / 0.8).log_softmax(-1).gather(2, tok.unsqueeze(2)).squeeze(2)
    assert torch.allclose(lp[0], lpT[0] + 0.3, atol=1e-5)
    assert float(lp[1, 2]) == pytest.approx(float(twin[1, 2]), abs=1e-6)
    assert det2["engine_info_used"].sum() == 9 and not bool(det2["engine_info_used"][1, 2])
    # the forms a trainer holds: the outputs' rlpatch_support objects (or dicts), one per sequence
    from collections import namedtuple

    Sup = namedtuple("Sup", "log_mass_kept kept_count engine")
    objs = [Sup([-0.3] * 5, [3] * 5, {"vllm": "0.32.0", "runner": "v1", "device": "cpu"}) for _ in range(2)]
    lp3, det3 = processed_logprobs(logits, tok, sp, engine_info=objs, return_details=True)
    assert torch.allclose(lp3, lpT + 0.3, atol=1e-5) and det3["engine"] == "vllm=0.32.0 runner=v1 device=cpu"


def test_a_token_just_below_the_boundary_swaps_with_the_lowest_kept_one():
    """top-k=2: the sampled token is 0.01 below the 2nd largest (a near-tie the engine's logits put above):
    it takes the 2nd one's place. 1.0 below: outside, renormalized over the kept set plus itself."""
    from vllm_rlpatch.trainer import processed_logprobs

    x = torch.tensor([[[3.0, 2.0, 1.99, 1.0, 0.0]]])
    sp = {"temperature": 1.0, "top_k": 2}
    lp, det = processed_logprobs(x, torch.tensor([[2]]), sp, return_details=True)
    assert bool(det["at_boundary"].all()) and not bool(det["outside_support"].any())
    assert float(lp) == pytest.approx(1.99 - math.log(math.exp(3.0) + math.exp(1.99)), abs=1e-6)
    lp, det = processed_logprobs(x, torch.tensor([[3]]), sp, return_details=True)
    assert bool(det["outside_support"].all())
    assert float(lp) == pytest.approx(1.0 - math.log(math.exp(3.0) + math.exp(2.0) + math.exp(1.0)), abs=1e-6)
    # min-p (a value threshold): a near-tie joins the kept set
    sp = {"temperature": 1.0, "min_p": math.exp(-1.0)}  # keeps x >= max - 1 = 2.0
    lp, det = processed_logprobs(x, torch.tensor([[2]]), sp, return_details=True)
    assert bool(det["at_boundary"].all())
    assert float(lp) == pytest.approx(1.99 - math.log(math.exp(3.0) + math.exp(2.0) + math.exp(1.99)), abs=1e-6)


def test_engine_rules_and_refused_parameters():
    from vllm_rlpatch.trainer import engine_rules, processed_logprobs

    assert engine_rules(None).verified and engine_rules(None).top_k_top_p == "torch_sort"
    r = engine_rules({"vllm": "0.25.1", "runner": "v1", "device": "cuda"})
    assert not r.verified and r.min_p == "prob" and r.key == "vllm=0.25.1 runner=v1 device=cuda"
    r = engine_rules("0.32.0/mrv2/cuda")
    assert r.min_p == "logit" and not r.verified and r.vllm == "0.32.0"
    with pytest.raises(ValueError, match="runner"):
        engine_rules({"runner": "v3"})
    x, t = torch.zeros(1, 2, 8), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="logit_bias"):
        processed_logprobs(x, t, {"logit_bias": {1: 2.0}})
    with pytest.raises(ValueError, match="prompt_token_ids"):
        processed_logprobs(x, t, {"repetition_penalty": 1.1})
    with pytest.raises(ValueError, match="do not match"):
        processed_logprobs(x, torch.zeros(2, 2, dtype=torch.long), {})


def test_processed_logprobs_memory_is_bounded_by_the_chunk_not_the_vocabulary(tmp_path):
    """512 positions x 131072 tokens (256 MiB of fp32 logits; a full sort would hold 768 MiB more): the twin's
    forward pass stays within a few times its 32 MiB chunk budget (peak RSS measured in a fresh process, after the
    logits are allocated in place)."""
    code = """
import resource, sys, torch
sys.path.insert(0, %r)
from vllm_rlpatch.trainer import processed_logprobs
g = torch.Generator().manual_seed(0)
logits = torch.empty(1, 512, 131072)
logits.normal_(generator=g)
logits.mul_(6)
tok = torch.randint(0, 131072, (1, 512), generator=g)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
lp = processed_logprobs(logits, tok, {"temperature": 0.7, "top_p": 0.9, "top_k": 50}, chunk_bytes=32 << 20)
assert torch.isfinite(lp).all()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
""" % str(Path(__file__).resolve().parents[1] / "src")
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    extra = int(p.stdout.strip().splitlines()[-1])
    assert extra < 96 << 20, f"the twin used {extra / 2**20:.0f} MiB beyond the logits"


def test_the_mrv2_rules_match_mrv2s_own_kernels_run_by_tritons_interpreter():
    """Model Runner V2 (vLLM >= 0.29) runs only on a GPU; its temperature and min-p kernels (min-p in logit space)
    are run here by Triton's interpreter on the CPU, from the installed vLLM's sources, with top-k/top-p from
    vLLM's PyTorch implementation (a GPU uses a Triton kernel for those, not run here). The twin's ``mrv2`` rules
    must give MRv2's processed logprob for every kept token and MRv2's kept-set size on every row, including
    tokens within rounding of min-p's threshold and an exact tie group."""
    import json
    import os
    import subprocess
    import sys

    from packaging.version import Version

    from support.env import vllm_version

    if Version(vllm_version().split("+")[0]) < Version("0.29"):
        pytest.skip(f"vLLM {vllm_version()} has no Model Runner V2 sampler (0.29+)")
    pytest.importorskip("triton")
    script = Path(__file__).resolve().parent / "scripts" / "mrv2_twin_interp.py"
    r = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rows"] == 36 and out["min_p_rows"] == 18 and out["tokens"] > 1000
    assert out["max_abs_err"] <= 1e-5, out
    assert out["twin_outside_or_boundary"] == 0, out
