"""Trainer-side helpers (no vLLM needed): make the trainer compute what the rollout engine computes.

The plugin's ``fp32_lm_head`` patch makes vLLM project the last hidden state in float32. A trainer that
keeps its own head in bf16 then compares bf16-rounded logits with fp32 ones, which can make the rollout /
trainer mismatch *worse* than bf16 on both sides (NeMo-RL warns about exactly this). Use the same head on
both sides:

    from vllm_rlpatch.trainer import fp32_lm_head
    model = fp32_lm_head(model)       # transformers or any torch model with an output projection

The parameters are not converted: the weight stays in its dtype (optimizer state, checkpoints and the
tensors pushed to vLLM are unchanged); only the projection runs as ``F.linear(h.float(), w.float())``,
differentiable as before. ``restore_lm_head(model)`` undoes it.
"""

from __future__ import annotations

from collections.abc import Mapping as _Mapping
from collections.abc import Sequence as _Sequence
from dataclasses import dataclass as _dataclass
from typing import Any

_ATTR = "_rlpatch_fp32_forward"


def _head_of(model: Any, head: Any = None) -> Any:
    import torch

    if head is not None:
        return head
    get = getattr(model, "get_output_embeddings", None)
    out = get() if callable(get) else None
    if out is None:
        out = getattr(model, "lm_head", None)
    if out is None:
        if isinstance(model, torch.nn.Linear):
            return model
        raise TypeError(f"fp32_lm_head: {type(model).__name__} has no output projection "
                        "(no get_output_embeddings() and no .lm_head); pass head=<the nn.Linear>")
    return out


def fp32_lm_head(model: Any, *, head: Any = None) -> Any:
    """Make ``model``'s output projection compute in float32 (idempotent). Returns ``model``.

    ``head``: the projection module, when ``model.get_output_embeddings()`` / ``model.lm_head`` does not
    find it. Only a plain ``torch.nn.Linear`` (bias or not) is supported: a quantized or otherwise custom
    head raises ``TypeError`` rather than silently staying in its dtype."""
    import torch
    import torch.nn.functional as F

    lm = _head_of(model, head)
    if not isinstance(lm, torch.nn.Linear) or type(lm).forward is not torch.nn.Linear.forward:
        raise TypeError(f"fp32_lm_head: the head is a {type(lm).__module__}.{type(lm).__name__}, not a plain "
                        "torch.nn.Linear (quantized/custom heads are not supported: compute its fp32 logits "
                        "yourself, or turn the engine's head off with VLLM_RLPATCH_FP32_LM_HEAD=0 so both sides match)")
    if not lm.weight.is_floating_point():
        raise TypeError(f"fp32_lm_head: the head's weight is {lm.weight.dtype}, not a floating-point tensor")
    if getattr(lm, _ATTR, None) is not None:
        return model

    def forward(x: torch.Tensor, _lm: torch.nn.Linear = lm) -> torch.Tensor:
        b = _lm.bias
        return F.linear(x.float(), _lm.weight.float(), None if b is None else b.float())

    lm.forward = forward  # instance attribute: the class and other instances are untouched
    setattr(lm, _ATTR, forward)
    return model


def restore_lm_head(model: Any, *, head: Any = None) -> Any:
    """Undo :func:`fp32_lm_head` (no-op if it was not applied). Returns ``model``."""
    lm = _head_of(model, head)
    if getattr(lm, _ATTR, None) is not None:
        del lm.forward
        delattr(lm, _ATTR)
    return model


def is_fp32_lm_head(model: Any, *, head: Any = None) -> bool:
    return getattr(_head_of(model, head), _ATTR, None) is not None


