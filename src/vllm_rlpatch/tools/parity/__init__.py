"""``vllm-rlpatch parity``: do the rollout engine's logprobs agree with the trainer's, before and after a
weight update, with and without each fix?

For each configuration an engine starts in its own process (patches are chosen by environment before vLLM
is imported), samples rollouts, takes a weight update, and samples the same prompts again (so KV that
the prefix cache kept from the old weights shows up). Every sampled token's returned logprob is then
compared with a trainer-side reference from the same weights and sampling params (temperature, then
top-k, then top-p, as vLLM's sampler applies them):

- ``fp32``: the model in float32 (the bf16 checkpoint upcast), the default reference;
- ``bf16_fp32_head``: the model in bf16 with an fp32 head (:func:`vllm_rlpatch.trainer.fp32_lm_head`),
  what a bf16 trainer that follows the fp32-head advice computes.

Two configurations run no engine of their own: they score the ``all`` engine's rollouts (whose requests ask
for the engine's support information, ``extra_args={"rlpatch_support": True}``) with the trainer-side
computation a trainer would use: ``twin`` = :func:`vllm_rlpatch.trainer.processed_logprobs` on the
reference's logits (the twin of the engine's processing, no engine information), ``support`` = the same
with the engine's per-token support information (``lp_T - log_mass_kept``: never -inf).

Metrics per configuration, phase and reference: ``token_mult_prob_error`` (NeMo-RL's mean over tokens of
exp(|Δ|), Δ = vLLM logprob − reference logprob) and its max over tokens, mean |Δ|, a KL estimate
(k3: mean of r − 1 − log r with r = p_ref/p_vllm over the sampled tokens, i.e. KL(vLLM‖reference)), the
fraction of tokens with exp(|Δ|) > 1.05 (NeMo-RL's bound), non-finite tokens (a logprob of −inf on either
side, e.g. a token outside the other side's top-p set; excluded from the means) and tokens/s.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_rlpatch import __version__
from vllm_rlpatch.patches import ALL_PATCHES
from vllm_rlpatch.tools import options, plot, usermodel
from vllm_rlpatch.trainer import fp32_lm_head
from vllm_rlpatch.trainer import processed_logprobs as twin_logprobs
from vllm_rlpatch.versions import vllm_info

CONFIGS = ("stock", "processed_logprobs", "fp32_lm_head", "prefix_cache", "all", "twin", "support")
# scored from the `all` engine's rollouts with another trainer-side computation (no engine of their own)
DERIVED = {"twin": "all", "support": "all"}
ENGINE_CONFIGS = tuple(c for c in CONFIGS if c not in DERIVED)
FEATURES = ("rl_defaults", "fp32_lm_head", "prefix_cache")  # the patches the configurations tell apart
CONFIG_FEATURES = {
    "stock": (),
    "processed_logprobs": ("rl_defaults",),
    "fp32_lm_head": ("fp32_lm_head",),
    "prefix_cache": ("prefix_cache",),
    "all": FEATURES,
}
CONFIG_DOC = {
    "stock": "vLLM as installed: the stock profile, every patch off but the host fixes (cpu_amx_permission, "
             "without which vLLM CPU dies on AMX hosts); weights updated with vLLM's reload_weights",
    "processed_logprobs": "rl_defaults only (processed logprobs) among the fixes",
    "fp32_lm_head": "fp32_lm_head only among the fixes",
    "prefix_cache": "prefix_cache only (the guard: no KV of older weights reused)",
    "all": "the plugin's defaults (every fix)",
    "twin": "the `all` rollouts; reference side: vllm_rlpatch.trainer.processed_logprobs (the twin of the engine's "
            "processing, no engine information)",
    "support": "the `all` rollouts; reference side: the twin with the engine's support information "
               "(lp_T - log_mass_kept per token)",
}
REFERENCES = ("fp32", "bf16_fp32_head")
REFERENCE_DOC = {"fp32": "transformers, float32 (the bf16 checkpoint upcast)",
                 "bf16_fp32_head": "transformers, bfloat16 body + fp32 head (vllm_rlpatch.trainer.fp32_lm_head)"}
PHASES = ("before_refit", "after_refit")
BOUND = 1.05
METRICS = ("token_mult_prob_error", "max_mult_prob_error", "mean_abs_diff", "kl_k3", "frac_outside_bound",
           "non_finite", "tokens", "tokens_per_s", "outside_support", "at_boundary", "mean_log_mass_kept")

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


# ------------------------------------------------------------------------------------------ weights
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


# ------------------------------------------------------------------------------------------ reference
def processed_logprobs(logits, temperature: float, top_k: int, top_p: float):
    """[n, vocab] logits -> log-probs of the distribution vLLM samples from (temperature, top-k, top-p)."""
    import torch

    x = logits.float()
    if temperature > 0 and temperature != 1.0:
        x = x / temperature
    if top_k and 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sx, idx = torch.sort(x, dim=-1, descending=False)
        cum = sx.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False
        sx = sx.masked_fill(mask, -math.inf)
        x = torch.empty_like(x).scatter_(-1, idx, sx)
    return x.log_softmax(dim=-1)


class Reference:
    """Trainer-side models of one checkpoint (loaded lazily, one per reference kind)."""

    def __init__(self, path: str, device: str) -> None:
        self.path, self.device = path, device
        self._models: dict[str, Any] = {}

    def model(self, kind: str):
        if kind not in self._models:
            import torch
            from transformers import AutoModelForCausalLM

            dtype = torch.float32 if kind == "fp32" else torch.bfloat16
            m = AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(self.device).eval()
            if kind == "bf16_fp32_head":
                fp32_lm_head(m)
            self._models[kind] = m
        return self._models[kind]

    def logprobs(self, kind: str, prompt_ids: list[int], output_ids: list[int], sampling: dict,
                 method: str = "simple", support: dict | None = None) -> tuple[list[float], dict]:
        """The reference logprob of each output token: ``simple`` (temperature, top-k, top-p on the reference
        logits, :func:`processed_logprobs`), ``twin`` (:func:`vllm_rlpatch.trainer.processed_logprobs`) or
        ``support`` (the twin with the engine's ``support`` information). Returns (logprobs, counts)."""
        import torch

        if not output_ids:
            return [], {}
        m = self.model(kind)
        with torch.no_grad():
            ids = torch.tensor([prompt_ids + output_ids], device=self.device)
            logits = m(ids).logits[0].float()
            rows = logits[len(prompt_ids) - 1: len(prompt_ids) + len(output_ids) - 1]
            tok = torch.tensor(output_ids, device=self.device)
            if method == "simple":
                lp = processed_logprobs(rows, sampling["temperature"], sampling.get("top_k", 0) or 0,
                                        sampling.get("top_p", 1.0))
                return lp[torch.arange(len(output_ids)), tok].cpu().tolist(), {}
            sp = {k: sampling[k] for k in ("temperature", "top_p", "top_k") if k in sampling}
            info = support if method == "support" else None
            lp, det = twin_logprobs(rows, tok, sp, prompt_token_ids=prompt_ids, engine_info=info,
                                    engine=(support or {}).get("engine"), return_details=True)
            counts = {"outside_support": int(det["outside_support"].sum()), "at_boundary": int(det["at_boundary"].sum())}
            if info is not None:
                counts["log_mass_kept"] = [float(x) for x in det["log_mass_kept"].tolist()]
            return lp.cpu().tolist(), counts

    def close(self) -> None:
        self._models.clear()
        import gc

        gc.collect()
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ metrics
def metrics(vllm_lps: list, ref_lps: list) -> dict[str, Any]:
    """Agreement of one set of tokens. A token whose logprob is non-finite (or <= -1e29, vLLM's -inf as
    reported) on either side counts in ``non_finite`` and is left out of the means."""
    finite, non_finite = [], 0
    for a, b in zip(vllm_lps, ref_lps):
        if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or a < -1e29 or b < -1e29:
            non_finite += 1
            continue
        finite.append((a, b))
    n = len(finite)
    if not n:
        return {"tokens": len(vllm_lps), "non_finite": non_finite, "token_mult_prob_error": float("nan"),
                "max_mult_prob_error": float("nan"), "mean_abs_diff": float("nan"), "kl_k3": float("nan"),
                "frac_outside_bound": float("nan")}
    errs = [math.exp(min(abs(a - b), 50.0)) for a, b in finite]
    k3 = [math.exp(min(b - a, 50.0)) - 1.0 - (b - a) for a, b in finite]
    return {"tokens": len(vllm_lps), "non_finite": non_finite,
            "token_mult_prob_error": sum(errs) / n, "max_mult_prob_error": max(errs),
            "mean_abs_diff": sum(abs(a - b) for a, b in finite) / n, "kl_k3": sum(k3) / n,
            "frac_outside_bound": sum(e > BOUND for e in errs) / n}


def _agg(values: list[float]) -> dict[str, Any]:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"mean": float("nan"), "spread": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": mean, "spread": sd, "min": min(vals), "max": max(vals), "n": len(vals)}


DEFAULT_OUT = "vllm-rlpatch-out"


class ParityError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------ engines
def config_env(name: str) -> dict[str, str]:
    """The VLLM_RLPATCH_* environment of one configuration."""
    env: dict[str, str] = {}
    if name == "stock":  # vLLM as installed; host fixes (e.g. cpu_amx_permission) stay on
        return {"VLLM_RLPATCH_PROFILE": "stock"}
    for s in ALL_PATCHES:
        if s.name in FEATURES:
            on = s.name in CONFIG_FEATURES[name]
            if s.toggle is not None:
                env[s.env.name] = s.toggle.default if on else "stock"
            else:
                env[s.env.name] = "1" if on else "0"
    return env


def default_engine_args(model: str, user: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our engine defaults sized to ``model`` (max_model_len = min(1024, its positions); on CPU no chunked
    prefill), then ``user``'s arguments. See :func:`vllm_rlpatch.tools.usermodel.engine_args`."""
    import torch

    return usermodel.engine_args(model, user, cpu=not torch.cuda.is_available())


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.done = 0
        self.total = total
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="parity", unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, desc: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(desc, refresh=False)
            self.bar.update(n)
        else:
            print(f"[parity {self.done}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_config(name: str, spec: dict, workdir: Path, progress: _Progress, timeout: float) -> dict:
    spec = dict(spec, config=name, out=str(workdir / f"{name}.result.json"),
                refit_method="reload_weights" if name == "stock" else "push_weights",
                support=name in DERIVED.values())  # its requests ask for the engine's support information
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    env = _clean_env()
    env.update(config_env(name))
    steps_per_run = 3
    expected = 1 + steps_per_run * len(spec["prompts"])
    seen = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_rlpatch.tools._parity_engine", str(spec_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("@@parity "):
                ev = json.loads(line[9:])
                st = ev.get("stage")
                if st in ("ready", "generated", "refit"):
                    seen += 1
                    label = {"ready": "engine up", "refit": "weights updated"}.get(st, ev.get("phase", st))
                    progress.step(f"{name}: {label}")
            if time.monotonic() > deadline:
                proc.kill()
                break
        rc = proc.wait()
    if seen < expected:
        progress.step(f"{name}: failed", expected - seen)
    res_path = Path(spec["out"])
    if not res_path.exists():
        tail = log_path.read_text()[-4000:]
        raise ParityError(f"configuration {name}: the engine process exited with {rc} and wrote no result "
                          f"(log: {log_path})\n{tail}")
    res = json.loads(res_path.read_text())
    res["log"] = str(log_path)
    res["env"] = config_env(name)
    if not res.get("ok"):
        tail = log_path.read_text()[-3000:]
        raise ParityError(f"configuration {name} failed: {res.get('error')}\n{res.get('traceback', '')}\n"
                          f"log tail ({log_path}):\n{tail}")
    return res


# ------------------------------------------------------------------------------------------ the run
def run(*, model: str, configs: tuple[str, ...] = CONFIGS, temperature: float = 0.7, top_p: float = 0.9,
        top_k: int = 0, max_tokens: int = 48, prompts: int = 12, runs: int = 1, seed: int = 0,
        refit_to: str | None = None, refit_noise: float = 0.5, ignore_eos: bool = True, jobs: int = 1, engine_args: dict | None = None,
        workdir: str | None = None, keep_samples: bool = True, progress: bool = True,
        reference_device: str | None = None, timeout: float = 1800,
        references: tuple[str, ...] = REFERENCES) -> dict[str, Any]:
    import torch

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
        prog = _Progress(total, progress)
        dev = reference_device or ("cuda" if torch.cuda.is_available() else "cpu")
        raw: dict[str, Any] = {}
        try:
            if jobs <= 1:
                for name in engines:
                    raw[name] = _run_config(name, spec, wd, prog, timeout)
            else:  # engines overlap (start-up mostly)
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=jobs) as pool:
                    futs = {name: pool.submit(_run_config, name, spec, wd, prog, timeout) for name in engines}
                    raw = {name: futs[name].result() for name in engines}
            for name in configs:  # the derived configurations score a copy of their engine's rollouts
                if name in DERIVED:
                    raw[name] = copy.deepcopy(raw[DERIVED[name]])
            # the trainer side: one checkpoint's reference models in memory at a time
            for phase, path in (("before_refit", model), ("after_refit", refit_to)):
                ref = Reference(path, dev)
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
                prog.step(f"reference logprobs ({phase.replace('_', ' ')})")
        finally:
            prog.close()
        results = {name: _score(raw[name], keep_samples, references) for name in configs}
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


def _device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores)"


def _score(res: dict, keep_samples: bool, references: tuple[str, ...] = REFERENCES) -> dict:
    per_run: list[dict] = []
    for run_ in res["runs"]:
        entry: dict[str, Any] = {"run": run_["run"], "refit": run_["refit"]}
        for phase in PHASES:
            g = run_[phase]
            vl = [x for s in g["samples"] for x in s["logprobs"]]
            m = {kind: metrics(vl, [x for s in g["samples"] for x in s["reference"][kind]]) for kind in references}
            for kind in references:
                m[kind]["tokens_per_s"] = g["tokens_per_s"]
                counts = [s.get("reference_counts", {}).get(kind) or {} for s in g["samples"]]
                if any(counts):
                    m[kind]["outside_support"] = sum(c.get("outside_support", 0) for c in counts)
                    m[kind]["at_boundary"] = sum(c.get("at_boundary", 0) for c in counts)
                masses = [x for c in counts for x in c.get("log_mass_kept", [])]
                if masses:
                    m[kind]["mean_log_mass_kept"] = sum(masses) / len(masses)
            ph = {"metrics": m, "seconds": g["seconds"], "tokens": g["tokens"], "tokens_per_s": g["tokens_per_s"],
                  "cached_prompt_tokens": sum((s.get("num_cached_tokens") or 0) for s in g["samples"])}
            if keep_samples:
                for s in g["samples"]:
                    s["reference"] = {k: [x if math.isfinite(x) else -1e30 for x in v] for k, v in s["reference"].items()}
                ph["samples"] = g["samples"]
            entry[phase] = ph
        per_run.append(entry)
    summary = {kind: {phase: {k: _agg([r[phase]["metrics"][kind].get(k) for r in per_run]) for k in METRICS}
                      for phase in PHASES} for kind in references}
    return {"engine": res.get("engine"), "patches": res.get("patches"), "env": res.get("env"),
            "startup_seconds": res.get("startup_seconds"), "refit_method": per_run[0]["refit"]["method"],
            "summary": summary, "runs": per_run, "log": res.get("log")}


# ------------------------------------------------------------------------------------------ output
def _fmt(a: dict, digits: int = 4, pct: bool = False, count: bool = False) -> str:
    m = a["mean"]
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "n/a"
    if count:  # a count: an integer for one run, a mean with one decimal over several
        return f"{round(m)}" if a["n"] <= 1 else f"{m:.1f}±{a['spread']:.1f}"
    if pct:
        s = f"{100 * m:.1f}%"
        return s + (f"±{100 * a['spread']:.1f}" if a["n"] > 1 else "")
    s = f"{m:.{digits}f}"
    return s + (f"±{a['spread']:.{digits}f}" if a["n"] > 1 else "")


def table(report: dict, reference: str = "fp32") -> str:
    cols = ["config", "phase", "mult_prob_err", "max", "mean|Δlp|", "KL(k3)", f">{BOUND}", "non-finite",
            "tok/s"]
    rows = []
    for name, r in report["configs"].items():
        for phase in PHASES:
            s = r["summary"][reference][phase]
            rows.append([name if phase == "before_refit" else "", phase.replace("_", " "),
                         _fmt(s["token_mult_prob_error"]), _fmt(s["max_mult_prob_error"], 3),
                         _fmt(s["mean_abs_diff"]), _fmt(s["kl_k3"], 5), _fmt(s["frac_outside_bound"], pct=True),
                         _fmt(s["non_finite"], count=True), _fmt(s["tokens_per_s"], 0)])
    widths = [max(len(str(x[i])) for x in rows + [cols]) for i in range(len(cols))]
    line = lambda xs: "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))
    out = [line(cols), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def render(report: dict) -> str:
    s = report["sampling"]
    head = (f"vllm-rlpatch parity: vLLM {report['vllm']} on {report['device']}, model {report['model']}\n"
            f"sampling T={s['temperature']} top_p={s['top_p']} top_k={s['top_k'] or 'off'} max_tokens={s['max_tokens']}; "
            f"{report['prompts']} prompts x {report['runs']} run(s); weights after refit: "
            f"{report['weights_after_refit']['how']}")
    if report.get("prompt_note"):
        head += f"\n{report['prompt_note']}"
    parts = [head]
    for ref in report["references"]:
        parts.append("")
        parts.append(f"reference: {report['references'][ref]}")
        parts.append(table(report, ref))
    for name in ("twin", "support"):
        r = report["configs"].get(name)
        if r is None:
            continue
        s0 = r["summary"][_main_reference(report)]
        if name == "twin":
            parts.append(f"twin: {_fmt(s0['before_refit']['outside_support'], count=True)} / "
                         f"{_fmt(s0['after_refit']['outside_support'], count=True)} tokens (before / after refit) outside "
                         f"its own support, {_fmt(s0['before_refit']['at_boundary'], count=True)} / "
                         f"{_fmt(s0['after_refit']['at_boundary'], count=True)} at its boundary (near-ties)")
        else:
            parts.append(f"log(S) bias: the kept set's mean log mass per token is "
                         f"{_fmt(s0['before_refit']['mean_log_mass_kept'])} (before refit): a trainer that uses "
                         f"full-vocabulary logprobs at the rollout temperature is off by that much per token")
    parts.append("")
    parts.append("configurations: " + "; ".join(f"{k} = {v}" for k, v in report["config_doc"].items()))
    if report.get("jobs", 1) > 1:
        parts.append(f"tok/s measured with {report['jobs']} engines running at once (--jobs): compare with care")
    runs = report["runs"]
    parts.append(f"mult_prob_err = NeMo-RL's token_mult_prob_error, mean exp(|Δ logprob|) (1 = identical; its "
                 f"bound is {BOUND}); max = largest per-token value; >{BOUND} = share of tokens above the bound; "
                 "non-finite = tokens with -inf on one side; tok/s = generation after a warm-up; "
                 + (f"values are mean±sd over {runs} runs" if runs > 1 else "one run (--runs N gives mean±sd)"))
    return "\n".join(parts)


def _main_reference(report: dict) -> str:
    return "fp32" if "fp32" in report["references"] else next(iter(report["references"]))


def worst_all(report: dict, reference: str = "fp32") -> float | None:
    r = report["configs"].get("all")
    if r is None:
        return None
    return max(r["summary"][reference][p]["token_mult_prob_error"]["mean"] for p in PHASES)


def _json_safe(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_json_safe(v) for v in o]
    return o


def main(argv: list[str]) -> int:
    ap = options.parser(
        "vllm-rlpatch parity",
        "Rollout-vs-trainer logprob agreement per configuration (stock, each fix, all), before and after a\n"
        "weight update. With no arguments: the embedded model, T=0.7, top-p 0.9; the table on stdout,\n"
        "parity.json and parity.png in ./vllm-rlpatch-out/.")
    usermodel.add_model_options(ap, help=usermodel.MODEL_HELP + "; default: the embedded llama-tiny")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the rollouts")
    ap.add_argument("--top-p", type=float, default=0.9, help="top-p of the rollouts")
    ap.add_argument("--top-k", type=int, default=0, help="top-k of the rollouts, 0 = off")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="let samples end at EOS (default: every sample has --max-tokens tokens, ignore_eos)")
    ap.add_argument("--prompts", type=int, default=12, help="prompts per run")
    ap.add_argument("--runs", type=int, default=1, help="repeat with different prompts and seeds; mean ± sd")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' order and the sampling seeds")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--refit-to", help="checkpoint directory pushed as the update (default: the model + noise)")
    ap.add_argument("--refit-noise", type=float, default=0.5,
                    help="noise scale (x each matrix's std) of the default update")
    ap.add_argument("--engine-args", default="{}", help='JSON of extra vllm.LLM arguments, e.g. \'{"tensor_parallel_size": 2}\'')
    ap.add_argument("--references", default=",".join(REFERENCES),
                    help=f"trainer-side references to compare with (comma-separated subset of {','.join(REFERENCES)})")
    ap.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                    help="where parity.json and parity.png go (unless --json/--plot name other paths)")
    ap.add_argument("--json", metavar="PATH", help="the full report, per-token data included (default: DIR/parity.json)")
    ap.add_argument("--plot", metavar="PATH.png",
                    help="the Δ logprob distributions per configuration (default: DIR/parity.png; needs matplotlib)")
    ap.add_argument("--no-plot", action="store_true", help="write no plot")
    ap.add_argument("--max-error", type=float,
                    help="exit 1 if the `all` configuration's token_mult_prob_error (fp32 reference, either phase) exceeds it")
    ap.add_argument("--workdir", help="keep the engines' logs and the update's weights here (default: a temporary "
                                      "directory, removed at the end)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="engines run at once (start-up overlaps; tokens/s is then measured under contention)")
    ap.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                    help="no progress lines (each engine's vLLM log goes to a file in --workdir either way)")
    args = ap.parse_args(argv)

    try:
        eargs = json.loads(args.engine_args)
        if not isinstance(eargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        ap.error(f"--engine-args: {e}")
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if args.max_error is not None and "all" not in configs:
        ap.error("--max-error checks the `all` configuration; include it in --configs")
    if args.max_error is not None and args.max_error < 1.0:
        ap.error("--max-error is a token_mult_prob_error bound (>= 1.0)")
    json_path = Path(args.json) if args.json else Path(args.out) / "parity.json"
    plot_path = None if args.no_plot else (Path(args.plot) if args.plot else Path(args.out) / "parity.png")
    if args.plot and not plot.available():
        ap.error(plot.missing_message("--plot"))

    try:
        model = usermodel.resolve_for(args, "parity")
    except usermodel.ToolError as e:
        print(f"vllm-rlpatch parity: {e}", file=sys.stderr)
        return 2
    try:
        report = run(model=model, configs=configs, temperature=args.temperature, top_p=args.top_p,
                     top_k=args.top_k, max_tokens=args.max_tokens, prompts=args.prompts, runs=args.runs,
                     seed=args.seed, refit_to=args.refit_to, refit_noise=args.refit_noise, engine_args=eargs,
                     workdir=args.workdir, keep_samples=True, progress=not args.no_progress,
                     ignore_eos=not args.stop_at_eos, jobs=args.jobs,
                     references=tuple(k.strip() for k in args.references.split(",") if k.strip()))
    except (ParityError, usermodel.ToolError) as e:
        print(f"vllm-rlpatch parity: {e}", file=sys.stderr)
        return 2
    print(render(report))
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(_json_safe(report)))
        print(f"\nJSON: {json_path}")
        if plot_path is not None and plot.available():
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            plot.parity_plot(report, str(plot_path), reference=_main_reference(report))
            print(f"plot: {plot_path}")
        elif plot_path is not None:
            print(plot.missing_message(f"plot {plot_path}"))
    except OSError as e:
        print(f"vllm-rlpatch parity: cannot write the report: {e}", file=sys.stderr)
        return 2
    if args.max_error is not None:
        w = worst_all(report, _main_reference(report))
        if w is None or not (w <= args.max_error):
            print(f"FAIL: `all` token_mult_prob_error {w} > --max-error {args.max_error}", file=sys.stderr)
            return 1
        print(f"ok: `all` token_mult_prob_error {w:.4f} <= --max-error {args.max_error}")
    return 0
