"""Build the small trained test models shipped as package data (src/vllm_rlpatch/models/).

    python scripts/make_models.py            # needs torch, transformers, tokenizers (pip install -e .[models])

Why ship models: the machines that run vLLM here cannot reach a model hub, and random weights give
near-uniform distributions that hide logprob bugs. Both models are trained for a few hundred steps on a
synthetic corpus generated from a seeded grammar, so their next-token distributions are peaked (arithmetic
and fixed phrases are near-deterministic; word choices keep some entropy for top-p/top-k to act on).

- `llama-tiny`: LlamaForCausalLM, hidden 128, 4 heads (head_dim 32; vLLM's CPU attention needs >= 32),
  2 KV heads (GQA), 2 layers, untied lm_head.
- `qwen2-tiny`: Qwen2ForCausalLM, same shape, qkv bias, tied embeddings (lm_head == embed_tokens).

Weights are stored in bfloat16 so vLLM (dtype=bfloat16) and an fp32 trainer-side reference see exactly the
same values. The committed files are the reference; rerunning the script on another torch build may
differ in the last bits (that is why the files are shipped rather than built at test time).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "src" / "vllm_rlpatch" / "models"
EOS = "<|endoftext|>"
SEED = 1234

NOUNS = ["cat", "dog", "model", "engine", "trainer", "token", "policy", "reward", "batch", "worker",
         "cache", "river", "garden", "robot", "teacher", "student"]
VERBS = ["sees", "likes", "updates", "samples", "moves", "finds", "builds", "reads", "checks", "keeps"]
ADJS = ["small", "quick", "red", "old", "new", "bright", "calm", "stale", "fresh", "large"]
PLACES = ["on the mat", "in the garden", "near the river", "at the station", "under the tree",
          "in the cache", "on the server"]


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return f"{a} + {b} = {a + b}."
    if kind < 0.5:
        start = rng.randint(1, 20)
        return "count: " + " ".join(str(start + i) for i in range(rng.randint(4, 8))) + "."
    if kind < 0.6:
        w = rng.choice(NOUNS)
        return f"spell {w}: " + " ".join(w) + "."
    return (f"the {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(VERBS)} "
            f"the {rng.choice(ADJS)} {rng.choice(NOUNS)} {rng.choice(PLACES)}.")


def corpus(n_docs: int, rng: random.Random) -> list[str]:
    return [" ".join(sentence(rng) for _ in range(rng.randint(3, 8))) for _ in range(n_docs)]


def build_tokenizer(texts: list[str], out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=EOS)
    fast.save_pretrained(out)
    return fast


def train(model, ids: torch.Tensor, steps: int, rng: torch.Generator) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    seq, bsz = 128, 16
    loss_val = float("nan")
    for step in range(steps):
        starts = torch.randint(0, ids.numel() - seq - 1, (bsz,), generator=rng)
        batch = torch.stack([ids[s: s + seq] for s in starts])
        out = model(input_ids=batch, labels=batch)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_val = float(out.loss)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d} loss {loss_val:.3f}", flush=True)
    return loss_val


@torch.no_grad()
def mean_entropy(model, ids: torch.Tensor) -> float:
    logits = model(input_ids=ids[:512].unsqueeze(0)).logits.float()
    p = logits.softmax(-1)
    return float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())


def _portable_configs(out: Path) -> None:
    """Make the files load under transformers 4.x and 5.x alike (vLLM 0.20 .. 0.32 environments)."""
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # "TokenizersBackend" exists only in transformers 5
    tc.pop("backend", None)
    tc["model_max_length"] = 1024
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
    c = json.loads((out / "config.json").read_text())
    c["rope_theta"] = c.get("rope_parameters", {}).get("rope_theta", 10000.0)  # transformers 4.x key
    (out / "config.json").write_text(json.dumps(c, indent=2) + "\n")


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(SEED)
    rng = random.Random(SEED)
    texts = corpus(3000, rng)
    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 rms_norm_eps=1e-5, rope_theta=10000.0)
    variants = {
        "llama-tiny": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
        "qwen2-tiny": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    }
    for name, (cfg_cls, model_cls, extra) in variants.items():
        out = OUT / name
        out.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] tokenizer", flush=True)
        tok = build_tokenizer(texts, out)
        ids = torch.tensor(tok(f" {EOS} ".join(texts))["input_ids"], dtype=torch.long)
        cfg = cfg_cls(**shape, **extra, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.eos_token_id, torch_dtype="bfloat16")
        model = model_cls(cfg)
        g = torch.Generator().manual_seed(SEED)
        print(f"[{name}] training ({sum(p.numel() for p in model.parameters())} parameters)", flush=True)
        loss = train(model, ids, steps=400, rng=g)
        model.eval()
        ent = mean_entropy(model, ids)
        model = model.to(torch.bfloat16)
        model.save_pretrained(out, safe_serialization=True)
        # A generation_config.json with non-default sampling values, as real checkpoints ship: vLLM's
        # `generation_config="auto"` would silently apply it to requests that do not set these fields.
        (out / "generation_config.json").write_text(json.dumps({
            "bos_token_id": tok.eos_token_id, "eos_token_id": tok.eos_token_id, "do_sample": True,
            "temperature": 0.6, "top_p": 0.8, "top_k": 20}, indent=2) + "\n")
        card = {"name": name, "architecture": model_cls.__name__, "seed": SEED, "train_steps": 400,
                "final_train_loss": round(loss, 4), "mean_next_token_entropy_nats": round(ent, 4),
                "uniform_entropy_nats": round(float(torch.log(torch.tensor(512.0))), 4),
                "torch": torch.__version__}
        _portable_configs(out)
        (out / "rlpatch_model_card.json").write_text(json.dumps(card, indent=2) + "\n")
        print(f"[{name}] {card}", flush=True)


if __name__ == "__main__":
    main()
