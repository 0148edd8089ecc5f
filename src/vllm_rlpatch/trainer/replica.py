"""The exact replica: rows whose kept set was decided within rounding of a boundary (min-p's threshold, a
cumulative mass at top-p) are recomputed on the whole row with the engine's own operations, so that on the
engine's own logits the kept set is the engine's, bit for bit on the same device kind.
"""

from __future__ import annotations

from vllm_rlpatch.trainer.inputs import Batch
from vllm_rlpatch.trainer.kept_set import KeptSet
from vllm_rlpatch.trainer.support import EngineRules


def replica_rows(x, k, p, m, rules: EngineRules):
    """The engine's own operations on whole rows ``x`` [r, V] (fp32, penalties and temperature applied):
    min-p, top-k, top-p exactly as vLLM's CPU sampler (cited in :mod:`vllm_rlpatch.trainer.twin`). Returns the masked x."""
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


def replicate(ks: KeptSet, b: Batch) -> None:
    """Overwrite ``ks`` on its ``exact`` rows with what the engine's operations keep (``replica_rows``)."""
    import torch

    N, V, dev = b.N, b.V, b.dev
    k, p, m = b.k, b.p, b.m
    ks.replica_rows = int(ks.exact.sum())
    if not ks.replica_rows:
        return
    erows = torch.nonzero(ks.exact).squeeze(1)
    step = max(1, int(b.chunk_bytes // max(1, 24 * V)))
    for s0 in range(0, erows.numel(), step):
        r = erows[s0:s0 + step]
        x = b.chunks.get(0, V, rows=r)
        xm = replica_rows(x, k[r], p[r], m[r], b.rules)
        fin = torch.isfinite(xm)
        ks.kept_count[r] = fin.sum(1)
        ks.z_kept[r] = torch.logsumexp(xm.double(), dim=1)
        lowest = torch.where(fin, xm, torch.tensor(float("inf"), device=dev)).min(1).values
        ks.thr[r] = lowest
        n_eq = (x == lowest.unsqueeze(1)).sum(1)
        n_eq_keep = (fin & (x == lowest.unsqueeze(1))).sum(1)
        ks.frac[r] = n_eq_keep.double() / n_eq.clamp_min(1).double()
        ks.n_at_thr[r] = n_eq.clamp_min(1)
        ks.count_like[r] = (k < V)[r] | (p < 1.0)[r]
        if ks.in_set is None:
            ks.in_set = torch.zeros(N, dtype=torch.bool, device=dev)
            ks.replica_mask = torch.zeros(N, dtype=torch.bool, device=dev)
        ar = torch.arange(r.numel(), device=dev)
        ks.in_set[r] = fin[ar, b.tok_flat[r]]
        ks.replica_mask[r] = True
