"""Upstream-ready diffs: one per fix, against a stated pristine vLLM base, checked to apply.

Each directory under ``upstream_patches/`` at the repository root (shipped in the wheel as
``vllm_rlpatch/upstream_patches/``) holds one fix as vLLM would receive it: ``patch.toml`` (base, branch, status, the runtime
patch it mirrors), ``0001-*.patch`` (``git format-patch`` style, paths from vLLM's repository root), the
upstream test the PR adds (inside the patch and as a plain copy) and ``PR.md`` (vLLM's PR template).

Runtime patches without a diff say why in :data:`NO_DIFF` (fixed upstream in a release, a deliberate vLLM
default, or vllm-rlpatch's own API rather than a vLLM bug); ``tests/test_upstream.py`` keeps the two lists
complete.

"Pristine" means the Python tree inside upstream's own released ``vllm`` wheel for the base version
(``pip download --no-deps vllm==X``), never a repackaging: :func:`pristine_tree` downloads it once and keeps
only ``vllm/**/*.py`` under ``$VLLM_RLPATCH_SRC_CACHE`` (default ``~/.cache/vllm-rlpatch/src``); after that
every check is offline. :func:`check` copies the tree, runs ``git apply --check``, applies the diff, and runs
``git apply --reverse --check``.

    vllm-rlpatch upstream                 # the table: name, base, upstream status, runtime patch
    vllm-rlpatch upstream --show NAME     # PR.md and the diff's file list
    vllm-rlpatch upstream --check [NAME]  # apply each diff to its pristine base(s) (downloads once)
"""

from __future__ import annotations

import os
import py_compile
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from vllm_rlpatch import envs
from vllm_rlpatch.tools import options


def _root() -> Path:
    package = Path(__file__).resolve().parents[1]
    shipped = package / "upstream_patches"  # wheel: force-included (pyproject.toml)
    return shipped if shipped.is_dir() else package.parents[1] / "upstream_patches"


HERE = _root()

# Runtime patches that have no upstream diff, and why (tests/test_upstream.py: every registered patch is
# either here or mirrored by a diff).
NO_DIFF = {
    "async_preempt_discard": "fixed upstream in 0.22.0 (vllm#42117); only 0.20.x-0.21.x carry the bug",
    "fp32_lm_head": "upstream has it from 0.32.0 (hf_overrides head_dtype); before 0.32 it is a new feature "
                    "(a float32 logits projection), not a fix a release branch takes",
    "rl_defaults": "vLLM's defaults are deliberate (raw logprobs are cheaper and model-intrinsic; generation "
                   "config 'auto' follows the model author); RL needs different defaults, not a vLLM fix",
    "sampling_support": "a new feature (per-token kept-set mass and size for the trainer), not a fix; upstream's "
                        "closest is return_sampling_mask (0.32+, Model Runner V2 only, a vocabulary-sized mask)",
    "weight_events": "vllm-rlpatch's own API (weight-version events for trainers), not a vLLM bug",
    "worker_extension": "vllm-rlpatch's own API (the refit worker extension), not a vLLM bug",
    "refit_http": "vllm-rlpatch's own API (the refit HTTP routes on `vllm serve`), not a vLLM bug",
    "kv_cache_pin": "vLLM's profiling-based KV sizing is right for a GPU it owns; a measured pin for sleep/wake next "
                    "to a trainer is RL deployment policy (kv_cache_memory_bytes exists upstream), not a vLLM fix",
    "wake_order_guard": "fixed upstream in 0.27.0 (the worker restores level-2 buffers only when waking weights); "
                        "0.20.x-0.26.x carry the bug (the version sweep read each minor's worker)",
}


class UpstreamError(RuntimeError):
    """A diff directory is malformed, a base cannot be fetched, or a diff does not apply."""


@dataclass(frozen=True)
class UpstreamPatch:
    name: str
    runtime_patch: str
    base: str
    branch: str
    kind: str  # "backport" (fixed on upstream main, for a release branch) or "fix" (still present upstream)
    summary: str
    directory: Path
    upstream_fixed_in: str = ""
    upstream_prs: tuple[str, ...] = ()
    also_applies_to: tuple[str, ...] = ()
    patch_files: tuple[Path, ...] = field(default=())

    @property
    def status(self) -> str:
        if self.kind == "backport":
            prs = ", ".join(self.upstream_prs)
            return f"fixed upstream in {self.upstream_fixed_in} ({prs}); backport for {self.branch}"
        return f"still present in {self.base}; ready to send"

    def bases(self) -> tuple[str, ...]:
        return (self.base, *self.also_applies_to)

    def files_touched(self) -> list[str]:
        out = []
        for p in self.patch_files:
            for line in p.read_text().splitlines():
                if line.startswith("diff --git a/"):
                    out.append(line.split(" b/", 1)[1])
        return out


_REQUIRED = ("name", "runtime_patch", "base", "branch", "kind", "summary")


