"""Every vLLM attribute the plugin wraps, and a source-level resolver for vLLM trees we cannot import.

The newest vLLM release is a CUDA-only wheel; CI checks at source level (AST) that each target still
exists in its Python tree, so API drift shows up before a user hits it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from vllm_rlpatch.hooks import config, explicit, weights
from vllm_rlpatch.patches import ALL_PATCHES


def all_targets(for_version: str | None = None) -> list[str]:
    """Patch spec targets plus the shared hooks' own targets (``module:Qual.name``), deduplicated.

    ``for_version``: only the targets a vLLM of that version would wrap (patches retired there by
    ``fixed_in``, or whose range ends before it, are left out: upstream may have removed what they wrap)."""
    from packaging.version import Version

    def wraps_in(s, v: str) -> bool:
        return (s.fixed_in is None or Version(v) < Version(s.fixed_in)) and s.specifier.contains(Version(v),
                                                                                               prereleases=True)

    specs = [s for s in ALL_PATCHES if for_version is None or wraps_in(s, for_version)]
    out: list[str] = []
    for t in [*(t for s in specs for t in (*s.targets, *s.lazy_targets)), config.TARGET, *weights.FRONTEND_TARGETS,
              *weights.WORKER_TARGETS, *explicit.TARGETS]:
        if t not in out:
            out.append(t)
    return out


def _module_file(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        node = d.func if isinstance(d, ast.Call) else d
        name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
        if name in ("dataclass", "config"):
            return True
    return False


def _class_defines(cls: ast.ClassDef, attr: str) -> bool:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == attr:
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == attr:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return True
    return attr == "__init__" and _is_dataclass(cls)


def resolve_in_source(root: Path, target: str) -> tuple[bool, str]:
    """Does ``module:Class.attr`` exist in the vLLM source tree at ``root`` (the dir holding ``vllm/``)?"""
    module, _, qual = target.partition(":")
    path = _module_file(root, module)
    if path is None:
        return False, f"module {module} not found"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    parts = qual.split(".")
    top = parts[0]
    if len(parts) == 1:
        names = set(classes) | {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        return (top in names), f"{top} {'found' if top in names else 'missing'} in {path.name}"
    cls = classes.get(top)
    if cls is None:
        return False, f"class {top} missing in {path.name}"
    attr = parts[1]
    seen = set()
    while cls is not None and cls.name not in seen:
        seen.add(cls.name)
        if _class_defines(cls, attr):
            return True, f"{cls.name}.{attr} found in {path.name}"
        # follow a base class defined in the same module (e.g. AsyncEngineArgs(EngineArgs))
        bases = [b.id for b in cls.bases if isinstance(b, ast.Name)]
        cls = next((classes[b] for b in bases if b in classes), None)
    return False, f"{top}.{attr} missing in {path.name}"


# ---------------------------------------------------------------------------------------------------------
# Model Runner V2 (vllm/v1/worker/gpu/, the GPU default from 0.29; the only GPU runner in 0.34). The plugin
# wraps nothing inside a model runner but the V1 runner's sample_tokens and sampler (`sampling_support`, V1
# only: on MRv2 a request that asks for it gets a WARNING): its hooks sit in the engine core, scheduler,
# output processor, the GPU worker and the model's LogitsProcessor, which both runners share. What it *uses* of the runner, and
# what must hold for its hooks to see MRv2's paths, is listed here and checked at source level per release
# (tests/source_level/test_mrv2.py; ci/sweep/source.py). Each entry: (what, module, class or "", needles):
# every needle must occur in that class's source (or the module's, with class "").
MRV2_RUNNER = "vllm.v1.worker.gpu.model_runner"
MRV2_CHECKS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("the GPU worker builds the MRv2 runner", "vllm.v1.worker.gpu_worker", "",
     ("from vllm.v1.worker.gpu.model_runner import GPUModelRunner",)),
    ("the model (refit, weight events: workerctx.model_of -> runner.get_model())", MRV2_RUNNER, "GPUModelRunner",
     ("def get_model(self)", "return self.model", "self.model = ")),
    ("reload_weights on the runner (Worker.reload_weights, the layerwise reload)", MRV2_RUNNER, "GPUModelRunner",
     ("def reload_weights(",)),
    ("the KV cache config (refit memory report, kv-pin)", MRV2_RUNNER, "GPUModelRunner",
     ("self.kv_cache_config = ",)),
    ("logits from the model's compute_logits (fp32 head: LogitsProcessor)", MRV2_RUNNER, "GPUModelRunner",
     ("self.model.compute_logits(",)),
    ("compute_logits goes through LogitsProcessor._get_logits (the fp32 head's target)",
     "vllm.model_executor.layers.logits_processor", "LogitsProcessor", ("self._get_logits(",)),
    ("the runner's sampler gets the engine's logprobs_mode (processed logprobs)", MRV2_RUNNER, "GPUModelRunner",
     ("logprobs_mode",)),
    ("the MRv2 sampler returns processed logprobs in the processed modes", "vllm.v1.worker.gpu.sample.sampler",
     "Sampler", ("PROCESSED_LOGPROBS_MODES",)),
    ("the runner's outputs are vllm.v1.outputs.ModelRunnerOutput (the engine core's version spans)",
     MRV2_RUNNER, "", ("from vllm.v1.outputs import", "ModelRunnerOutput")),
)


def _class_source(path: Path, cls: str) -> str | None:
    text = path.read_text(encoding="utf-8")
    if not cls:
        return text
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return ast.get_source_segment(text, node)
    return None


def mrv2_in_source(root: Path) -> list[tuple[str, bool, str]]:
    """Each MRv2 check against the vLLM tree at ``root``: (what, ok, detail)."""
    out = []
    for what, module, cls, needles in MRV2_CHECKS:
        path = _module_file(root, module)
        if path is None:
            out.append((what, False, f"module {module} not found"))
            continue
        src = _class_source(path, cls)
        if src is None:
            out.append((what, False, f"class {cls} missing in {module}"))
            continue
        missing = [n for n in needles if n not in src]
        where = f"{module}{':' + cls if cls else ''}"
        out.append((what, not missing, f"{where}: missing {missing}" if missing else f"{where}: found"))
    return out
