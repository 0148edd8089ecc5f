"""PNG figures with Pillow only (vLLM already depends on it; no matplotlib needed).

``parity_plot(report, path)``: one panel per configuration, the distribution of Δ logprob (vLLM − fp32
reference) over every sampled token, before the weight update (filled) and after it (outline), on a
symlog-like count axis so the tails stay visible.
"""

from __future__ import annotations

import math
from typing import Any

W, PANEL_H, MARGIN_L, MARGIN_R, TOP, GAP = 980, 150, 90, 30, 70, 34
COLORS = {"before_refit": (60, 110, 190), "after_refit": (220, 90, 40)}


def available() -> bool:
    try:
        import PIL  # noqa: F401

        return True
    except ImportError:
        return False


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: a fixed bitmap font
        return ImageFont.load_default()


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


def parity_plot(report: dict[str, Any], path: str, reference: str = "fp32", lim: float = 0.5, bins: int = 100) -> None:
    from PIL import Image, ImageDraw

    configs = list(report["configs"])
    H = TOP + len(configs) * (PANEL_H + GAP) + 40
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    f_title, f_lab, f_small = _font(18), _font(14), _font(12)
    s = report["sampling"]
    d.text((MARGIN_L, 12), f"Δ logprob = vLLM − {reference} reference, per sampled token   (vLLM {report['vllm']}, "
                           f"T={s['temperature']}, top-p {s['top_p']})", fill="black", font=f_title)
    d.text((MARGIN_L, 38), "filled: before the weight update   outline: after it   "
                           f"(|Δ| > {lim} piled at the edges; count axis log(1+n))", fill=(80, 80, 80), font=f_small)
    x0, x1 = MARGIN_L, W - MARGIN_R
    bw = (x1 - x0) / bins

    def xbin(v: float) -> int:
        v = max(-lim, min(lim, v))
        return min(bins - 1, int((v + lim) / (2 * lim) * bins))

    hists = {}
    peak = 1.0
    for name in configs:
        for phase in ("before_refit", "after_refit"):
            h = [0] * bins
            for v in _deltas(report["configs"][name], phase, reference):
                h[xbin(v)] += 1
            hists[(name, phase)] = h
            peak = max(peak, max(h))
    scale = math.log1p(peak)
    for i, name in enumerate(configs):
        y0 = TOP + i * (PANEL_H + GAP)
        yb = y0 + PANEL_H
        d.rectangle([x0, y0, x1, yb], outline=(170, 170, 170))
        summ = report["configs"][name]["summary"][reference]
        e0 = summ["before_refit"]["token_mult_prob_error"]["mean"]
        e1 = summ["after_refit"]["token_mult_prob_error"]["mean"]
        fmt = lambda v: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4f}"
        d.text((8, y0 + 4), name, fill="black", font=f_lab)
        d.text((x0 + 6, y0 + 4), f"mult_prob_err before {fmt(e0)}  after {fmt(e1)}", fill=(60, 60, 60), font=f_small)
        cx = x0 + (x1 - x0) / 2
        d.line([cx, y0, cx, yb], fill=(200, 200, 200))
        for phase in ("before_refit", "after_refit"):
            h = hists[(name, phase)]
            col = COLORS[phase]
            pts = []
            for b, n in enumerate(h):
                hgt = (PANEL_H - 24) * math.log1p(n) / scale
                xa, xb = x0 + b * bw, x0 + (b + 1) * bw
                if phase == "before_refit":
                    if n:
                        d.rectangle([xa, yb - hgt, xb, yb], fill=col)
                else:
                    pts += [(xa, yb - hgt), (xb, yb - hgt)]
            if pts:
                d.line(pts, fill=COLORS["after_refit"], width=2)
        for t in (-lim, -lim / 2, 0.0, lim / 2, lim):
            tx = x0 + (t + lim) / (2 * lim) * (x1 - x0)
            d.line([tx, yb, tx, yb + 4], fill="black")
            d.text((tx - 14, yb + 5), f"{t:+.2f}", fill=(60, 60, 60), font=f_small)
    img.save(path, format="PNG")