# =============================================================================================================
# Processed logprobs on the trainer's side: the twin of vLLM's sampler processing
# =============================================================================================================
#
# vLLM with processed logprobs (the plugin's default) returns log p(token) under the distribution it sampled
# from: the logits after penalties and temperature, truncated by min-p / top-k / top-p, renormalized over the
# tokens that survived (the *kept set*). A trainer that compares those with a full-vocabulary softmax at T=1
# compares two distributions (the gap is log(mass of the kept set) per token); a trainer that truncates its
# own fp32 logits gets a slightly different kept set than the engine's, so a token the engine sampled can
# fall outside it (-inf, an infinite importance ratio). `processed_logprobs` is the twin of the engine's
# processing; given the engine's per-token support information (`SamplingParams(extra_args={"rlpatch_support":
# True})`, returned as `CompletionOutput.rlpatch_support`) it renormalizes exactly as the engine did.
#
# The processing order and tie rules it follows, per engine (cited from vLLM's sources; line numbers are
# 0.20.2 / 0.25.1 / 0.32.0):
#
# V1 runner (every CPU engine; GPU engines up to 0.28 and where MRv2 is off):
#   1. fp32 logits (v1/sample/sampler.py `logits = logits.to(torch.float32)`, forward 91 / 96 / 97);
#   2. penalties (sampler.py apply_logits_processors -> apply_penalties 390 / 408 / 407;
#      model_executor/layers/utils.py apply_penalties 51-89 / 51-89 / 43-80): repetition first (prompt and
#      output tokens; _custom_ops.py apply_repetition_penalties_torch 483 / 290 / 382:
#      `scaling = torch.where(logits > 0, 1.0 / penalties, penalties); logits *= scaling`), then
#      `logits -= frequency * output_counts` (87 / 87 / 78), then `logits -= presence * output_mask`
#      (88 / 88 / 79);
#   3. temperature (sampler.py apply_temperature 217-226 / 228-237 / 230-239: `logits.div_(temp)`, a greedy
#      row (T < 1e-5, _SAMPLING_EPS l.18 / 17 / 19) is divided by 1.0 in a batch that is not all greedy);
#   4. min-p, an argmax-invariant logits processor (sample() 268 / 282 / 285; logits_processor/builtin.py
#      MinPLogitsProcessor.apply 101-115 / 102-116 / 102-116): probabilities = softmax(logits), masked where
#      `probability < max_probability * min_p` (prob space);
#   5. top-k, then top-p (topk_topp_sampler.py; CPU: forward_cpu 142 / 176 / 315 ->
#      apply_top_k_top_p_pytorch(allow_cpu_sync=True) 258 / 363 / 473): top-k keeps every token whose value
#      is >= the k-th largest (`logits < kth` masked: ties at the k-th value are all kept; the top-k-only path
#      apply_top_k_only 302 / 407 / 517 uses the same rule); top-p sorts ascending, takes the softmax of the
#      top-k-masked values and its cumulative sum and masks `cumsum <= 1 - p` (293 / 398 / 508), keeping the
#      largest token always: the kept set is the smallest prefix (by value, descending) whose mass is >= p;
#      among tokens *tied* at the boundary value, which ones are kept depends on the (unstable) sort;
#   6. processed logprobs = log_softmax of the masked logits (forward_cpu 159 / 193 / 333).
#   GPU: the same order; top-k/top-p run a Triton kernel (topk_topp_triton.py; 0.20: only for batches >= 8
#   rows, l.251) whose boundary/tie handling was not verified here.
#
# Model Runner V2 (GPU default from vLLM 0.29; v1/worker/gpu/sample/sampler.py in 0.32.0): logit bias ->
#   penalties (same formulas, Triton kernel penalties.py) -> bad words (l.69-76) -> temperature (l.263) ->
#   min-p in *logit* space (min_p.py l.35-44: `logits < max + log(min_p)` masked) -> top-k/top-p through the
#   same apply_top_k_top_p (l.345). MRv2 needs a GPU, which this project's CI lacks: its temperature and min-p
#   kernels, run by Triton's interpreter on the CPU with top-k/top-p from vLLM's PyTorch implementation, match
#   the twin's rules (tests/test_trainer.py, tests/scripts/mrv2_twin_interp.py). On a GPU (vLLM 0.32.0, H100,
#   benchmarks/gpu/mrv2_twin.py, 72 settings, 14400 sampled tokens) 14054 tokens matched within 1e-5 and 346
#   did not, all with top-p < 1: there top-k/top-p is vLLM's Triton kernel (topk_topp_triton.py, pivot-based),
#   which kept one token fewer than the nominal top-p (the sort above) on every such row without penalties
#   (220), nearly all rows that min-p had left with 2-5 finite logits, e.g. 1 of 2 tokens with mass 0.54 at
#   p=0.9. The kernel, run by Triton's interpreter on those rows, does the same on 95 of them. The twin follows
#   the nominal rule, so on MRv2 the branch stays `verified=False`: use the engine's support information.
#
# How the twin computes it without a full sort (an 8k x 152k fp32 sort holds 15 GB): every pass goes over
# vocabulary chunks (`chunk_bytes`), recomputing penalties and temperature per chunk from the logits. Pass A:
# the row max M and sum of exp (the full-vocabulary normalizer Z_T), the sampled token's value, and a running
# top-K candidate list (K = max(1024, the largest top-k), capped at the vocabulary). min-p and top-k become value
# thresholds (M + log(min_p); the k-th largest value). Pass B: the mass and size of the tokens at or above
# them. top-p: the candidates, sorted, give the smallest prefix whose mass reaches p; a row whose nucleus is
# not among the candidates is found by bisection on the logit value (chunked passes counting tokens and mass
# above a pivot until the undecided band holds <= K values, which are then gathered and sorted). Every
# threshold is a value, so the kept set is {x >= threshold} (plus a share of a tie group at the top-p
# boundary: tie-independent, the engine's kept count and mass do not depend on which tied token its sort
# kept). Rows where a min-p or top-p decision lies within rounding of the boundary (|x - (M + log min_p)| <
# 1e-5, or a cumulative mass within 2e-6 of p) are recomputed with the engine's own operations on that row
# alone (softmax / amax / sort / cumsum, as cited above), so on the engine's own logits the kept set is the
# engine's, bit for bit on the same device kind.
#
# Tokens outside the twin's support (no engine information, and the trainer's logits differ from the
# engine's: a sampled token was always inside the *engine's* kept set). Within `boundary_tolerance` (0.05,
# logit units after temperature) below the lowest kept value the two sides disagree on a near-tie at the
# boundary: with top-k / top-p (a kept set of fixed size) the token takes the place of the lowest kept
# token, with min-p (a value threshold) it joins the kept set; counted in `details["at_boundary"]`. Measured
# on the embedded model (tests/test_sampling_support.py): every such token was within 0.017 of the boundary,
# and the twin's kept-set size equalled the engine's, i.e. a swap. Further out the token joins the kept set
# (lp = x_t - logsumexp(kept ∪ {t}): finite, the smallest change that gives it a probability), counted in
# `details["outside_support"]`.

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
_MINP_MARGIN = 1e-5  # logit units: a token this close to min-p's threshold makes its row "exact replica"
_TOPP_MARGIN = 2e-6  # probability mass: a cumulative mass this close to p makes its row "exact replica"
_CANDIDATES = 1024  # candidate list per row (top values), at least the largest top-k
_GATHER = 4096  # bisection stops when the undecided band holds at most this many values
_UNSUPPORTED_PARAMS = ("logit_bias", "allowed_token_ids", "bad_words")
_NEG_INF = float("-inf")
_EXP_FLOOR = -87.0  # exp() below it is an fp32 denormal (many times slower on x86) and < 1.7e-38: floored


def _exp(d):
    """exp of a fresh fp32 tensor of differences (<= 0), in place, arguments floored at _EXP_FLOOR."""
    import torch

    return torch.exp(d.clamp_(min=_EXP_FLOOR), out=d)


@_dataclass(frozen=True)
class EngineRules:
    """The processing rules of one engine kind (vLLM version, model runner, device)."""

    vllm: str | None
    runner: str  # "v1" | "mrv2"
    device: str  # "cpu" | "cuda" | ...
    min_p: str  # "prob": probability < max_prob * min_p (V1); "logit": logit < max + log(min_p) (MRv2)
    top_k_top_p: str  # "torch_sort": apply_top_k_top_p_pytorch; "triton": topk_topp_triton (GPU)
    verified: bool  # checked against that engine's own logits in this project's tests
    note: str

    @property
    def key(self) -> str:
        return f"vllm={self.vllm or '?'} runner={self.runner} device={self.device}"


def engine_rules(engine: Any = None) -> EngineRules:
    """The rules the twin follows for ``engine``: what the engine reports (``CompletionOutput.rlpatch_support
    .engine``: ``{"vllm": "0.32.0", "runner": "v1", "device": "cpu"}``), a string ``"0.32.0/v1/cpu"``, an
    object with an ``engine`` attribute, or None (vLLM's V1 runner on CPU, the verified default)."""
    if engine is not None and not isinstance(engine, (str, _Mapping)) and hasattr(engine, "engine"):
        engine = engine.engine
    vllm_v, runner, device = None, "v1", "cpu"
    if isinstance(engine, _Mapping):
        vllm_v = engine.get("vllm")
        runner = str(engine.get("runner", runner)).lower()
        device = str(engine.get("device", device)).lower()
    elif isinstance(engine, str):
        parts = [p for p in engine.replace(",", "/").replace(" ", "/").split("/") if p]
        for p in parts:
            k, _, v = p.partition("=")
            if not v:
                k, v = ("runner" if p.lower() in ("v1", "mrv2") else "device" if p.lower() in ("cpu", "cuda", "xpu", "rocm")
                        else "vllm"), p
            if k == "vllm":
                vllm_v = v
            elif k == "runner":
                runner = v.lower()
            elif k == "device":
                device = v.lower()
    elif engine is not None:
        raise TypeError(f"engine: expected a dict, a string or an rlpatch_support object, got {type(engine).__name__}")
    if runner not in ("v1", "mrv2"):
        raise ValueError(f"engine runner {runner!r}: expected 'v1' or 'mrv2'")
    if runner == "mrv2":
        return EngineRules(vllm_v, runner, device, "logit", "triton", False,
                           "Model Runner V2 (GPU): min-p in logit space; Triton top-k/top-p, which keeps fewer "
                           "tokens than the nominal top-p on some rows (vLLM 0.32.0, measured): not verified")
    if device == "cpu":
        return EngineRules(vllm_v, runner, device, "prob", "torch_sort", True,
                           "V1 runner on CPU: apply_top_k_top_p_pytorch; verified on vLLM 0.20.2, 0.25.1, 0.32.0")
    return EngineRules(vllm_v, runner, device, "prob", "triton", False,
                       "V1 runner on a GPU: Triton top-k/top-p (boundary and tie rules not verified here)")


