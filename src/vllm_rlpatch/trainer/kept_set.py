"""The kept set of each row as a value threshold, found without a full sort: min-p and top-k become value
thresholds (the larger binds), top-p takes the smallest prefix of the survivors whose mass reaches p (from
the candidate list, or by bisection on the value when the nucleus is wider), a tie group at the boundary is
kept in part (tie-order independent). Rows decided within rounding of a boundary are marked ``exact`` for
the replica (:mod:`vllm_rlpatch.trainer.replica`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_rlpatch.trainer.inputs import Batch
from vllm_rlpatch.trainer.passes import VocabPasses

MINP_MARGIN = 1e-5  # logit units: a token this close to min-p's threshold makes its row "exact replica"
TOPP_MARGIN = 2e-6  # probability mass: a cumulative mass this close to p makes its row "exact replica"


@dataclass
class KeptSet:
    """Per row: kept = x > thr, plus ``frac`` of the tie group x == thr (thr -inf: every finite token)."""

    thr: Any  # float32 [N]
    frac: Any  # float64 [N]
    z_kept: Any  # float64 [N]: log of the kept set's sum of exp (x units)
    kept_count: Any  # long [N]
    exact: Any  # bool [N]: decided within rounding of a boundary (recomputed by the replica)
    # for the boundary rule: is the kept set's size fixed by top-k/top-p (a near-tie swaps places with the
    # lowest kept token) or by a value threshold (min-p: a near-tie joins), and how many tokens share the
    # lowest kept value
    count_like: Any  # bool [N]
    n_at_thr: Any  # long [N]
    replica_rows: int = 0
    in_set: Any = None  # bool [N] on the replica's rows: the token is in the engine's kept set
    replica_mask: Any = None  # bool [N]: the replica's rows

    @classmethod
    def everything(cls, zT, nfin) -> KeptSet:
        """Every finite token kept (no truncation): normaliser ``zT``, ``nfin`` tokens."""
        import torch

        N, dev = zT.shape[0], zT.device
        return cls(thr=torch.full((N,), float("-inf"), dtype=torch.float32, device=dev),
                   frac=torch.ones(N, dtype=torch.float64, device=dev), z_kept=zT.clone(), kept_count=nfin.clone(),
                   exact=torch.zeros(N, dtype=torch.bool, device=dev),
                   count_like=torch.zeros(N, dtype=torch.bool, device=dev),
                   n_at_thr=torch.ones(N, dtype=torch.long, device=dev))


class KeptSetSearch:
    """min-p and top-k, then top-p over the survivors, for every row of ``b``. ``M``, ``S``: each row's max and
    sum of exp(x - M); ``cand``: its top-K values, descending (None without top-k and top-p)."""

    def __init__(self, b: Batch, passes: VocabPasses, M, S, cand) -> None:
        self.b, self.passes, self.M, self.S, self.cand = b, passes, M, S, cand
        self.has_m, self.has_k, self.has_p = b.m > 0, b.k < b.V, b.p < 1.0

    def run(self, ks: KeptSet) -> KeptSet:
        thr1 = self._min_p(ks)
        thr1, kth = self._top_k(thr1)
        rows, S1 = self._value_thresholds(ks, thr1, kth)
        if bool(self.has_p.any()):
            self._top_p(ks, thr1, rows, S1)
        return ks

    def _min_p(self, ks: KeptSet):
        """min-p's value threshold (-inf elsewhere); rows with a token within rounding of it are exact."""
        import torch

        b, M = self.b, self.M
        thr1 = torch.full((b.N,), float("-inf"), dtype=torch.float64, device=b.dev)
        if bool(self.has_m.any()):
            if b.rules.min_p == "logit":
                mt = (M.float() + torch.log(b.m)).double()
            else:
                mt = M + torch.log(b.m.double().clamp_min(1e-300))
            thr1 = torch.where(self.has_m, mt, thr1)
            rows = torch.nonzero(self.has_m).squeeze(1)
            if b.rules.min_p == "prob":
                ks.exact[rows] |= self.passes.near(rows, mt[rows], MINP_MARGIN)
        return thr1

    def _top_k(self, thr1):
        """The k-th largest value (from the candidates, or by bisection counting); thr1 the larger threshold."""
        import torch

        b, M, cand, has_k, k = self.b, self.M, self.cand, self.has_k, self.b.k
        if not bool(has_k.any()):
            return thr1, None
        big = has_k & (k > cand.shape[1])
        kth = torch.full((b.N,), float("-inf"), dtype=torch.float64, device=b.dev)
        small = has_k & ~big
        if bool(small.any()):
            kth[small] = cand[small].gather(1, (k[small] - 1).unsqueeze(1)).squeeze(1).double()
        if bool(big.any()):  # the k-th largest value by bisection (counting)
            rows = torch.nonzero(big).squeeze(1)
            lo = torch.full((rows.numel(),), -3.0e38, dtype=torch.float64, device=b.dev)
            hi = M[rows] + 1.0
            v, _ = self.passes.bisect(rows, lo, hi, M[rows], None, k[rows].double(), "count")
            kth[rows] = v.double()
        return torch.where(has_k, torch.maximum(thr1, kth), thr1), kth

    def _value_thresholds(self, ks: KeptSet, thr1, kth):
        """The kept set above thr1 on min-p / top-k rows. Returns (those rows, their sum of exp(x - M)), or
        (None, None) where no row has either."""
        import torch

        M, cand, has_k, k = self.M, self.cand, self.has_k, self.b.k
        trunc1 = self.has_m | has_k
        if not bool(trunc1.any()):
            return None, None
        rows = torch.nonzero(trunc1).squeeze(1)
        S1, n1 = self.passes.mass_count(rows, thr1[rows].float(), M[rows])
        ks.z_kept[rows] = M[rows] + torch.log(S1)
        ks.kept_count[rows] = n1
        ks.thr[rows] = thr1[rows].float()
        if bool(has_k.any()):
            kbind = has_k & (kth >= thr1)  # top-k is the binding threshold
            ks.count_like |= kbind
            kb = torch.nonzero(kbind & (k <= cand.shape[1])).squeeze(1)
            if kb.numel():
                ks.n_at_thr[kb] = (cand[kb] == kth[kb].float().unsqueeze(1)).sum(1)
        return rows, S1

    def _top_p(self, ks: KeptSet, thr1, rows, S1) -> None:
        """top-p over the survivors of thr1: the candidates' smallest prefix whose mass reaches p, a tie group
        at its last value kept in part; rows whose nucleus is wider than the candidates go to bisection."""
        import torch

        b, M, f64, dev = self.b, self.M, torch.float64, self.b.dev
        S_surv = self.S.clone()
        if S1 is not None:
            S_surv[rows] = S1
        p_eff = 1.0 - (1.0 - b.p)  # vLLM compares with `1 - p` in fp32
        p_eff = p_eff.double()
        prow = torch.nonzero(self.has_p).squeeze(1)
        c = self.cand[prow].double()
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
        amb = ((qR - target).abs() <= TOPP_MARGIN) | ((qR1 - target).abs() <= TOPP_MARGIN)
        ok = covered
        idx_ok = prow[ok]
        ks.thr[idx_ok] = vstar[ok].float()
        ks.z_kept[idx_ok] = M[idx_ok] + torch.log(mass[ok])
        ks.kept_count[idx_ok] = R[ok]
        ks.exact[idx_ok] |= amb[ok]
        ks.count_like[prow] = True
        ks.n_at_thr[idx_ok] = 1
        # a tie group at v*: the share of it that is kept (tie-order independent count and mass)
        n_gt = (c > vstar.unsqueeze(1)).sum(1)
        n_eq_c = (c == vstar.unsqueeze(1)).sum(1)
        tie = ok & ((n_eq_c > 1) | (c[:, -1] == vstar))
        if bool(tie.any()):
            trows = prow[tie]
            _, n_ge = self.passes.mass_count(trows, vstar[tie].float(), M[trows])
            n_eq = n_ge - n_gt[tie]
            ks.frac[trows] = (R[tie] - n_gt[tie]).double() / n_eq.clamp_min(1).double()
            ks.n_at_thr[trows] = n_eq.clamp_min(1)
        if bool((~covered).any()):  # the nucleus is wider than the candidates: bisection on the value
            self._top_p_bisect(ks, prow[~covered], thr1, c[~covered][:, -1].clone(), S_surv, p_eff)

    def _top_p_bisect(self, ks: KeptSet, brows, thr1, hi, S_surv, p_eff) -> None:
        """top-p on rows whose nucleus reaches below their lowest candidate ``hi``: v* by bisection on the
        value, then the kept count: tokens above v*, plus as many tied at v* as the mass needs."""
        import torch

        M = self.M
        lo = torch.where(torch.isfinite(thr1[brows]), thr1[brows], torch.full_like(thr1[brows], -3.0e38))
        hi = torch.where(torch.isfinite(hi), hi, M[brows] + 1.0)
        v, cmass = self.passes.bisect(brows, lo, hi, M[brows], S_surv[brows], p_eff[brows], "mass")
        _, n_gt_b = self.passes.mass_count(brows, v.float(), M[brows], strict=True)
        kept_mass, n_ge_b = self.passes.mass_count(brows, v.float(), M[brows])
        # kept count R: tokens above v*, plus as many tied at v* as the mass needs (tie-independent)
        mass_gt = kept_mass - (n_ge_b - n_gt_b).double() * torch.exp(v.double() - M[brows])
        need = ((p_eff[brows] * S_surv[brows] - mass_gt) / torch.exp(v.double() - M[brows])).clamp_min(1e-12)
        n_eq_keep = torch.minimum(torch.ceil(need - 1e-9), (n_ge_b - n_gt_b).double()).clamp_min(1)
        ks.thr[brows] = v.float()
        ks.kept_count[brows] = n_gt_b + n_eq_keep.long()
        ks.z_kept[brows] = M[brows] + torch.log(mass_gt + n_eq_keep * torch.exp(v.double() - M[brows]))
        ks.frac[brows] = n_eq_keep / (n_ge_b - n_gt_b).clamp_min(1).double()
        ks.n_at_thr[brows] = (n_ge_b - n_gt_b).clamp_min(1)
        amb_b = ((cmass - p_eff[brows]).abs() <= TOPP_MARGIN)
        ks.exact[brows] |= amb_b
