"""One ``vllm-rlpatch parity`` run: the arguments checked, the update's weights made, every configuration's
engine run, the trainer-side reference logprobs of every sampled token, and the scored report."""

from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_rlpatch import __version__
from vllm_rlpatch.tools.parity.configs import (
    BOUND,
    CONFIG_DOC,
    CONFIGS,
    DERIVED,
    ENGINE_CONFIGS,
    REFERENCE_DOC,
    REFERENCES,
    ParityError,
)
from vllm_rlpatch.tools.parity.engines import Progress, default_engine_args, run_config
from vllm_rlpatch.tools.parity.measure import score
from vllm_rlpatch.tools.parity.prompts import fitted_prompts
from vllm_rlpatch.tools.parity.reference import Reference
from vllm_rlpatch.versions import vllm_info


def perturb(src: str, dst: str, scale: float, seed: int) -> str:
    """``dst``: a copy of the checkpoint ``src`` with every matrix perturbed by seeded Gaussian noise of
    ``scale`` x its standard deviation (1-D tensors copied): "the trainer's next weights"."""
    import torch
    from safetensors.torch import load_file, save_file

    sp, dp = Path(src), Path(dst)
    files = sorted(sp.glob("*.safetensors"))
    if not files:
        raise ParityError(f"{src}: no *.safetensors checkpoint (parity updates weights from safetensors)")
    dp.mkdir(parents=True, exist_ok=True)
    for f in sp.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dp / f.name)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # a large checkpoint's noise is drawn on the GPU
    g = torch.Generator(device=dev).manual_seed(seed)
    for f in files:
        out = {}
        for name, t in sorted(load_file(str(f)).items()):
            if t.dim() >= 2 and t.is_floating_point():
                x = t.to(dev).float()
                noise = torch.randn(t.shape, generator=g, device=dev) * x.std() * scale
                out[name] = (x + noise).to(t.dtype).cpu().contiguous()
                del x, noise
            else:
                out[name] = t.clone()
        save_file(out, str(dp / f.name), metadata={"format": "pt"})
    return str(dp)


def run(*, model: str, configs: tuple[str, ...] = CONFIGS, temperature: float = 0.7, top_p: float = 0.9,
        top_k: int = 0, max_tokens: int = 48, prompts: int = 12, runs: int = 1, seed: int = 0,
        refit_to: str | None = None, refit_noise: float = 0.5, ignore_eos: bool = True, jobs: int = 1, engine_args: dict | None = None,
        workdir: str | None = None, keep_samples: bool = True, progress: bool = True,
        reference_device: str | None = None, timeout: float = 1800,
        references: tuple[str, ...] = REFERENCES) -> dict[str, Any]:
    import torch

    _check(model=model, configs=configs, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
           prompts=prompts, runs=runs, jobs=jobs, references=references)
    info = vllm_info()
    if refit_to is not None and not Path(refit_to, "config.json").exists():
        raise ParityError(f"--refit-to {refit_to}: not a local model directory (no config.json)")
    # bad engine arguments and prompts that cannot fit fail here, before any weights are written
    eargs = default_engine_args(model, engine_args)
    run_prompts, prompt_note = fitted_prompts(model, prompts, runs, seed, eargs["max_model_len"], max_tokens)
    if prompt_note and progress:
        print(f"[parity] {prompt_note}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    own_dir = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="rlpatch-parity-")) if own_dir else Path(workdir)
    wd.mkdir(parents=True, exist_ok=True)
    try:
        if refit_to is None:
            refit_to = perturb(model, str(wd / "weights-B"), refit_noise, seed + 1)
            weights_b = {"path": refit_to, "how": f"the model + Gaussian noise ({refit_noise} x each matrix's std, seed {seed + 1})"}
        else:
            weights_b = {"path": refit_to, "how": "given (--refit-to)"}
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens,
                    "ignore_eos": ignore_eos}
        run_seeds = [[seed * 1_000_003 + r * 1009 + i for i in range(prompts)] for r in range(runs)]
        spec = {"model": model, "refit_to": refit_to, "engine_args": eargs, "prompts": run_prompts,
                "seeds": run_seeds, "sampling": {k: v for k, v in sampling.items()}}
        if top_k == 0:
            spec["sampling"].pop("top_k")
        engines = [c for c in ENGINE_CONFIGS if c in configs or any(DERIVED.get(d) == c for d in configs)]
        total = len(engines) * (1 + 3 * runs) + 2
        prog = Progress(total, progress)
        dev = reference_device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            raw = _engine_runs(engines, spec, wd, prog, timeout, jobs)
            for name in configs:  # the derived configurations score a copy of their engine's rollouts
                if name in DERIVED:
                    raw[name] = copy.deepcopy(raw[DERIVED[name]])
            # the trainer side: one checkpoint's reference models in memory at a time
            for phase, path in (("before_refit", model), ("after_refit", refit_to)):
                _reference_side(raw, configs, references, phase, Reference(path, dev, progress), sampling)
                prog.step(f"reference logprobs ({phase.replace('_', ' ')})")
        finally:
            prog.close()
        results = {name: score(raw[name], keep_samples, references) for name in configs}
        return {
            "tool": "vllm-rlpatch parity", "vllm_rlpatch": __version__, "vllm": info.raw_version,
            "torch": torch.__version__, "device": _device_name(), "model": model,
            "weights_after_refit": weights_b, "sampling": sampling, "prompts": prompts, "runs": runs,
            "seed": seed, "jobs": jobs, "bound": BOUND, "prompt_note": prompt_note, "references": {k: REFERENCE_DOC[k] for k in references},
            "engine_args": eargs, "configs": results, "config_doc": {c: CONFIG_DOC[c] for c in configs},
            "seconds": time.perf_counter() - t_start,
        }
    finally:
        if own_dir:
            shutil.rmtree(wd, ignore_errors=True)


