"""The prompts of ``vllm-rlpatch parity``: sentences in the embedded models' grammar, fitted to a model's
context with its own tokenizer."""

from __future__ import annotations

import random
from typing import Any

from vllm_rlpatch.tools import usermodel

# Prompts in the embedded models' language (they were trained on this grammar); any tokenizer handles them.
_NOUNS = ["cat", "dog", "model", "engine", "trainer", "token", "policy", "reward", "batch", "worker", "cache",
          "river", "garden", "robot", "teacher", "student"]
_VERBS = ["sees", "likes", "updates", "samples", "moves", "finds", "builds", "reads", "checks", "keeps"]
_ADJS = ["small", "quick", "red", "old", "new", "bright", "calm", "stale", "fresh", "large"]
_PLACES = ["on the mat", "in the garden", "near the river", "at the station", "under the tree", "in the cache",
           "on the server"]


def _sentence(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.35:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        return f"{a} + {b} = {a + b}."
    if k < 0.5:
        s = rng.randint(1, 20)
        return "count: " + " ".join(str(s + i) for i in range(rng.randint(4, 8))) + "."
    if k < 0.6:
        w = rng.choice(_NOUNS)
        return f"spell {w}: " + " ".join(w) + "."
    return (f"the {rng.choice(_ADJS)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} "
            f"{rng.choice(_NOUNS)} {rng.choice(_PLACES)}.")


def make_prompts(n: int, run: int, seed: int, sentences: int = 24) -> list[str]:
    """``n`` prompts for one run: long enough to fill prefix-cache blocks, distinct across runs (so a run's
    second phase can only hit the KV its own first phase left)."""
    rng = random.Random(seed * 7919 + run)
    out = []
    for i in range(n):
        body = " ".join(_sentence(rng) for _ in range(sentences))
        tail = rng.choice(["the", "count:", f"{rng.randint(0, 49)} + {rng.randint(0, 49)} =", "spell"])
        out.append(f"{body} {tail}")
    return out


SENTENCE_STEPS = (24, 16, 12, 8, 6, 4, 3, 2, 1)


def fitted_prompts(model: str, n: int, runs: int, seed: int, max_model_len: int, max_tokens: int,
                   sentences: int = SENTENCE_STEPS[0]) -> tuple[list[list[Any]], str | None]:
    """Each run's prompts, fitted to the context ``max_model_len - max_tokens`` with the model's own
    tokenizer: the embedded prompts (24 sentences) are replaced by shorter ones (fewer sentences) until the
    longest fits; a prompt still too long is cut to its last tokens. Returns (prompts per run, a note saying
    what was done, or None when nothing was)."""
    budget = usermodel.prompt_budget(max_model_len, max_tokens)
    tok = usermodel.tokenizer(model)
    start = sentences
    for sentences in [start, *(k for k in SENTENCE_STEPS if k < start)]:
        texts = [make_prompts(n, r, seed, sentences) for r in range(runs)]
        longest = max(usermodel.longest_prompt(tok, t) for t in texts)
        if longest <= budget:
            break
    out, cut = [], 0
    for t in texts:
        fitted, c = usermodel.fit_prompts(tok, t, budget)
        out.append(fitted)
        cut += c
    if sentences == start and not cut:
        return out, None
    note = (f"prompts fitted to the context: {max_model_len} positions - {max_tokens} generated tokens = {budget} "
            f"prompt tokens with this model's tokenizer; {sentences} sentences per prompt instead of {start}")
    if cut:
        note += f", {cut} prompt(s) still longer were cut to their last {budget} tokens"
    return out, note
