"""Processed logprobs on the trainer's side: ``processed_logprobs``, the twin of vLLM's sampler processing,
and its gradient. The processing rules it follows and how it computes them without a full sort are below;
the parts live in :mod:`~vllm_rlpatch.trainer.inputs` (the rows), :mod:`~vllm_rlpatch.trainer.passes` (the
chunked passes), :mod:`~vllm_rlpatch.trainer.kept_set` (the thresholds), :mod:`~vllm_rlpatch.trainer.replica`
(rows on a boundary) and :mod:`~vllm_rlpatch.trainer.support` (the engine's rules and support information).
"""

from __future__ import annotations

from dataclasses import dataclass as _dataclass
from typing import Any

from vllm_rlpatch.trainer.chunks import NEG_INF, col_chunk
from vllm_rlpatch.trainer.inputs import Batch
from vllm_rlpatch.trainer.kept_set import KeptSet, KeptSetSearch
from vllm_rlpatch.trainer.passes import VocabPasses
from vllm_rlpatch.trainer.replica import replicate

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


_CANDIDATES = 1024  # candidate list per row (top values), at least the largest top-k


@_dataclass
class _Rows:
    """Per-row results of the forward pass (what the backward pass needs too)."""

    z_used: "Any"  # float64 [N]: the normalizer of the returned logprob (in x units)
    thr: "Any"  # float32 [N]: kept = x > thr, plus `frac` of the tie group x == thr (-inf: every finite token)
    frac: "Any"  # float64 [N]
    add_token: "Any"  # bool [N]: the token was outside the kept set and was added to it


class _Twin:
    """One call of :func:`processed_logprobs`: the forward pass in steps (the first pass over the vocabulary,
    the kept set, the replica of rows on a boundary, the sampled token) and its backward pass."""

    def __init__(self, logits, token_ids, sampling_params, prompt_token_ids, output_history, engine_info, engine,
                 chunk_bytes, candidates, tolerance=0.05):
        self.b = Batch(logits, token_ids, sampling_params, prompt_token_ids, output_history, engine_info, engine,
                       chunk_bytes, candidates, tolerance)
        self.l2 = self.b.l2
        self.passes = VocabPasses(self.b)

    def forward(self):
        import torch

        M, S, xt, nfin, cand = self.passes.first()
        zT = M + torch.log(S)
        ks = KeptSetSearch(self.b, self.passes, M, S, cand).run(KeptSet.everything(zT, nfin))
        # rows decided within rounding of a boundary: the engine's own operations on those rows
        replicate(ks, self.b)
        return self._sampled_token(ks, xt, zT)

    def _sampled_token(self, ks: KeptSet, xt, zT):
        """Each sampled token's logprob under its row's kept set (the boundary rule for a token outside it), or
        from the engine's support information where given. Sets ``rows``, ``z_grad`` and ``details``."""
        import torch

        b, dev = self.b, self.b.dev
        # the sampled token: in the kept set?
        inside = (xt > ks.thr) | ((xt == ks.thr) & (ks.frac > 0))
        inside &= torch.isfinite(xt)
        if ks.in_set is not None:
            inside = torch.where(ks.replica_mask, ks.in_set, inside)
        xt64 = xt.double()
        thr64 = ks.thr.double()
        add = ~inside
        # outside, but within `boundary_tolerance` below the lowest kept value: the engine's logits put it on
        # the other side of the boundary (a near-tie). Top-k / top-p (a fixed size): it takes the place of the
        # lowest kept token; min-p (a value threshold): it joins. Further out: it joins, counted as outside.
        near = add & torch.isfinite(xt64) & torch.isfinite(thr64) & (thr64 - xt64 <= b.tolerance)
        swap = near & ks.count_like
        z_kept = ks.z_kept
        z_join = torch.logaddexp(z_kept, xt64)
        z_swap = z_kept + torch.log1p(torch.exp(xt64 - z_kept) - torch.exp(thr64 - z_kept))
        z_twin = torch.where(swap, z_swap, torch.where(add, z_join, z_kept))
        frac = torch.where(swap, ks.frac - 1.0 / ks.n_at_thr.double(), ks.frac)
        lp = xt64 - z_twin
        thr = ks.thr
        source_engine = torch.zeros(b.N, dtype=torch.bool, device=dev)
        z_used = z_twin
        if b.engine_lm is not None:
            known = torch.isfinite(b.engine_lm) & torch.isfinite(xt64)
            source_engine = known
            lp = torch.where(known, xt64 - zT - b.engine_lm, lp)
            z_used = torch.where(known, zT + b.engine_lm, z_twin)
            # gradient: lp_T's (the engine's mass is a constant): every finite token, normalizer Z_T
            thr = torch.where(known, torch.tensor(float("-inf"), device=dev), thr)
            frac = torch.where(known, torch.ones((), dtype=torch.float64, device=dev), frac)
            add = add & ~known
            self.z_grad = torch.where(known, zT, z_twin)
        else:
            self.z_grad = z_twin
        self.rows = _Rows(z_used, thr, frac, add)
        self.details = self._details(ks, add, near, source_engine, xt64, zT)
        return lp.float().reshape(b.out_shape)

    def _details(self, ks: KeptSet, add, near, source_engine, xt64, zT) -> dict[str, Any]:
        import torch

        b = self.b
        log_mass = ks.z_kept - zT
        return {
            "outside_support": (add & ~near & ~source_engine).reshape(b.out_shape),
            "at_boundary": (near & ~source_engine).reshape(b.out_shape),
            "engine_info_used": source_engine.reshape(b.out_shape),
            "log_mass_kept": torch.where(source_engine, b.engine_lm if b.engine_lm is not None else log_mass,
                                         log_mass).float().reshape(b.out_shape),
            "kept_count": ks.kept_count.reshape(b.out_shape),
            "lp_T": (xt64 - zT).float().reshape(b.out_shape),
            "exact_rows": ks.replica_rows,
            "engine": b.rules.key,
            "engine_verified": b.rules.verified,
        }

    def backward(self, g):
        """d lp / d logits, chunk by chunk: (onehot - the kept set's softmax) x dx/dl (1/T and the repetition
        penalty's factor); the kept set is a constant of the gradient."""
        import torch

        b = self.b
        N, V, dev = b.N, b.V, b.dev
        g = g.reshape(N).to(torch.float64)
        grad = torch.zeros((N, V), dtype=self.l2.dtype, device=dev)
        C = col_chunk(N, V, b.chunk_bytes)
        thr = self.rows.thr.unsqueeze(1)
        frac = self.rows.frac.unsqueeze(1)
        zg = self.z_grad.unsqueeze(1)
        coef = (g / b.T.double()).unsqueeze(1)
        ar = torch.arange(N, device=dev)
        for c0 in range(0, V, C):
            c1 = min(V, c0 + C)
            x, sc = b.chunks.get(c0, c1, scale=True)
            w = torch.exp(x.double() - zg)
            keep = torch.where(x > thr, torch.ones((), dtype=torch.float64, device=dev),
                               torch.where(x == thr, frac, torch.zeros((), dtype=torch.float64, device=dev)))
            keep = torch.where(x > NEG_INF, keep, torch.zeros((), dtype=torch.float64, device=dev))
            d = -w * keep
            inr = (b.tok_flat >= c0) & (b.tok_flat < c1)
            if bool(inr.any()):
                idx = ar[inr]
                cols = b.tok_flat[idx] - c0
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
