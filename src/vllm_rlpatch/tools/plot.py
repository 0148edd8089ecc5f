"""Figures with matplotlib (the optional ``plot`` extra: ``pip install 'vllm-rlpatch[plot]'``).

``parity_figure(report)``: one panel per configuration, the distribution of Δ logprob (vLLM − reference)
over every sampled token, before the weight update (filled) and after it (outline), on a symmetric-log
count axis so the tails stay visible. ``diff_figure(report)``: ``rollout-diff``'s differences B − A in units
of the larger within-side run range. ``*_plot(report, path)`` write them as PNG.
"""

from __future__ import annotations

import math
from typing import Any

INSTALL = "pip install 'vllm-rlpatch[plot]' (or: pip install matplotlib)"
COLORS = {"before_refit": "#3c6ebe", "after_refit": "#dc5a28"}
LABELS = {"before_refit": "before the weight update", "after_refit": "after the weight update"}


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def available() -> bool:
    try:
        import matplotlib  # noqa: F401

        return True
    except ImportError:
        return False


def missing_message(what: str) -> str:
    return f"{what}: not written, it needs matplotlib: {INSTALL}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, never a window
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(INSTALL) from e
    return plt


def _deltas(cfg: dict, phase: str, reference: str) -> list[float]:
    out = []
    for run in cfg["runs"]:
        for s in run[phase].get("samples", []):
            ref = s.get("reference", {}).get(reference)
            if ref is None:
                continue
            for a, b in zip(s["logprobs"], ref):
                if a is None or b is None or a < -1e29 or b < -1e29:
                    continue
                out.append(a - b)
    return out


def _num(v: Any) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"


def parity_figure(report: dict[str, Any], reference: str = "fp32", lim: float = 0.5, bins: int = 100):
    """The figure (a matplotlib ``Figure``): one axis per configuration, in the report's order."""
    plt = _pyplot()
    configs = list(report["configs"])
    fig, axes = plt.subplots(len(configs), 1, figsize=(10, 1.0 + 1.9 * len(configs)), sharex=True, squeeze=False)
    axes = axes[:, 0]
    edges = [-lim + 2 * lim * i / bins for i in range(bins + 1)]
    s = report["sampling"]
    fig.suptitle(f"Δ logprob = vLLM − {reference} reference, per sampled token "
                 f"(vLLM {report['vllm']}, T={s['temperature']}, top-p {s['top_p']}; |Δ| > {lim} counted at the edges)",
                 fontsize=11)
    for ax, name in zip(axes, configs):
        summ = report["configs"][name]["summary"][reference]
        for phase in ("before_refit", "after_refit"):
            vals = [max(-lim, min(lim, v)) for v in _deltas(report["configs"][name], phase, reference)]
            if phase == "before_refit":
                ax.hist(vals, bins=edges, color=COLORS[phase], alpha=0.55, label=LABELS[phase])
            else:
                ax.hist(vals, bins=edges, histtype="step", color=COLORS[phase], linewidth=1.6, label=LABELS[phase])
        ax.set_yscale("symlog", linthresh=1)
        ax.set_ylim(bottom=0)
        ax.axvline(0.0, color="#999999", linewidth=0.8)
        ax.set_ylabel("tokens")
        e0 = summ["before_refit"]["token_mult_prob_error"]["mean"]
        e1 = summ["after_refit"]["token_mult_prob_error"]["mean"]
        ax.set_title(f"{name}    mult_prob_err: before {_num(e0)}, after {_num(e1)}", loc="left", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(loc="upper right", fontsize=9, frameon=False)
    axes[-1].set_xlabel(f"Δ logprob (vLLM − {reference} reference)")
    axes[-1].set_xlim(-lim, lim)
    fig.tight_layout()
    return fig


def parity_plot(report: dict[str, Any], path: str, reference: str = "fp32", lim: float = 0.5, bins: int = 100) -> None:
    plt = _pyplot()
    fig = parity_figure(report, reference, lim, bins)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def diff_figure(report: dict[str, Any], clip: float = 5.0):
    """``rollout-diff``: one bar per statistic, B − A in units of the larger within-side run range."""
    plt = _pyplot()
    rows = list(report["stats"].items())
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * len(rows)))
    names, vals, colors = [], [], []
    for name, r in rows:
        unit = r["within_side_range"] or (abs(r["diff"]) or 1.0)
        vals.append(max(-clip, min(clip, r["diff"] / unit)) if unit else 0.0)
        names.append(name)
        colors.append("#c83c28" if r["flag"] else "#466ebe")
    ax.barh(range(len(rows)), vals, color=colors)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    ax.axvline(0.0, color="#777777", linewidth=0.8)
    for k in (-1, 1):
        ax.axvline(k, color="#bbbbbb", linewidth=0.8, linestyle="--")
    ax.set_xlim(-clip, clip)
    ax.set_xlabel(f"B − A / larger within-side run range (clipped at ±{clip:g}; red: flagged)")
    ax.set_title("rollout-diff: differences beyond the run-to-run spread are flagged", loc="left", fontsize=10)
    fig.tight_layout()
    return fig


def diff_plot(report: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig = diff_figure(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)