def _get(sp: Any, name: str, default: Any) -> Any:
    v = sp.get(name, default) if isinstance(sp, _Mapping) else getattr(sp, name, default)
    return default if v is None else v


def _row_params(sp: Any, vocab: int) -> tuple[float, int, float, float, float, float, float]:
    for name in _UNSUPPORTED_PARAMS:
        if _get(sp, name, None):
            raise NotImplementedError(f"processed_logprobs: sampling parameter {name!r} is not reproduced by the "
                                      "twin; sample without it or compare against the engine's returned logprobs")
    if int(_get(sp, "min_tokens", 0) or 0) > 0:
        raise NotImplementedError("processed_logprobs: min_tokens > 0 (stop tokens suppressed early) is not "
                                  "reproduced by the twin")
    t = float(_get(sp, "temperature", 1.0))
    k = int(_get(sp, "top_k", 0))
    if not 0 < k < vocab:  # vLLM: 0 < top_k < vocab_size is top-k, anything else is off (gpu_input_batch.py)
        k = 0
    return (t, k, float(_get(sp, "top_p", 1.0)), float(_get(sp, "min_p", 0.0)),
            float(_get(sp, "repetition_penalty", 1.0)), float(_get(sp, "presence_penalty", 0.0)),
            float(_get(sp, "frequency_penalty", 0.0)))


def _per_sequence(x: Any, n: int, what: str) -> list:
    """``x`` for each of ``n`` sequences: one value for all, or a sequence of ``n`` values."""
    import torch

    if x is None:
        return [None] * n
    if isinstance(x, torch.Tensor):
        if x.dim() == 1:
            return [x.tolist()] * n
        if x.dim() == 2 and x.shape[0] == n:
            return [[int(t) for t in row.tolist() if t >= 0] for row in x]
        raise ValueError(f"{what}: a tensor of shape {tuple(x.shape)} for {n} sequence(s)")
    if isinstance(x, _Sequence) and not isinstance(x, (str, bytes)):
        if len(x) and all(isinstance(t, int) for t in x):
            return [list(x)] * n
        if len(x) == n:
            return [None if r is None else [int(t) for t in r] for r in x]
        if not len(x):
            return [[]] * n
    raise ValueError(f"{what}: expected token ids (one list for every sequence, or one list per sequence; "
                     f"{n} sequence(s))")


class _Chunks:
    """The engine's processing of one vocabulary chunk: penalties, then temperature, as vLLM applies them.

    Penalties touch only tokens of the prompt and the output so far, so they are kept sparse: per sequence
    the distinct tokens U of its prompt, history and outputs, and per row (position) their output counts
    [N, |U|]; each chunk gathers those positions, applies vLLM's formulas and scatters them back."""

    def __init__(self, l2, tok, B, L, T, rep, pres, freq, prompts, hists, penalties: bool) -> None:
        import torch

        self.l2, self.tok, self.B, self.L = l2, tok, B, L
        self.N, self.V = l2.shape
        self.T, self.rep, self.pres, self.freq = T, rep, pres, freq
        self.penalties = penalties
        if not penalties:
            return
        dev = l2.device
        us, ins, h0 = [], [], []
        tok_cpu = tok.cpu()
        for b in range(B):
            pr = torch.tensor(prompts[b], dtype=torch.long)
            hi = torch.tensor(hists[b], dtype=torch.long)
            u = torch.unique(torch.cat([pr, hi, tok_cpu[b]]))
            us.append(u)
            ins.append(torch.isin(u, pr))
            h0.append((hi.unsqueeze(1) == u.unsqueeze(0)).sum(0).to(torch.int32) if hi.numel() else
                      torch.zeros(u.numel(), dtype=torch.int32))
        width = max(1, max(u.numel() for u in us))
        U = torch.full((B, width), -1, dtype=torch.long)
        in_prompt = torch.zeros(B, width, dtype=torch.bool)
        hist0 = torch.zeros(B, width, dtype=torch.int32)
        for b in range(B):
            n = us[b].numel()
            U[b, :n], in_prompt[b, :n], hist0[b, :n] = us[b], ins[b], h0[b]
        U, in_prompt, hist0 = U.to(dev), in_prompt.to(dev), hist0.to(dev)
        eq = (tok.unsqueeze(2) == U.unsqueeze(1)).to(torch.int32)  # [B, L, |U|]
        counts = eq.cumsum(1, dtype=torch.int32) - eq + hist0.unsqueeze(1)  # output tokens before position j
        self.U = U.unsqueeze(1).expand(B, L, width).reshape(B * L, width)
        self.counts = counts.reshape(B * L, width)
        self.hit = (in_prompt.unsqueeze(1) | (counts > 0)).reshape(B * L, width)
        self.inv_rep = 1.0 / rep  # fp32, as vLLM's `1.0 / penalties`

    def get(self, c0: int, c1: int, rows=None, scale: bool = False):
        """x = the processed fp32 logits of columns [c0, c1) (rows: a subset); with ``scale``, also dx/dl * T
        (the repetition penalty's factor, 1 elsewhere) for the backward pass."""
        import torch

        l = self.l2[:, c0:c1] if rows is None else self.l2[rows, c0:c1]
        T = self.T if rows is None else self.T[rows]
        sc = None
        if not self.penalties:
            x = l.to(torch.float32, copy=True)
        else:
            n, C = l.shape
            pick = (lambda t: t) if rows is None else (lambda t: t[rows])
            U, counts, hit = pick(self.U), pick(self.counts), pick(self.hit)
            inc = (U >= c0) & (U < c1) & hit
            idx = torch.where(inc, U - c0, torch.full_like(U, C))  # C: a spare column for the rest
            ext = torch.empty((n, C + 1), dtype=torch.float32, device=l.device)
            ext[:, :C] = l
            ext[:, C] = 0.0
            v = ext.gather(1, idx)
            one = torch.ones((), dtype=torch.float32, device=l.device)
            rep = pick(self.rep).unsqueeze(1)
            inv = pick(self.inv_rep).unsqueeze(1)
            # vLLM: penalties = where(prompt_mask | output_mask, rep, 1.0); scaling = where(logits > 0, 1.0 /
            # penalties, penalties); logits *= scaling; logits -= freq * counts; logits -= presence * mask
            scaling = torch.where(v > 0, torch.where(inc, inv, one), torch.where(inc, rep, one))
            v = v * scaling
            v = v - pick(self.freq).unsqueeze(1) * torch.where(inc, counts, 0)
            v = v - pick(self.pres).unsqueeze(1) * (inc & (counts > 0))
            ext.scatter_(1, idx, torch.where(inc, v, 0.0))
            x = ext[:, :C]
            if scale:
                sc_ext = torch.ones((n, C + 1), dtype=torch.float32, device=l.device)
                sc_ext.scatter_(1, idx, torch.where(inc, scaling, one))
                sc = sc_ext[:, :C]
        x /= T.unsqueeze(1)
        if scale:
            return x, sc
        return x


