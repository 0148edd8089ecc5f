"""The engine's side of processed logprobs, as the trainer receives it: which engine's processing rules to
follow (:func:`engine_rules`), and the engine's per-token support information (``rlpatch_support``: the log mass
of the kept set) laid out as a tensor.

``engine_rules`` reads what the engine reports (``CompletionOutput.rlpatch_support.engine``, written by the
``sampling_support`` patch), a short string, or nothing (vLLM's V1 runner on CPU, the verified default).
"""

from __future__ import annotations

from collections.abc import Mapping as _Mapping
from dataclasses import dataclass as _dataclass
from typing import Any


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


def engine_info_tensor(engine_info: Any, B: int, L: int, device) -> tuple["Any", Any]:
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
            return engine_info_tensor(engine_info, B, L, device)[0], engine
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
