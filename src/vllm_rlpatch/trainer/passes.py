"""Chunked passes over the processed logits of some rows: the reductions the kept-set search is built from
(row max and normaliser, the top candidates, mass and count above a value, values near a value, and the
bisection on the value for a threshold the candidates do not reach). None holds more than a chunk of a row.
"""

from __future__ import annotations

from vllm_rlpatch.trainer.chunks import NEG_INF, col_chunk, exp_floored
from vllm_rlpatch.trainer.inputs import Batch

GATHER = 4096  # bisection stops when the undecided band holds at most this many values


class VocabPasses:
    """The passes over ``batch``'s vocabulary, chunk by chunk (``batch.chunk_bytes`` of working memory)."""

    def __init__(self, batch: Batch) -> None:
        self.N, self.V, self.dev, self.chunk_bytes = batch.N, batch.V, batch.dev, batch.chunk_bytes
        self.chunks, self.k, self.p, self.K, self.tok_flat = batch.chunks, batch.k, batch.p, batch.K, batch.tok_flat

    def first(self):
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
        C = col_chunk(N, V, self.chunk_bytes)
        ar = torch.arange(N, device=dev)
        for c0 in range(0, V, C):
            c1 = min(V, c0 + C)
            x = self.chunks.get(c0, c1)
            mc = x.max(dim=1).values.double()
            newM = torch.maximum(M, mc)
            finite_new = torch.isfinite(newM)
            ref = torch.where(finite_new, newM, 0.0).float()  # exp in fp32 around an fp32 reference, summed in fp64
            sc = exp_floored(x - ref.unsqueeze(1)).sum(1, dtype=torch.float64) * torch.exp(ref.double() - torch.where(finite_new, newM, 0.0))
            S = torch.where(finite_new, S * torch.exp(torch.where(torch.isfinite(M), M - newM, float("-inf"))) + sc, S)
            M = newM
            nfin += (x > NEG_INF).sum(1)  # (a compare: isfinite is several times slower on CPU)
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

    def mass_count(self, rows, thr, M, strict=False):
        """For rows: sum of exp(x - M) and count over x >= thr (x > thr with ``strict``), chunked."""
        import torch

        n = rows.numel()
        S = torch.zeros(n, dtype=torch.float64, device=self.dev)
        cnt = torch.zeros(n, dtype=torch.long, device=self.dev)
        C = col_chunk(n, self.V, self.chunk_bytes)
        M32 = M.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            keep = (x > thr.unsqueeze(1)) if strict else (x >= thr.unsqueeze(1))
            keep &= x > NEG_INF
            S += torch.where(keep, exp_floored(x - M32), 0.0).sum(1, dtype=torch.float64)
            cnt += keep.sum(1)
        # exp(x - M) in fp32 around the fp32-rounded M: rescale to the float64 M
        return S * torch.exp(M.float().double() - M), cnt

    def near(self, rows, center, margin):
        """For rows: is any token within ``margin`` of ``center`` (logit units)?"""
        import torch

        n = rows.numel()
        hit = torch.zeros(n, dtype=torch.bool, device=self.dev)
        C = col_chunk(n, self.V, self.chunk_bytes)
        c32 = center.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            hit |= ((x - c32).abs() <= margin).any(1)
        return hit

    def bisect(self, rows, lo, hi, M, denom, target, mode):
        """v* = max{x : F(x) >= target}, F(v) = sum over x >= v of w(x) (w = 1 for mode "count", exp(x - M) /
        denom for "mass"), for rows where lo <= v* < hi (F(lo) >= target > F(hi)). Chunked passes over the
        rows still undecided halve [lo, hi) (on fp32 values) until it holds <= GATHER values, which are then
        gathered and sorted. Returns (v*, F at the R-th value: the count R or the mass of the R largest)."""
        import torch

        dev = self.dev
        n = rows.numel()
        lo = lo.double().float()  # pivots are fp32 values, like x
        hi = hi.double().float()
        band = torch.full((n,), -1, dtype=torch.long, device=dev)  # values in [lo, hi); -1: not known yet
        for _ in range(200):
            act = torch.nonzero((band < 0) | (band > GATHER)).squeeze(1)
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
        C = col_chunk(n, self.V, self.chunk_bytes)
        lo_, mid_, hi_ = lo.unsqueeze(1), mid.unsqueeze(1), hi.unsqueeze(1)
        M32 = M.float().unsqueeze(1)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            ge = x >= mid_
            if mode == "count":
                F += ge.sum(1)
            else:
                F += torch.where(ge, exp_floored(x - M32), 0.0).sum(1, dtype=torch.float64)
            a += ((x >= lo_) & ~ge).sum(1)
            b += (ge & (x < hi_)).sum(1)
        if mode != "count":
            F = F * torch.exp(M.float().double() - M) / denom
        return F, a, b

    def _gather(self, rows, lo, hi, M, denom, mode):
        """One pass: the values in [lo, hi) (at most GATHER, sorted descending) and F(hi)."""
        import torch

        n = rows.numel()
        F = torch.zeros(n, dtype=torch.float64, device=self.dev)
        vals = None
        C = col_chunk(n, self.V, self.chunk_bytes)
        lo_, hi_ = lo.unsqueeze(1), hi.unsqueeze(1)
        M32 = M.float().unsqueeze(1)
        ninf = torch.tensor(float("-inf"), device=self.dev)
        for c0 in range(0, self.V, C):
            x = self.chunks.get(c0, min(self.V, c0 + C), rows=rows)
            ge = x >= hi_
            if mode == "count":
                F += ge.sum(1)
            else:
                F += torch.where(ge, exp_floored(x - M32), 0.0).sum(1, dtype=torch.float64)
            xm = torch.where((x >= lo_) & ~ge, x, ninf)
            both = xm if vals is None else torch.cat([vals, xm], dim=1)
            vals = both.topk(min(GATHER, both.shape[1]), dim=1).values
        if mode != "count":
            F = F * torch.exp(M.float().double() - M) / denom
        return vals, F
