"""Trainer-side reference logprobs, computed independently of vllm_rlpatch (this module never imports it).

A trainer recomputes the logprob of every sampled token with its own copy of the weights; here that is
transformers in float32 on the same bf16 weights vLLM loaded. ``processed`` applies the sampling params
the way vLLM's sampler does (temperature, then top-k, then top-p, masked tokens at -inf), so the result is
the behaviour policy's logprob; ``processed=False`` gives the T=1 untruncated (raw) distribution.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

_MODELS: dict[str, object] = {}


def load(path: str, dtype=torch.float32):
    key = f"{path}:{dtype}"
    if key not in _MODELS:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        m.eval()
        _MODELS[key] = m
    return _MODELS[key]


def tokenize(path: str, text: str) -> list[int]:
    """Prompt token ids as vLLM's completions endpoint makes them (the model's tokenizer, special tokens on)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(text)["input_ids"]


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    """[n, vocab] fp32 logits -> [n, vocab] log-probs of the distribution vLLM samples from."""
    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    if top_k and top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        probs = sorted_x.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False  # keep at least one
        sorted_x = sorted_x.masked_fill(mask, -math.inf)
        x = torch.empty_like(x).scatter_(-1, idx, sorted_x)
    return x.log_softmax(dim=-1)


@torch.no_grad()
def token_logprobs(model, prompt_ids: list[int], output_ids: list[int], *, temperature=1.0, top_k=0, top_p=1.0,
                   processed=True) -> list[float]:
    """Logprob of each output token given the prompt and the preceding output tokens."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids).logits[0].float()
    pos = torch.arange(len(prompt_ids) - 1, len(prompt_ids) + len(output_ids) - 1)
    rows = logits[pos]
    lp = processed_logprobs(rows, temperature, top_k, top_p) if processed else rows.log_softmax(-1)
    return lp[torch.arange(len(output_ids)), torch.tensor(output_ids)].tolist()


def mismatch(vllm_lps: list[float], ref_lps: list[float]) -> dict:
    """NeMo-RL's token_mult_prob_error = mean exp(|gen_lp - ref_lp|), plus what it hides."""
    pairs = [(a, b) for a, b in zip(vllm_lps, ref_lps) if a is not None]
    outside = [(a, b) for a, b in pairs if not math.isfinite(b) or b < -1e29 or a < -1e29]
    finite = [(a, b) for a, b in pairs if (a, b) not in outside]
    errs = [math.exp(min(abs(a - b), 50.0)) for a, b in finite]
    return {"n": len(pairs), "n_finite": len(finite), "n_outside": len(outside),
            "token_mult_prob_error": sum(errs) / len(errs) if errs else float("nan"),
            "max": max(errs) if errs else float("nan"),
            "mean_abs_diff": sum(abs(a - b) for a, b in finite) / len(finite) if finite else float("nan")}


def perturbed_copy(src: str, dst: str, scale: float = 0.5, seed: int = 7) -> str:
    """Copy a model directory with every weight matrix perturbed by Gaussian noise (``scale`` x its std):
    "new weights" a trainer might push, different enough that stale KV is visible."""
    import shutil

    from safetensors.torch import load_file, save_file

    src_p, dst_p = Path(src), Path(dst)
    dst_p.mkdir(parents=True, exist_ok=True)
    for f in src_p.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst_p / f.name)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src_p / "model.safetensors"))
    out = {}
    for name, t in sorted(tensors.items()):
        if t.dim() >= 2:
            noise = torch.randn(t.shape, generator=g) * t.float().std() * scale
            out[name] = (t.float() + noise).to(t.dtype).contiguous()
        else:
            out[name] = t.clone()
    save_file(out, str(dst_p / "model.safetensors"), metadata={"format": "pt"})
    return str(dst_p)


def tiny_moe(dst: str, tokenizer_from: str) -> str:
    """A Mixtral-shaped MoE model (2 layers, 4 experts, top-2, head_dim 32) with seeded random weights and a
    sharpened head (lm_head x 20, so greedy decoding is not a coin toss), saved in the checkpoint format
    vLLM loads, with the tokenizer of ``tokenizer_from``."""
    import shutil

    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
                        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = MixtralForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_from) / f, Path(dst) / f)
    return dst


def byte_model(dst: str, positions: int = 512) -> str:
    """A stranger's model: Llama-shaped, ``positions`` maximum positions, and a byte-level tokenizer (one token
    per byte, no merges), so the embedded prompts (24 sentences, ~1,100 bytes) are longer than its whole
    context. Seeded random weights with a sharpened head (lm_head x 20); tokenizer files that load under
    transformers 4.x and 5.x."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(dst)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    eos = "<|eos|>"
    vocab[eos] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=eos, pad_token=eos, unk_token=eos)
    fast.save_pretrained(out)
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.pop("backend", None)
    tc["model_max_length"] = positions
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=positions,
                      tie_word_embeddings=False, bos_token_id=vocab[eos], eos_token_id=vocab[eos])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c["rope_theta"] = c.get("rope_parameters", {}).get("rope_theta", 10000.0)
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    return str(out)


def twin_token_logprobs(model, prompt_ids: list[int], output_ids: list[int], *, temperature=1.0, top_k=0, top_p=1.0,
                        tolerance=0.05) -> list[float]:
    """What ``vllm_rlpatch.trainer.processed_logprobs`` documents, computed independently on the full sorted
    vocabulary: a token in the kept set gets its processed logprob; a token just below the kept set's lowest
    value (within ``tolerance``) takes that token's place (top-k/top-p fix the kept set's size); further out it
    joins the kept set."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + output_ids])
        rows = model(ids).logits[0].float()[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
        x = rows / temperature if temperature > 0 else rows
        lp = processed_logprobs(rows, temperature, top_k, top_p)
    out = []
    for j, t in enumerate(output_ids):
        v = float(lp[j, t])
        if math.isfinite(v):
            out.append(v)
            continue
        kept = x[j][torch.isfinite(lp[j])].double()
        xt = float(x[j, t])
        lowest = float(kept.min())
        mass = float(torch.exp(kept - kept.max()).sum())
        m = float(kept.max())
        if lowest - xt <= tolerance and (top_k or top_p < 1.0):
            z = m + math.log(mass - math.exp(lowest - m) + math.exp(xt - m))
        else:
            z = m + math.log(mass + math.exp(xt - m))
        out.append(xt - z)
    return out


def support_token_logprobs(model, prompt_ids: list[int], output_ids: list[int], log_mass_kept: list[float], *,
                           temperature=1.0) -> list[float]:
    """lp_T(token) - log_mass_kept: the full-vocabulary logprob at the rollout temperature, renormalized with the
    engine's kept-set mass."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + output_ids])
        rows = model(ids).logits[0].float()[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
        lpT = (rows / temperature).log_softmax(-1)
    return [float(lpT[j, t]) - lm for j, (t, lm) in enumerate(zip(output_ids, log_mass_kept))]