def load(directory: Path) -> UpstreamPatch:
    meta_path = directory / "patch.toml"
    if not meta_path.exists():
        raise UpstreamError(f"{directory}: no patch.toml")
    meta = tomllib.loads(meta_path.read_text())
    missing = [k for k in _REQUIRED if not meta.get(k)]
    if missing:
        raise UpstreamError(f"{meta_path}: missing {', '.join(missing)}")
    if meta["kind"] not in ("backport", "fix"):
        raise UpstreamError(f"{meta_path}: kind must be 'backport' or 'fix', not {meta['kind']!r}")
    if meta["kind"] == "backport" and not meta.get("upstream_fixed_in"):
        raise UpstreamError(f"{meta_path}: a backport names upstream_fixed_in")
    patches = tuple(sorted(directory.glob("[0-9][0-9][0-9][0-9]-*.patch")))
    if not patches:
        raise UpstreamError(f"{directory}: no NNNN-*.patch file")
    if not (directory / "PR.md").exists():
        raise UpstreamError(f"{directory}: no PR.md")
    return UpstreamPatch(
        name=meta["name"], runtime_patch=meta["runtime_patch"], base=meta["base"], branch=meta["branch"],
        kind=meta["kind"], summary=meta["summary"], directory=directory,
        upstream_fixed_in=meta.get("upstream_fixed_in", ""), upstream_prs=tuple(meta.get("upstream_prs", ())),
        also_applies_to=tuple(meta.get("also_applies_to", ())), patch_files=patches)


def load_all(root: Path = HERE) -> list[UpstreamPatch]:
    return [load(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(("_", "."))]


def get(name: str, root: Path = HERE) -> UpstreamPatch:
    for p in load_all(root):
        if p.name == name:
            return p
    known = ", ".join(p.name for p in load_all(root))
    raise UpstreamError(f"no upstream diff named {name!r} (known: {known})")


# ---------------------------------------------------------------------------------------------------------
def src_cache() -> Path:
    return Path(envs.SRC_CACHE.get() or Path.home() / ".cache" / "vllm-rlpatch" / "src")


def pristine_tree(version: str, *, log=print) -> Path:
    """The Python tree (``vllm/**/*.py``) of upstream's released ``vllm`` wheel for ``version``; downloaded
    once (pip, ~300 MB, deleted after extraction), then cached."""
    dest = src_cache() / f"vllm-{version}"
    if (dest / ".complete").exists():
        return dest
    wheels = src_cache() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    log(f"[upstream] downloading the vllm {version} wheel (pip download --no-deps; once, then cached)")
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(wheels),
                        f"vllm=={version}"], capture_output=True, text=True)
    found = sorted(wheels.glob(f"vllm-{version}-*.whl"))
    if p.returncode != 0 or not found:
        raise UpstreamError(f"cannot fetch the vllm {version} wheel (pip download exit {p.returncode}): "
                            f"{(p.stderr or p.stdout).strip()[-500:]}")
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(found[0]) as z:
        for name in z.namelist():
            if name.startswith("vllm/") and name.endswith(".py"):
                z.extract(name, dest)
    (dest / ".complete").touch()
    found[0].unlink()
    return dest


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # Never inside an enclosing repository: there `git apply` takes paths from the repository's root and
    # silently skips those outside the current directory.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(Path(cwd).resolve().parent)}
    return subprocess.run(["git", *args], cwd=str(cwd), capture_output=True, text=True, env=env)


def apply_to(patch: UpstreamPatch, tree: Path, *, reverse_check: bool = True) -> list[str]:
    """Apply the diff(s) to ``tree`` in place (``git apply --check`` first, ``--reverse --check`` after).
    Returns the steps done; raises :class:`UpstreamError` naming the first step that failed."""
    steps = []
    for pf in patch.patch_files:
        for what, args in (("check", ["apply", "--check"]), ("apply", ["apply"])):
            r = _git(*args, str(pf), cwd=tree)
            if r.returncode != 0:
                raise UpstreamError(f"{patch.name}: git apply {'--check ' if what == 'check' else ''}{pf.name} "
                                    f"failed in {tree}: {r.stderr.strip()[-800:]}")
            steps.append(f"{what} {pf.name}")
    if reverse_check:
        for pf in reversed(patch.patch_files):
            r = _git("apply", "--reverse", "--check", str(pf), cwd=tree)
            if r.returncode != 0:
                raise UpstreamError(f"{patch.name}: git apply --reverse --check {pf.name} failed after applying: "
                                    f"{r.stderr.strip()[-800:]}")
            steps.append(f"reverse-check {pf.name}")
    return steps