def _check(*, model: str, configs: tuple[str, ...], temperature: float, top_p: float, top_k: int, max_tokens: int,
           prompts: int, runs: int, jobs: int, references: tuple[str, ...]) -> None:
    """Arguments that would fail later (or give a run that proves nothing) are refused before anything runs."""
    for k in references:
        if k not in REFERENCES:
            raise ParityError(f"unknown reference {k!r}; choose from {', '.join(REFERENCES)}")
    if not references:
        raise ParityError("--references: at least one")
    for c in configs:
        if c not in CONFIGS:
            raise ParityError(f"unknown configuration {c!r}; choose from {', '.join(CONFIGS)}")
    if not 0 < top_p <= 1:
        raise ParityError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature <= 0:
        raise ParityError(f"--temperature must be > 0 (greedy decoding has no sampling distribution), got {temperature}")
    if top_k < 0:
        raise ParityError(f"--top-k must be >= 0 (0 = off), got {top_k}")
    if runs < 1 or prompts < 1 or max_tokens < 1 or jobs < 1:
        raise ParityError("--runs, --prompts, --max-tokens and --jobs must be >= 1")
    if not Path(model, "config.json").exists():
        raise ParityError(f"--model {model}: not a local model directory (no config.json)")


def _engine_runs(engines: list[str], spec: dict, wd: Path, prog: Progress, timeout: float, jobs: int) -> dict[str, Any]:
    """Each engine configuration's result, one engine at a time or ``jobs`` at once."""
    if jobs <= 1:
        return {name: run_config(name, spec, wd, prog, timeout) for name in engines}
    # engines overlap (start-up mostly)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futs = {name: pool.submit(run_config, name, spec, wd, prog, timeout) for name in engines}
        return {name: futs[name].result() for name in engines}


def _reference_side(raw: dict[str, Any], configs: tuple[str, ...], references: tuple[str, ...], phase: str,
                    ref: Reference, sampling: dict) -> None:
    """Every sample of ``phase``: its reference logprobs per reference kind (``ref``'s checkpoint), in place."""
    try:
        for name in configs:
            method = name if name in DERIVED else "simple"
            for run_ in raw[name]["runs"]:
                for smp in run_[phase]["samples"]:
                    smp["reference"], smp["reference_counts"] = {}, {}
                    for kind in references:
                        lps, counts = ref.logprobs(kind, smp["prompt_token_ids"], smp["token_ids"], sampling,
                                                   method, smp.get("support"))
                        smp["reference"][kind], smp["reference_counts"][kind] = lps, counts
    finally:
        ref.close()


def _device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
