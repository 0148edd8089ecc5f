"""Small trained models shipped as package data (made by ``scripts/make_models.py``).

``path("llama-tiny")`` / ``path("qwen2-tiny")`` return local directories vLLM and transformers can load
with no model hub. See each directory's ``rlpatch_model_card.json`` for training loss and entropy.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT = "llama-tiny"
NAMES = ("llama-tiny", "qwen2-tiny")


def path(name: str = DEFAULT) -> str:
    if name not in NAMES:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {', '.join(NAMES)}")
    return str(HERE / name)
