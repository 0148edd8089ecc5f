"""The trainer side of ``vllm-rlpatch parity``: transformers models of one checkpoint (float32, or bf16 with
the fp32 head) and each sampled token's reference logprob, computed the simple way (temperature, top-k, top-p
on the reference logits), by the twin (:func:`vllm_rlpatch.trainer.processed_logprobs`) or by the twin with the
engine's support information."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

from vllm_rlpatch.trainer import fp32_lm_head
from vllm_rlpatch.trainer import processed_logprobs as twin_logprobs


def processed_logprobs(logits, temperature: float, top_k: int, top_p: float):
    """[n, vocab] logits -> log-probs of the distribution vLLM samples from (temperature, top-k, top-p)."""
    import torch

    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sx, idx = torch.sort(x, dim=-1, descending=False)
        cum = sx.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False
        sx = sx.masked_fill(mask, -math.inf)
        x = torch.empty_like(x).scatter_(-1, idx, sx)
    return x.log_softmax(dim=-1)


class Reference:
    """Trainer-side models of one checkpoint (loaded lazily, one per reference kind); ``progress``: show
    transformers' loading bars."""

    def __init__(self, path: str, device: str, progress: bool = True) -> None:
        self.path, self.device, self.progress = path, device, progress
        self._models: dict[str, Any] = {}

    def model(self, kind: str):
        if kind not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            dtype = torch.float32 if kind == "fp32" else torch.bfloat16
            with loading_bars(self.progress):
                m = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(self.device).eval()
            if kind == "bf16_fp32_head":
                fp32_lm_head(m)
            self._models[kind] = m
        return self._models[kind]

    def logprobs(self, kind: str, prompt_ids: list[int], output_ids: list[int], sampling: dict,
                 method: str = "simple", support: dict | None = None) -> tuple[list[float], dict]:
        """The reference logprob of each output token: ``simple`` (temperature, top-k, top-p on the reference
        logits, :func:`processed_logprobs`), ``twin`` (:func:`vllm_rlpatch.trainer.processed_logprobs`) or
        ``support`` (the twin with the engine's ``support`` information). Returns (logprobs, counts)."""
        import torch

        if not output_ids:
            return [], {}
        m = self.model(kind)
        with torch.no_grad():
            ids = torch.tensor([prompt_ids + output_ids], device=self.device)
            logits = m(ids).logits[0].float()
            rows = logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
            tok = torch.tensor(output_ids, device=self.device)
            if method == "simple":
                lp = processed_logprobs(rows, sampling["temperature"], sampling.get("top_k", 0) or 0,
                                        sampling.get("top_p", 1.0))
                return lp[torch.arange(len(output_ids)), tok].cpu().tolist(), {}
            sp = {k: sampling[k] for k in ("temperature", "top_p", "top_k") if k in sampling}
            info = support if method == "support" else None
            lp, det = twin_logprobs(rows, tok, sp, prompt_token_ids=prompt_ids, engine_info=info,
                                    engine=(support or {}).get("engine"), return_details=True)
            counts = {"outside_support": int(det["outside_support"].sum()), "at_boundary": int(det["at_boundary"].sum())}
            if info is not None:
                counts["log_mass_kept"] = [float(x) for x in det["log_mass_kept"].tolist()]
            return lp.cpu().tolist(), counts

    def close(self) -> None:
        self._models.clear()
        import gc

        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


@contextlib.contextmanager
def loading_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars (``Loading weights``) on or off while a model loads; as they were after."""
    from transformers.utils import logging as hf_logging

    turn_off = not enabled and hf_logging.is_progress_bar_enabled()
    if turn_off:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if turn_off:
            hf_logging.enable_progress_bar()
