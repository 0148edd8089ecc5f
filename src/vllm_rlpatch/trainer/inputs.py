"""``processed_logprobs``' inputs, checked and laid out per row (one row per generated position): the token
ids, each row's sampling parameters as vLLM reads them, the penalties' token sets, the engine's support
information and the rules of the engine that sampled.
"""

from __future__ import annotations

from collections.abc import Mapping as _Mapping
from collections.abc import Sequence as _Sequence
from typing import Any

from vllm_rlpatch.trainer.chunks import Chunks
from vllm_rlpatch.trainer.support import engine_info_tensor, engine_rules

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
_UNSUPPORTED_PARAMS = ("logit_bias", "allowed_token_ids", "bad_words")


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


class Batch:
    """B sequences of L generated positions over a vocabulary of V: N = B * L rows. Per row: the token
    (``tok_flat``), the temperature vLLM divides by (``T``), top-k (V when off), top-p, min-p; ``chunks``
    gives the processed logits; ``K`` is the width of the candidate list; ``engine_lm`` the engine's log mass
    of the kept set (NaN where unknown; None without support information)."""

    def __init__(self, logits, token_ids, sampling_params, prompt_token_ids, output_history, engine_info, engine,
                 chunk_bytes, candidates, tolerance=0.05):
        self._shape(logits, token_ids)
        self._sampling(sampling_params, prompt_token_ids, output_history)
        self.chunk_bytes = int(chunk_bytes)
        self.tolerance = float(tolerance)
        # candidate list width: a row's top-k values (its top-p nucleus lies among them), or `candidates` for a
        # top-p row without top-k
        has_k = self.k < self.V
        need = [int(self.k[has_k].max())] if bool(has_k.any()) else []
        if bool(((self.p < 1.0) & ~has_k).any()):
            need.append(candidates)
        self.K = int(min(self.V, max(need or [1])))
        self.engine_lm = None
        info_engine = None
        if engine_info is not None:
            self.engine_lm, info_engine = engine_info_tensor(engine_info, self.B, self.L, self.dev)
            self.engine_lm = self.engine_lm.reshape(-1)
        self.rules = engine_rules(engine if engine is not None else info_engine)

    def _shape(self, logits, token_ids) -> None:
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

    def _sampling(self, sampling_params, prompt_token_ids, output_history) -> None:
        import torch

        B, L, V = self.B, self.L, self.V
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
        self.chunks = Chunks(self.l2, self.tok, B, L, self.T, rep, pres, freq, prompts, hists, penalties)
