"""The GPU top-k/top-p kernel keeps the nominal top-p: vLLM's Triton kernel (``topk_topp_triton.py``) can keep
one token fewer than top-p asks for.

Why:   on a GPU, Model Runner V2 (and V1 with Triton) masks top-k/top-p with the pivot-search kernel
       ``_topk_topp_kernel``. Its top-p search is a bisection over a probability pivot ``t``, keeping the
       tokens with ``prob > t``. Two things make it drop the boundary token:
       (1) on the full-row path the search starts at ``min_range = min_prob`` -- the probability of the
           smallest finite token itself -- and the comparison is strict, so no pivot the search can reach
           keeps that token. When the nominal top-p set is *every* finite token (a row that min-p, a grammar
           mask or a peaked distribution left with a few tokens) the search cannot succeed;
       (2) when the search stops without a pivot (18 iterations or a collapsed range) it takes the midpoint
           ``(max_range + min_range) / 2``, whose kept mass may be below ``p``, instead of ``min_range``,
           the bound whose kept mass is known to be >= ``p``; the same block also overrides a pivot found
           on the last iteration.
       Observed on an H100 (vLLM 0.32.0, MRv2): one token fewer than the nominal top-p on every row min-p
       had left with 2-5 tokens in the sampling-support grid (220 rows, kept-set logprobs off by up to 0.68).
How:   the kernel module is rebuilt from the installed vLLM's own source with two edits (the search starts
       below the smallest probability; the fallback keeps what ``min_range`` keeps and never overrides a
       found pivot) and ``apply_top_k_top_p_triton`` in ``vllm.v1.sample.ops.topk_topp_sampler`` (the
       function MRv2's sampler and V1's Triton path call) runs the rebuilt kernels. Same passes, same launch
       shapes: no extra work per decode step. The split-row pipeline (small batches, p-only rows) has a
       correct fallback already and is unchanged.
Targets: vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_triton (lazy: the module is imported by the
       sampler) and the two edited spans of vllm/v1/sample/ops/topk_topp_triton.py (the probe reads them; where
       vLLM has no Triton backend, a CPU host, the kernel is never used and the patch is ``not_needed``).
Upstream: not reported upstream yet (write-up and diffs: docs/mrv2.md, upstream_patches/mrv2_top_p/).
Remove when: upstream fixes the kernel; set ``fixed_in`` to that release.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import threading
import types

from vllm_rlpatch import _wrapping
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "mrv2_top_p"
MODULE = "vllm.v1.sample.ops.topk_topp_sampler"
KERNEL_MODULE = "vllm.v1.sample.ops.topk_topp_triton"
TARGET = f"{MODULE}:apply_top_k_top_p_triton"

# (1) the standalone top-p search's lower bound: strictly below the smallest finite probability
_LOW_OLD = "                min_range = tl.exp(min_logit - max_sample) / sum_exp_logits\n"
_LOW_NEW = ("                # below the smallest probability: `prob > pivot` must be able to keep every token\n"
            "                min_range = tl.exp(min_logit - max_sample) / sum_exp_logits * 0.5\n")
# (2) the non-converged fallback of the three top-p searches
_FALLBACK = re.compile(
    r"(?P<i> +)if \(max_range - min_range\) < 1e-9 or num_iters >= 18:\n"
    r"(?P=i)    p_pivot = \(max_range \+ min_range\) / 2\.0\n"
    r"(?P=i)    min_larger_prob = min_larger_0\n"
    r"(?P=i)    num_min_larger = num_min_larger_0\n"
    r"(?P=i)    p_pivots_sum = p_pivots_sum_0\n"
    r"(?P=i)    found_pivot = 1\n")


def _fallback_new(m: re.Match) -> str:
    i = m.group("i")
    return (f"{i}if found_pivot == 0:\n"
            f"{i}    if (max_range - min_range) < 1e-9 or num_iters >= 18:\n"
            f"{i}        # min_range keeps mass >= p (the search's invariant); no boundary-duplicate trim\n"
            f"{i}        p_pivot = min_range\n"
            f"{i}        min_larger_prob = 1.0\n"
            f"{i}        num_min_larger = tl.zeros((), dtype=tl.uint32)\n"
            f"{i}        p_pivots_sum = p\n"
            f"{i}        found_pivot = 1\n")


FALLBACK_SITES = 3  # top-k then top-p; standalone top-p on the outliers; standalone top-p on the full row


def has_bug(src: str) -> bool:
    """The kernel source holds both buggy spans (as in vLLM 0.32.0-0.34.0)."""
    return _LOW_OLD in src and len(_FALLBACK.findall(src)) == FALLBACK_SITES


def patched_source(src: str) -> str:
    """topk_topp_triton.py's source with the two edits; ValueError when the spans are not the known ones."""
    if not has_bug(src):
        raise ValueError("topk_topp_triton.py does not hold the known top-p search spans")
    out = src.replace(_LOW_OLD, _LOW_NEW, 1)
    return _FALLBACK.sub(_fallback_new, out)


def kernel_source_path() -> str | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        return None
    return os.path.join(os.path.dirname(spec.origin), "v1", "sample", "ops", "topk_topp_triton.py")


def load_kernels(src: str, tag: str) -> types.ModuleType:
    """Import a kernel module from source text. triton.jit reads a kernel's source from its file, so the text
    is written once to a content-named file under the temporary directory."""
    digest = hashlib.sha256(src.encode()).hexdigest()[:16]
    name = f"_vllm_rlpatch_{tag}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    d = os.path.join(tempfile.gettempdir(), f"vllm-rlpatch-kernels-{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name + ".py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(src)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


_KERNELS: list[types.ModuleType] = []
_LOAD_LOCK = threading.Lock()


def _patched_module() -> types.ModuleType:
    if _KERNELS:
        return _KERNELS[0]
    with _LOAD_LOCK:
        if not _KERNELS:
            with open(kernel_source_path(), encoding="utf-8") as fh:
                _KERNELS.append(load_kernels(patched_source(fh.read()), "topk_topp"))
        return _KERNELS[0]


def _apply_wrapper(wrapped, instance, args, kwargs):
    return _patched_module().apply_top_k_top_p_triton(*args, **kwargs)


def probe() -> bool:
    """The installed kernel source holds the two buggy spans, and vLLM runs Triton here (without a Triton
    backend, e.g. a CPU host, vLLM never imports the kernel and top-k/top-p runs its PyTorch implementation)."""
    path = kernel_source_path()
    if path is None or not os.path.exists(path):
        return False
    with open(path, encoding="utf-8") as fh:
        if not has_bug(fh.read()):
            return False
    return bool(getattr(importlib.import_module("vllm.triton_utils.importing"), "HAS_TRITON", False))


def _apply() -> None:
    path = kernel_source_path()
    with open(path, encoding="utf-8") as fh:
        patched_source(fh.read())  # the edits must apply before anything is wrapped
    _LAZY.apply()


_LAZY = _wrapping.LazyWrap(TARGET, _apply_wrapper, NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="GPU top-p keeps the nominal set: vLLM's Triton top-k/top-p kernel no longer drops the boundary "
            "token (rows min-p leaves with a few tokens; MRv2's default sampler)",
    vllm=">=0.29",
    fixed_in=None,
    targets=(),
    lazy_targets=(TARGET,),
    probe=probe,
    apply=_apply,
    revert=_LAZY.revert,
    upstream="not reported upstream yet (docs/mrv2.md has the write-up)",
    remove_when="upstream fixes topk_topp_triton.py's top-p search; then set fixed_in",
)
