"""The checks of a part's received bytes before anything is written: the sender's digests (re-computed only
for bytes that crossed a network), NaN/inf, and tied tensors equal. They record the digests the post-write
check compares the destination windows with (``Part.expected``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.tx_state import Part, Transaction, now


def check_sources(tx: Transaction, part: Part, aliases: dict[str, str]) -> list[dict[str, Any]]:
    """Every problem with the part's received bytes (``problem`` dicts: fingerprint, nonfinite, tied)."""
    t1 = now()
    probs = _digests(tx, part) + _finite(tx, part)
    tx.stage("check", now() - t1)
    return probs + _tied_equal(tx, part, aliases)


def _digests(tx: Transaction, part: Part) -> list[dict[str, Any]]:
    probs: list[dict[str, Any]] = []
    counted = all(m.nonfinite is not None for m in part.metas)
    if part.source.trusted_digests and counted:
        for m in part.metas:
            if m.fingerprint:
                part.expected[m.name] = m.fingerprint
        tx.check("sender_digest")
    elif tx.request.verify or tx.request.mode != "direct":
        tensors = part.tensors or {}
        ds = checks.digests([tensors[m.name] for m in part.metas])
        for m, d in zip(part.metas, ds):
            if m.fingerprint and d.key != m.fingerprint:
                probs.append(P.problem("fingerprint", m.name, f"{m.name}: the bytes received differ from the "
                                                              f"bytes sent (checksum {d.key} != {m.fingerprint})"))
            m.nonfinite = d.nonfinite
            part.expected[m.name] = d.key
        tx.check("transport_fingerprint" if any(m.fingerprint for m in part.metas) else "digest")
    return probs


def _finite(tx: Transaction, part: Part) -> list[dict[str, Any]]:
    if not all(m.nonfinite is not None for m in part.metas):
        return []
    probs = [P.problem("nonfinite", m.name, f"{m.name}: {m.nonfinite} of {math.prod(m.shape)} values are NaN or "
                                            "infinite") for m in part.metas if m.nonfinite]
    tx.check("finite")
    return probs


def _tied_equal(tx: Transaction, part: Part, aliases: dict[str, str]) -> list[dict[str, Any]]:
    tensors = part.tensors or {}
    probs = []
    for alias, target in aliases.items():
        if alias in tensors and target in tensors:
            a, b = part.expected.get(alias), part.expected.get(target)
            same = (a == b) if (a and b) else torch.equal(tensors[alias], tensors[target])
            if not same:
                probs.append(P.problem("tied", alias, f"{alias} differs from {target}, but the engine's model ties "
                                                      "them (one tensor): send equal tensors, or untie the model on "
                                                      "both sides"))
    if aliases:
        tx.check("tied_equal")
    return probs

