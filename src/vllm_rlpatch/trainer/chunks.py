"""The twin's view of the logits, one vocabulary chunk at a time: the engine's penalties and temperature
applied to columns [c0, c1) of every row (or of some rows), so that no pass ever holds a processed copy of
the whole logits; and how wide a chunk is for a given working-memory budget.
"""

from __future__ import annotations

NEG_INF = float("-inf")
EXP_FLOOR = -87.0  # exp() below it is an fp32 denormal (many times slower on x86) and < 1.7e-38: floored


def exp_floored(d):
    """exp of a fresh fp32 tensor of differences (<= 0), in place, arguments floored at EXP_FLOOR."""
    import torch

    return torch.exp(d.clamp_(min=EXP_FLOOR), out=d)


def col_chunk(n_rows: int, V: int, chunk_bytes: int) -> int:
    # ~48 bytes per element of a chunk: the processed fp32 values and a handful of same-sized temporaries
    return int(max(256, min(V, chunk_bytes // max(1, 48 * n_rows))))


class Chunks:
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