def check(patch: UpstreamPatch, version: str | None = None, *, log=print) -> dict:
    """Copy the files the diff touches out of the pristine tree of ``version`` (default: the base), apply the
    diff there, reverse-check it, compile the changed files."""
    version = version or patch.base
    tree = pristine_tree(version, log=log)
    with tempfile.TemporaryDirectory(prefix=f"rlpatch-upstream-{patch.name}-") as d:
        work = Path(d) / "vllm-src"
        for rel in patch.files_touched():  # git apply reads only these; new files must not exist yet
            if (tree / rel).exists():
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(tree / rel, work / rel)
        steps = apply_to(patch, work)
        compiled = []
        for rel in patch.files_touched():
            f = work / rel
            if rel.endswith(".py") and f.exists():
                try:
                    py_compile.compile(str(f), doraise=True)
                except py_compile.PyCompileError as e:
                    raise UpstreamError(f"{patch.name}: {rel} does not compile after applying: {e.msg[-500:]}")
                compiled.append(rel)
    return {"name": patch.name, "version": version, "steps": steps, "compiled": compiled}


def overlay(patch: UpstreamPatch, package_dir: Path, dest: Path) -> Path:
    """An importable copy of an installed ``vllm`` package with the diff applied: ``dest/vllm`` (files the
    diff does not touch are hard links; touched ones real copies, so the installed package is never
    modified). Put ``dest`` first on PYTHONPATH. Files the diff adds outside ``vllm/`` (tests) are created
    under ``dest`` too."""
    target = dest / "vllm"
    if target.exists():
        raise UpstreamError(f"{target} exists")
    touched = set(patch.files_touched())

    def copy(src, dst):
        rel = Path(dst).relative_to(dest).as_posix()
        if rel in touched:
            return shutil.copy2(src, dst)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        return dst

    shutil.copytree(package_dir, target, copy_function=copy,
                    ignore=shutil.ignore_patterns("__pycache__"))
    apply_to(patch, dest, reverse_check=False)
    return dest


# ---------------------------------------------------------------------------------------------------------
def table_rows(patches: list[UpstreamPatch]) -> list[tuple[str, str, str, str]]:
    rows = [(p.name, f"{p.base} ({p.branch})", p.status, p.runtime_patch) for p in patches]
    mirrored = {p.runtime_patch for p in patches}
    for name, why in NO_DIFF.items():
        if name not in mirrored:
            rows.append((f"({name})", "-", f"no diff: {why}", name))
    return rows


def render(rows: list[tuple[str, ...]], header: tuple[str, ...] = ("diff", "base", "upstream status",
                                                                    "runtime patch")) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    widths[2] = min(widths[2], 90)
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def markdown(patches: list[UpstreamPatch], links: bool = True) -> str:
    """The table as Markdown; ``links=False`` names each PR.md as a path (a page outside the repository root)."""
    out = ["| diff | base | upstream status | runtime patch |", "|---|---|---|---|"]
    for r in table_rows(patches):
        if r[0].startswith("("):
            name = r[0]
        elif links:
            name = f"[`{r[0]}`](upstream_patches/{r[0]}/PR.md)"
        else:
            name = f"`{r[0]}`: `upstream_patches/{r[0]}/PR.md`"
        out.append(f"| {name} | {r[1]} | {r[2]} | `{r[3]}` |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = options.parser(prog="vllm-rlpatch upstream",
                                 description="Upstream-ready diffs of the runtime patches, and their check.")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--list", action="store_true", help="the table (default)")
    g.add_argument("--markdown", action="store_true", help="the table as Markdown")
    g.add_argument("--show", metavar="NAME", help="print a diff's PR.md and the files it changes")
    g.add_argument("--check", metavar="NAME", nargs="?", const="", default=None,
                   help="apply each diff (or NAME) to its pristine base(s): git apply --check, apply, "
                        "--reverse --check (downloads each base's wheel once)")
    g.add_argument("--path", metavar="NAME", help="print the directory of a diff")
    args = ap.parse_args(argv)
    try:
        patches = load_all()
        if args.show:
            p = get(args.show)
            print(f"# {p.name}: {p.summary}\n# base {p.base} ({p.branch}); {p.status}; runtime patch "
                  f"{p.runtime_patch}\n# files: {', '.join(p.files_touched())}\n# diff: "
                  f"{', '.join(str(f) for f in p.patch_files)}\n")
            print((p.directory / "PR.md").read_text())
            return 0
        if args.path:
            print(get(args.path).directory)
            return 0
        if args.check is not None:
            todo = [get(args.check)] if args.check else patches
            bad = 0
            for p in todo:
                for v in p.bases():
                    try:
                        r = check(p, v, log=lambda m: print(m, file=sys.stderr, flush=True))
                        print(f"ok    {p.name} on vllm {v}: {', '.join(r['steps'])}", flush=True)
                    except UpstreamError as e:
                        bad += 1
                        print(f"FAIL  {p.name} on vllm {v}: {e}", flush=True)
            return 1 if bad else 0
        print(markdown(patches) if args.markdown else render(table_rows(patches)))
        return 0
    except UpstreamError as e:
        print(f"vllm-rlpatch upstream: {e}", file=sys.stderr)
        return 2