def _col_chunk(n_rows: int, V: int, chunk_bytes: int) -> int:
    # ~48 bytes per element of a chunk: the processed fp32 values and a handful of same-sized temporaries
    return int(max(256, min(V, chunk_bytes // max(1, 48 * n_rows))))


@_dataclass
class _Rows:
    """Per-row results of the forward pass (what the backward pass needs too)."""

    z_used: "Any"  # float64 [N]: the normalizer of the returned logprob (in x units)
    thr: "Any"  # float32 [N]: kept = x > thr, plus `frac` of the tie group x == thr (-inf: every finite token)
    frac: "Any"  # float64 [N]
    add_token: "Any"  # bool [N]: the token was outside the kept set and was added to it


def _replica_rows(x, k, p, m, rules: EngineRules):
    """The engine's own operations on whole rows ``x`` [r, V] (fp32, penalties and temperature applied):
    min-p, top-k, top-p exactly as vLLM's CPU sampler (see the citations above). Returns the masked x."""
    import torch

    if bool((m > 0).any()):
        if rules.min_p == "logit":  # MRv2 min_p.py: logits < max + log(min_p) -> -inf
            thr = x.max(dim=-1, keepdim=True).values + torch.log(m.unsqueeze(1))
            x = x.masked_fill(((m > 0).unsqueeze(1)) & (x < thr), float("-inf"))
        else:  # MinPLogitsProcessor.apply
            probs = torch.nn.functional.softmax(x, dim=-1)
            maxp = torch.amax(probs, dim=-1, keepdim=True)
            adjusted = maxp.mul_(m.unsqueeze(1))
            x = x.masked_fill(probs < adjusted, float("-inf"))
    V = x.shape[1]
    has_k = bool((k < V).any())
    has_p = bool((p < 1.0).any())
    if not has_p:
        if has_k:  # apply_top_k_only
            kk = k.clone()
            no_top_k = kk == V
            kk = kk.masked_fill(no_top_k, 1)
            max_top_k = int(kk.max())
            k_index = kk.sub_(1).unsqueeze(1)
            top_k_mask = x.topk(max_top_k, dim=1).values.gather(1, k_index.long())
            top_k_mask.masked_fill_(no_top_k.unsqueeze(1), -float("inf"))
            x = x.masked_fill(x < top_k_mask, -float("inf"))
        return x
    logits_sort, logits_idx = x.sort(dim=-1, descending=False)  # apply_top_k_top_p_pytorch
    if has_k:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        top_k_mask = logits_sort < top_k_mask
        logits_sort.masked_fill_(top_k_mask, -float("inf"))
    probs_sort = logits_sort.softmax(dim=-1)
    probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
    top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
    top_p_mask[:, -1] = False
    logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return x.scatter(dim=-1, index=logits_idx, src=logits_sort)


def _engine_info_tensor(engine_info: Any, B: int, L: int, device) -> tuple["Any", Any]:
    """(log_mass_kept [B, L] float64 with NaN where unknown, the engine descriptor if it came with it)."""
    import torch

    out = torch.full((B, L), float("nan"), dtype=torch.float64)
    engine = None
    if isinstance(engine_info, torch.Tensor):
        t = engine_info.detach().to(torch.float64).cpu().reshape(-1)
        if t.numel() != B * L:
            raise ValueError(f"engine_info: {t.numel()} values for {B} x {L} tokens")
        return t.reshape(B, L).to(device), None
    if isinstance(engine_info, _Mapping) and "log_mass_kept" in engine_info:
        engine = engine_info.get("engine")
        engine_info = engine_info["log_mass_kept"]
        if isinstance(engine_info, torch.Tensor):
            return _engine_info_tensor(engine_info, B, L, device)[0], engine
        engine_info = [engine_info] if B == 1 and engine_info and not isinstance(engine_info[0], (list, tuple)) else engine_info
    seqs = list(engine_info)
    if B == 1 and seqs and not isinstance(seqs[0], (list, tuple)) and not hasattr(seqs[0], "log_mass_kept") \
            and not isinstance(seqs[0], _Mapping) and seqs[0] is not None:
        seqs = [seqs]
    if len(seqs) != B:
        raise ValueError(f"engine_info: {len(seqs)} sequence(s) for {B}")
    for b, s in enumerate(seqs):
        if s is None:
            continue
        if hasattr(s, "log_mass_kept"):
            engine = engine or getattr(s, "engine", None)
            s = s.log_mass_kept
        elif isinstance(s, _Mapping):
            engine = engine or s.get("engine")
            s = s["log_mass_kept"]
        vals = [float("nan") if v is None else float(v) for v in list(s)[:L]]
        out[b, :len(vals)] = torch.tensor(vals, dtype=torch.float64)
    return out.to(device), engine


class _Twin:
    def __init__(self, logits, token_ids, sampling_params, prompt_token_ids, output_history, engine_info, engine,
                 chunk_bytes, candidates, tolerance=0.05):
        import torch

        if logits.dim() < 2:
            raise ValueError("processed_logprobs: logits must be [..., V]")
        if not logits.is_floating_point():
            raise TypeError("processed_logprobs: logits must be floating point")
        tok = torch.as_tensor(token_ids, device=logits.device).long()
        if tuple(tok.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"processed_logprobs: token_ids {tuple(tok.shape)} do not match logits "
                             f"{tuple(logits.shape)} (expected logits [..., L, V] and token_ids [..., L])")
        self.out_shape = tuple(tok.shape)
        V = logits.shape[-1]
        L = tok.shape[-1] if tok.dim() else 1
        B = max(1, tok.numel() // max(1, L))
        self.B, self.L, self.V, self.N = B, L, V, B * L
        self.tok = tok.reshape(B, L)
        if bool(((self.tok < 0) | (self.tok >= V)).any()):
            raise ValueError(f"processed_logprobs: token ids outside the vocabulary [0, {V})")
        self.tok_flat = self.tok.reshape(-1)
        self.l2 = logits.reshape(self.N, V)
        self.dev = logits.device
        sps = list(sampling_params) if isinstance(sampling_params, _Sequence) and not isinstance(
            sampling_params, (str, bytes, _Mapping)) else [sampling_params] * B
        if len(sps) != B:
            raise ValueError(f"processed_logprobs: {len(sps)} sampling_params for {B} sequence(s)")
        rows = [_row_params(sp, V) for sp in sps]
        f32 = torch.float32
        col = lambda i, dt=f32: torch.tensor([r[i] for r in rows], dtype=dt).repeat_interleave(L).to(self.dev)
        self.temp_raw = col(0)
        # vLLM's apply_temperature: a greedy row (T < _SAMPLING_EPS) is divided by 1.0
        self.T = torch.where(self.temp_raw < SAMPLING_EPS, torch.tensor(1.0, dtype=f32, device=self.dev), self.temp_raw)
        self.k = col(1, torch.long)
        self.k = torch.where(self.k > 0, self.k, torch.tensor(V, device=self.dev))
        self.p = col(2)
        self.m = col(3)
        rep, pres, freq = col(4), col(5), col(6)
        penalties = bool(((rep != 1.0) | (pres != 0.0) | (freq != 0.0)).any())
        prompts = _per_sequence(prompt_token_ids, B, "prompt_token_ids")
        hists = _per_sequence(output_history, B, "output_history")
        if penalties and bool((rep != 1.0).any()) and any(p is None for p in prompts):
            raise ValueError("processed_logprobs: repetition_penalty needs prompt_token_ids (the engine penalizes "
                             "prompt tokens too)")
        prompts = [p or [] for p in prompts]
        hists = [h or [] for h in hists]
        self.chunks = _Chunks(self.l2, self.tok, B, L, self.T, rep, pres, freq, prompts, hists, penalties)
        self.chunk_bytes = int(chunk_bytes)
        self.tolerance = float(tolerance)
        # candidate list width: a row's top-k values (its top-p nucleus lies among them), or `candidates` for a
        # top-p row without top-k
        has_k = self.k < V
        need = [int(self.k[has_k].max())] if bool(has_k.any()) else []
        if bool(((self.p < 1.0) & ~has_k).any()):
            need.append(candidates)
        self.K = int(min(V, max(need or [1])))
        self.engine_lm = None
        info_engine = None
        if engine_info is not None:
            self.engine_lm, info_engine = _engine_info_tensor(engine_info, B, L, self.dev)
            self.engine_lm = self.engine_lm.reshape(-1)
        self.rules = engine_rules(engine if engine is not None else info_engine)

    # ----------------------------------------------------------------------------------------------- passes
    def _pass_a(self):
        """Row max, sum of exp, the sampled token's value, the finite count, top-K candidates."""
        import torch

        N, V = self.N, self.V
        dev = self.dev
        M = torch.full((N,), float("-inf"), dtype=torch.float64, device=dev)
        S = torch.zeros(N, dtype=torch.float64, device=dev)
        xt = torch.empty(N, dtype=torch.float32, device=dev)
        nfin = torch.zeros(N, dtype=torch.long, device=dev)
        need_cand = bool(((self.k < V) | (self.p < 1.0)).any())
        cand = None
        pending: list = []
        C = _col_chunk(N, V, self.chunk_bytes)
        ar = torch.arange(N, device=dev)
        for c0 in range(0, V, C):
            c1 = min(V, c0 + C)
            x = self.chunks.get(c0, c1)
            mc = x.max(dim=1).values.double()
            newM = torch.maximum(M, mc)
            finite_new = torch.isfinite(newM)
            ref = torch.where(finite_new, newM, 0.0).float()  # exp in fp32 around an fp32 reference, summed in fp64
            sc = _exp(x - ref.unsqueeze(1)).sum(1, dtype=torch.float64) * torch.exp(ref.double() - torch.where(finite_new, newM, 0.0))
            S = torch.where(finite_new, S * torch.exp(torch.where(torch.isfinite(M), M - newM, float("-inf"))) + sc, S)
            M = newM
            nfin += (x > _NEG_INF).sum(1)  # (a compare: isfinite is several times slower on CPU)
            inr = (self.tok_flat >= c0) & (self.tok_flat < c1)
            if bool(inr.any()):
                idx = ar[inr]
                xt[idx] = x[idx, self.tok_flat[idx] - c0]
            if need_cand:  # each chunk's own top-K, merged once the pending ones are 4 K wide
                pending.append(x if x.shape[1] <= self.K else x.topk(self.K, dim=1).values)
                if sum(t.shape[1] for t in pending) >= 4 * self.K:
                    both = torch.cat(pending, dim=1)
                    pending = [both.topk(min(self.K, both.shape[1]), dim=1).values]
        if need_cand:
            both = torch.cat(pending, dim=1)
            cand = both.topk(min(self.K, both.shape[1]), dim=1).values
        return M, S, xt, nfin, cand

    def _mass_count(self, rows, thr, M, strict=False):
        """For rows: sum of exp(x - M) and count over x >= thr (x > thr with ``strict``), chunked."""
        import torch

        n = rows.numel()
        S = torch.zeros(n, dtype=torch.float64, device=self.dev)
        cnt = torch.zeros(n, dtype=torch.long, device=self.dev)
        C = _col_chunk(n, self.V, self.chunk_bytes)
        M32 = M.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            keep = (x > thr.unsqueeze(1)) if strict else (x >= thr.unsqueeze(1))
            keep &= x > _NEG_INF
            S += torch.where(keep, _exp(x - M32), 0.0).sum(1, dtype=torch.float64)
            cnt += keep.sum(1)
        # exp(x - M) in fp32 around the fp32-rounded M: rescale to the float64 M
        return S * torch.exp(M.float().double() - M), cnt

    def _near(self, rows, center, margin):
        """For rows: is any token within ``margin`` of ``center`` (logit units)?"""
        import torch

        n = rows.numel()
        hit = torch.zeros(n, dtype=torch.bool, device=self.dev)
        C = _col_chunk(n, self.V, self.chunk_bytes)
        c32 = center.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            hit |= ((x - c32).abs() <= margin).any(1)
        return hit

    def _bisect(self, rows, lo, hi, M, denom, target, mode):
        """v* = max{x : F(x) >= target}, F(v) = sum over x >= v of w(x) (w = 1 for mode "count", exp(x - M) /
        denom for "mass"), for rows where lo <= v* < hi (F(lo) >= target > F(hi)). Chunked passes over the
        rows still undecided halve [lo, hi) (on fp32 values) until it holds <= _GATHER values, which are then
        gathered and sorted. Returns (v*, F at the R-th value: the count R or the mass of the R largest)."""
        import torch

        dev = self.dev
        n = rows.numel()
        lo = lo.double().float()  # pivots are fp32 values, like x
        hi = hi.double().float()
        band = torch.full((n,), -1, dtype=torch.long, device=dev)  # values in [lo, hi); -1: not known yet
        for _ in range(200):
            act = torch.nonzero((band < 0) | (band > _GATHER)).squeeze(1)
            if not act.numel():
                break
            a_lo, a_hi = lo[act], hi[act]
            mid = (a_lo.double() + (a_hi.double() - a_lo.double()) / 2).float()
            stuck = (mid <= a_lo) | (mid >= a_hi)
            F_m, n_lo_mid, n_mid_hi = self._split(rows[act], a_lo, mid, a_hi, M[act],
                                                  None if denom is None else denom[act], mode)
            up = ~stuck & (F_m >= target[act])
            down = ~stuck & ~up
            lo[act] = torch.where(up, mid, a_lo)
            hi[act] = torch.where(down, mid, a_hi)
            band[act] = torch.where(up, n_mid_hi, torch.where(down, n_lo_mid, torch.zeros_like(n_lo_mid)))
            # stuck: lo and hi are adjacent fp32 values, every value in the band equals lo (a tie group)
        vals, F_hi = self._gather(rows, lo, hi, M, denom, mode)
        w = torch.ones_like(vals, dtype=torch.float64) if mode == "count" else \
            torch.exp(vals.double() - M.unsqueeze(1)) / denom.unsqueeze(1)
        w = torch.where(torch.isfinite(vals), w, torch.zeros((), dtype=torch.float64, device=dev))
        cum = F_hi.unsqueeze(1) + w.cumsum(1)
        reach = cum >= target.unsqueeze(1)
        first = torch.where(reach.any(1), reach.float().argmax(1), torch.tensor(vals.shape[1] - 1, device=dev))
        vstar = vals.gather(1, first.unsqueeze(1)).squeeze(1)
        return vstar, cum.gather(1, first.unsqueeze(1)).squeeze(1)

    def _split(self, rows, lo, mid, hi, M, denom, mode):
        """One pass: F(mid), #values in [lo, mid), #values in [mid, hi)."""
        import torch

        n = rows.numel()
        F = torch.zeros(n, dtype=torch.float64, device=self.dev)
        a = torch.zeros(n, dtype=torch.long, device=self.dev)
        b = torch.zeros(n, dtype=torch.long, device=self.dev)
        C = _col_chunk(n, self.V, self.chunk_bytes)
        lo_, mid_, hi_ = lo.unsqueeze(1), mid.unsqueeze(1), hi.unsqueeze(1)
        M32 = M.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            ge = x >= mid_
            if mode == "count":
                F += ge.sum(1)
            else:
                F += torch.where(ge, _exp(x - M32), 0.0).sum(1, dtype=torch.float64)
            a += ((x >= lo_) & ~ge).sum(1)
            b += (ge & (x < hi_)).sum(1)
        if mode != "count":
            F = F * torch.exp(M.float().double() - M) / denom
        return F, a, b

    def _gather(self, rows, lo, hi, M, denom, mode):
        """One pass: the values in [lo, hi) (at most _GATHER, sorted descending) and F(hi)."""
        import torch

        n = rows.numel()
        F = torch.zeros(n, dtype=torch.float64, device=self.dev)
        vals = None
        C = _col_chunk(n, self.V, self.chunk_bytes)
        lo_, hi_ = lo.unsqueeze(1), hi.unsqueeze(1)
        M32 = M.float().unsqueeze(1)
        ninf = torch.tensor(float("-inf"), device=self.dev)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            ge = x >= hi_
            if mode == "count":
                F += ge.sum(1)
            else:
                F += torch.where(ge, _exp(x - M32), 0.0).sum(1, dtype=torch.float64)
            xm = torch.where((x >= lo_) & ~ge, x, ninf)
            both = xm if vals is None else torch.cat([vals, xm], dim=1)
            vals = both.topk(min(_GATHER, both.shape[1]), dim=1).values
        if mode != "count":
            F = F * torch.exp(M.float().double() - M) / denom
        return vals, F

    # ----------------------------------------------------------------------------------------------- forward
    def forward(self):
        import torch

        N, V, dev = self.N, self.V, self.dev
        f64 = torch.float64
        M, S, xt, nfin, cand = self._pass_a()
        zT = M + torch.log(S)
        k, p, m = self.k, self.p, self.m
        thr = torch.full((N,), float("-inf"), dtype=torch.float32, device=dev)
        frac = torch.ones(N, dtype=f64, device=dev)
        z_kept = zT.clone()
        kept_count = nfin.clone()
        exact = torch.zeros(N, dtype=torch.bool, device=dev)
        has_m, has_k, has_p = m > 0, k < V, p < 1.0
        # for the boundary rule: is the kept set's size fixed by top-k/top-p (a near-tie swaps places with the
        # lowest kept token) or by a value threshold (min-p: a near-tie joins), and how many tokens share the
        # lowest kept value
        count_like = torch.zeros(N, dtype=torch.bool, device=dev)
        n_at_thr = torch.ones(N, dtype=torch.long, device=dev)
        # min-p and top-k: value thresholds; thr1 = the larger one
        thr1 = torch.full((N,), float("-inf"), dtype=f64, device=dev)
        if bool(has_m.any()):
            if self.rules.min_p == "logit":
                mt = (M.float() + torch.log(m)).double()
            else:
                mt = M + torch.log(m.double().clamp_min(1e-300))
            thr1 = torch.where(has_m, mt, thr1)
            rows = torch.nonzero(has_m).squeeze(1)
            if self.rules.min_p == "prob":
                exact[rows] |= self._near(rows, mt[rows], _MINP_MARGIN)
        if bool(has_k.any()):
            big = has_k & (k > cand.shape[1])
            kth = torch.full((N,), float("-inf"), dtype=f64, device=dev)
            small = has_k & ~big
            if bool(small.any()):
                kth[small] = cand[small].gather(1, (k[small] - 1).unsqueeze(1)).squeeze(1).double()
            if bool(big.any()):  # the k-th largest value by bisection (counting)
                rows = torch.nonzero(big).squeeze(1)
                lo = torch.full((rows.numel(),), -3.0e38, dtype=f64, device=dev)
                hi = M[rows] + 1.0
                v, _ = self._bisect(rows, lo, hi, M[rows], None, k[rows].double(), "count")
                kth[rows] = v.double()
            thr1 = torch.where(has_k, torch.maximum(thr1, kth), thr1)
        trunc1 = has_m | has_k
        if bool(trunc1.any()):
            rows = torch.nonzero(trunc1).squeeze(1)
            S1, n1 = self._mass_count(rows, thr1[rows].float(), M[rows])
            z_kept[rows] = M[rows] + torch.log(S1)
            kept_count[rows] = n1
            thr[rows] = thr1[rows].float()
            if bool(has_k.any()):
                kbind = has_k & (kth >= thr1)  # top-k is the binding threshold
                count_like |= kbind
                kb = torch.nonzero(kbind & (k <= cand.shape[1])).squeeze(1)
                if kb.numel():
                    n_at_thr[kb] = (cand[kb] == kth[kb].float().unsqueeze(1)).sum(1)
        else:
            S1 = None
        # top-p over the survivors
        if bool(has_p.any()):
            S_surv = S.clone()
            if S1 is not None:
                S_surv[rows] = S1
            p_eff = 1.0 - (1.0 - p)  # vLLM compares with `1 - p` in fp32
            p_eff = p_eff.double()
            prow = torch.nonzero(has_p).squeeze(1)
            c = cand[prow].double()
            c = torch.where(c >= thr1[prow].float().double().unsqueeze(1), c, torch.tensor(float("-inf"), dtype=f64, device=dev))
            e = torch.exp(c - M[prow].unsqueeze(1))
            csum = e.cumsum(1)
            q = csum / S_surv[prow].unsqueeze(1)
            target = p_eff[prow]
            covered = q[:, -1] >= target
            # R = number of candidates whose mass above is < p
            R = (q < target.unsqueeze(1)).sum(1) + 1
            R = torch.minimum(R, torch.tensor(c.shape[1], device=dev))
            vstar = c.gather(1, (R - 1).unsqueeze(1)).squeeze(1)
            mass = csum.gather(1, (R - 1).unsqueeze(1)).squeeze(1)
            # ambiguous: the decisive cumulative masses lie within rounding of p
            qR = q.gather(1, (R - 1).unsqueeze(1)).squeeze(1)
            qR1 = torch.where(R >= 2, q.gather(1, (R - 2).clamp_min(0).unsqueeze(1)).squeeze(1),
                              torch.tensor(-1.0, dtype=f64, device=dev))
            amb = ((qR - target).abs() <= _TOPP_MARGIN) | ((qR1 - target).abs() <= _TOPP_MARGIN)
            ok = covered
            idx_ok = prow[ok]
            thr[idx_ok] = vstar[ok].float()
            z_kept[idx_ok] = M[idx_ok] + torch.log(mass[ok])
            kept_count[idx_ok] = R[ok]
            exact[idx_ok] |= amb[ok]
            count_like[prow] = True
            n_at_thr[idx_ok] = 1
            # a tie group at v*: the share of it that is kept (tie-order independent count and mass)
            n_gt = (c > vstar.unsqueeze(1)).sum(1)
            n_eq_c = (c == vstar.unsqueeze(1)).sum(1)
            tie = ok & ((n_eq_c > 1) | (c[:, -1] == vstar))
            if bool(tie.any()):
                trows = prow[tie]
                _, n_ge = self._mass_count(trows, vstar[tie].float(), M[trows])
                n_eq = n_ge - n_gt[tie]
                frac[trows] = (R[tie] - n_gt[tie]).double() / n_eq.clamp_min(1).double()
                n_at_thr[trows] = n_eq.clamp_min(1)
            if bool((~covered).any()):  # the nucleus is wider than the candidates: bisection on the value
                brows = prow[~covered]
                lo = torch.where(torch.isfinite(thr1[brows]), thr1[brows], torch.full_like(thr1[brows], -3.0e38))
                hi = c[~covered][:, -1].clone()
                hi = torch.where(torch.isfinite(hi), hi, M[brows] + 1.0)
                v, cmass = self._bisect(brows, lo, hi, M[brows], S_surv[brows], p_eff[brows], "mass")
                _, n_gt_b = self._mass_count(brows, v.float(), M[brows], strict=True)
                kept_mass, n_ge_b = self._mass_count(brows, v.float(), M[brows])
                # kept count R: tokens above v*, plus as many tied at v* as the mass needs (tie-independent)
                mass_gt = kept_mass - (n_ge_b - n_gt_b).double() * torch.exp(v.double() - M[brows])
                need = ((p_eff[brows] * S_surv[brows] - mass_gt) / torch.exp(v.double() - M[brows])).clamp_min(1e-12)
                n_eq_keep = torch.minimum(torch.ceil(need - 1e-9), (n_ge_b - n_gt_b).double()).clamp_min(1)
                thr[brows] = v.float()
                kept_count[brows] = n_gt_b + n_eq_keep.long()
                z_kept[brows] = M[brows] + torch.log(mass_gt + n_eq_keep * torch.exp(v.double() - M[brows]))
                frac[brows] = n_eq_keep / (n_ge_b - n_gt_b).clamp_min(1).double()
                n_at_thr[brows] = (n_ge_b - n_gt_b).clamp_min(1)
                amb_b = ((cmass - p_eff[brows]).abs() <= _TOPP_MARGIN)
                exact[brows] |= amb_b
        # rows decided within rounding of a boundary: the engine's own operations on those rows
        self.replica_rows = int(exact.sum())
        in_set = None
        if self.replica_rows:
            erows = torch.nonzero(exact).squeeze(1)
            step = max(1, int(self.chunk_bytes // max(1, 24 * V)))
            for s0 in range(0, erows.numel(), step):
                r = erows[s0:s0 + step]
                x = self.chunks.get(0, V, rows=r)
                xm = _replica_rows(x, k[r], p[r], m[r], self.rules)
                fin = torch.isfinite(xm)
                kept_count[r] = fin.sum(1)
                z_kept[r] = torch.logsumexp(xm.double(), dim=1)
                lowest = torch.where(fin, xm, torch.tensor(float("inf"), device=dev)).min(1).values
                thr[r] = lowest
                n_eq = (x == lowest.unsqueeze(1)).sum(1)
                n_eq_keep = (fin & (x == lowest.unsqueeze(1))).sum(1)
                frac[r] = n_eq_keep.double() / n_eq.clamp_min(1).double()
                n_at_thr[r] = n_eq.clamp_min(1)
                count_like[r] = has_k[r] | has_p[r]
                if in_set is None:
                    in_set = torch.zeros(N, dtype=torch.bool, device=dev)
                    self._replica_mask = torch.zeros(N, dtype=torch.bool, device=dev)
                ar = torch.arange(r.numel(), device=dev)
                in_set[r] = fin[ar, self.tok_flat[r]]
                self._replica_mask[r] = True
        # the sampled token: in the kept set?
        inside = (xt > thr) | ((xt == thr) & (frac > 0))
        inside &= torch.isfinite(xt)
        if in_set is not None:
            inside = torch.where(self._replica_mask, in_set, inside)
        xt64 = xt.double()
        thr64 = thr.double()
        add = ~inside
        # outside, but within `boundary_tolerance` below the lowest kept value: the engine's logits put it on
        # the other side of the boundary (a near-tie). Top-k / top-p (a fixed size): it takes the place of the
        # lowest kept token; min-p (a value threshold): it joins. Further out: it joins, counted as outside.
        near = add & torch.isfinite(xt64) & torch.isfinite(thr64) & (thr64 - xt64 <= self.tolerance)
        swap = near & count_like
        z_join = torch.logaddexp(z_kept, xt64)
        z_swap = z_kept + torch.log1p(torch.exp(xt64 - z_kept) - torch.exp(thr64 - z_kept))
        z_twin = torch.where(swap, z_swap, torch.where(add, z_join, z_kept))
        frac = torch.where(swap, frac - 1.0 / n_at_thr.double(), frac)
        lp = xt64 - z_twin
        log_mass = z_kept - zT
        source_engine = torch.zeros(N, dtype=torch.bool, device=dev)
        z_used = z_twin
        if self.engine_lm is not None:
            known = torch.isfinite(self.engine_lm) & torch.isfinite(xt64)
            source_engine = known
            lp = torch.where(known, xt64 - zT - self.engine_lm, lp)
            z_used = torch.where(known, zT + self.engine_lm, z_twin)
            # gradient: lp_T's (the engine's mass is a constant): every finite token, normalizer Z_T
            thr = torch.where(known, torch.tensor(float("-inf"), device=dev), thr)
            frac = torch.where(known, torch.ones((), dtype=f64, device=dev), frac)
            add = add & ~known
            self.z_grad = torch.where(known, zT, z_twin)
        else:
            self.z_grad = z_twin
        self.rows = _Rows(z_used, thr, frac, add)
        self.details = {
            "outside_support": (add & ~near & ~source_engine).reshape(self.out_shape),
            "at_boundary": (near & ~source_engine).reshape(self.out_shape),
            "engine_info_used": source_engine.reshape(self.out_shape),
            "log_mass_kept": torch.where(source_engine, self.engine_lm if self.engine_lm is not None else log_mass,
                                         log_mass).float().reshape(self.out_shape),
            "kept_count": kept_count.reshape(self.out_shape),
            "lp_T": (xt64 - zT).float().reshape(self.out_shape),
            "exact_rows": self.replica_rows,
            "engine": self.rules.key,
            "engine_verified": self.rules.verified,
        }
        return lp.float().reshape(self.out_shape)

    # ----------------------------------------------------------------------------------------------- backward
    def backward(self, g):
        import torch

        N, V, dev = self.N, self.V, self.dev
        g = g.reshape(N).to(torch.float64)
        grad = torch.zeros((N, V), dtype=self.l2.dtype, device=dev)
        C = _col_chunk(N, V, self.chunk_bytes)
        thr = self.rows.thr.unsqueeze(1)
        frac = self.rows.frac.unsqueeze(1)
        zg = self.z_grad.unsqueeze(1)
        coef = (g / self.T.double()).unsqueeze(1)
        ar = torch.arange(N, device=dev)
        for c0 in range(0, V, C):
            c1 = min(V, c0 + C)
            x, sc = self.chunks.get(c0, c1, scale=True)
            w = torch.exp(x.double() - zg)
            keep = torch.where(x > thr, torch.ones((), dtype=torch.float64, device=dev),
                               torch.where(x == thr, frac, torch.zeros((), dtype=torch.float64, device=dev)))
            keep = torch.where(x > _NEG_INF, keep, torch.zeros((), dtype=torch.float64, device=dev))
            d = -w * keep
            inr = (self.tok_flat >= c0) & (self.tok_flat < c1)
            if bool(inr.any()):
                idx = ar[inr]
                cols = self.tok_flat[idx] - c0
                # the token: +1, and -w if it was added to the kept set (its own weight is then in Z)
                add = self.rows.add_token[idx].double()
                d[idx, cols] += 1.0 - add * w[idx, cols]
            d = d * coef
            if sc is not None:
                d = d * sc.double()
            grad[:, c0:c1] = d.to(grad.dtype)
        return grad


def _autograd_fn():
    import torch

    class _ProcessedLogprobsFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, l2, twin):  # noqa: D401 - torch API
            ctx.twin = twin
            return twin.forward()

        @staticmethod
        def backward(ctx, g):
            return ctx.twin.backward(g), None

    return _ProcessedLogprobsFn


def processed_logprobs(logits: Any, token_ids: Any, sampling_params: Any, *, prompt_token_ids: Any = None,
                       output_history: Any = None, engine_info: Any = None, engine: Any = None,
                       chunk_bytes: int = 256 << 20, boundary_tolerance: float = 0.05,
                       return_details: bool = False, _candidates: int = _CANDIDATES) -> Any:
    """Logprob of each sampled token under the distribution the vLLM engine sampled it from.

    logits:          [..., L, V] the trainer's logits at each generated position (any float dtype; computed
                     in fp32 as vLLM does). Leading dimensions are sequences, L the generated positions of
                     each: the output tokens before position j are ``output_history + token_ids[..., :j]``
                     (what frequency/presence/repetition penalties count).
    token_ids:       [..., L] the sampled tokens.
    sampling_params: one ``vllm.SamplingParams`` or dict for every sequence, or a list with one per sequence:
                     temperature, top_p, top_k, min_p, repetition/presence/frequency penalties.
    prompt_token_ids: the prompt (one list, or one per sequence): repetition_penalty needs it.
    output_history:  tokens generated before position 0 (when ``logits`` is a window of a longer output).
    engine_info:     the engine's support information: the ``rlpatch_support`` of each ``CompletionOutput``
                     (a list, one per sequence), their ``log_mass_kept`` lists, or a [..., L] tensor. Tokens
                     with it get ``lp_T(token) - log_mass_kept`` (never -inf); NaN entries fall back to the twin.
    engine:          which engine's rules to follow (:func:`engine_rules`; taken from ``engine_info`` when it
                     carries them; default: vLLM's V1 runner on CPU).
    chunk_bytes:     working memory per pass over the vocabulary (default 256 MiB); nothing of the size of
                     ``logits`` is allocated in the forward pass (the backward pass returns a gradient of it).
    boundary_tolerance: a sampled token this far (logit units, after temperature) below the twin's lowest
                     kept value is a near-tie the engine resolved the other way (see above).
    return_details:  also return a dict: ``at_boundary`` (bool, sampled tokens just outside the twin's kept set,
                     within the tolerance), ``outside_support`` (further out: renormalized over the kept set
                     plus the token), ``engine_info_used``, ``log_mass_kept``,
                     ``kept_count``, ``lp_T`` (full-vocabulary logprob after penalties and temperature),
                     ``exact_rows`` (rows recomputed with the engine's own operations), ``engine``.

    Differentiable with respect to ``logits`` (the kept set is a constant of the gradient; with engine
    information the gradient is that of lp_T, the engine's mass being a constant).
    """
    import torch

    twin = _Twin(logits, token_ids, sampling_params, prompt_token_ids, output_history, engine_info, engine,
                 chunk_bytes, _candidates, boundary_tolerance)
    if torch.is_grad_enabled() and logits.requires_grad:
        lp = _autograd_fn().apply(twin.l2, twin)
    else:
        with torch.no_grad():
            lp = twin.forward()
    return (lp, twin.details) if return_details else lp
