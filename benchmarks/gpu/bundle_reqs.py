"""The requirement list of an offline vLLM site bundle, derived from the vLLM wheel's own METADATA (used by
benchmarks/gpu/make_site_0320.sh; needs only `packaging` and pip).

    python3 benchmarks/gpu/bundle_reqs.py VLLM_WHEEL OUT_DIR

1. Requires-Dist of VLLM_WHEEL, markers resolved for the GPU host (Linux, x86_64, CPython 3.12, no extras).
2. Resolved with pip's resolver for that platform (`pip install --dry-run --report`, the resolver `pip download`
   uses, without downloading the wheels: PyPI serves their metadata). torch is carried separately (torch
   chunks, with the NCCL and triton the image lacks), so it enters the resolution as a no-dependency stub of
   the pinned version: its CUDA libraries and triton are not resolved (the torch wheel's own NCCL pin, 2.29.7,
   is not on the package index here; the chunks carry NCCL 2.32.6, measured on the H200).
3. Each resolved package is kept or dropped, with the reason: dropped are torch/triton/nvidia-* (carried or in
   the image), the packages the H200 image already has (its package list as read on 2026-11-17),
   unless the image's recorded version fails vLLM's own requirement (then the bundle carries vLLM's pin; a
   failed cap of another package is only reported: shadowing e.g. the image's numpy would move every image
   package), and vLLM's optional CUDA kernel packages the 0.25.1 bundle also left out (FlashInfer and the
   like; the run sets VLLM_USE_FLASHINFER_SAMPLER=0 and uses the FlashAttention-3 kernels inside the vLLM
   wheel), with the dependencies only they need.

Writes OUT_DIR/requirements.txt (the kept pins, for `pip download --no-deps`), OUT_DIR/requirements.json (every
package: version, kept or why dropped, who requires it) and prints a summary.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "platform_release": "", "platform_version": "", "implementation_version": "3.12.3"}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]

# Carried by the torch chunks (../shared/gpu/make_torch213_chunks.sh): never in the bundle.
CARRIED = {"torch", "triton", "nvidia-nccl-cu13"}
# The H200 image ('cuda'), its package list as read on a machine running it (2026-11-17), and the versions a
# session's pip list showed there (2026-11). A package listed here is not carried unless its recorded version
# fails vLLM's own requirement (setup_site_0320.sh checks every requirement against what is installed there).
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless
optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson
six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp""".split()
IMAGE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
                  "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                  "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0", "triton": "3.6.0",
                  "onnx": "1.23.1"}
# vLLM's CUDA kernel packages that the 0.25.1 bundle left out too: not imported on the path a bf16 dense model
# takes on Hopper with FlashAttention-3 and VLLM_USE_FLASHINFER_SAMPLER=0 (each is imported lazily by the
# backend or kernel that needs it), and large. Their own exclusive dependencies go with them.
CUDA_EXTRAS = {"flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "nvidia-cudnn-frontend",
               "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
               "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "tokenspeed-mla", "humming-kernels",
               "pynvvideocodec", "torchcodec"}


def requires_dist(wheel: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    return name, version, re.findall(r"^Requires-Dist: (.+)$", text, re.M)


def active(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET_ENV, "extra": e}) for e in ({""} | extras))


def stub_wheel(dirpath: Path, name: str, version: str) -> Path:
    """A no-dependency placeholder `name==version+carried` (sorts above `version`, satisfies `==version`)."""
    v = f"{version}+carried"
    dist = f"{name}-{v}.dist-info"
    p = dirpath / f"{name}-{v}-py3-none-any.whl"
    with zipfile.ZipFile(p, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {v}\n")
        z.writestr(f"{dist}/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: rlpatch\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return p


def resolve(direct: list[str], work: Path) -> list[dict]:
    """pip's resolution of DIRECT for the GPU host: [{name, version, requires_dist, requested_extras}]."""
    stubs = work / "stubs"
    stubs.mkdir(exist_ok=True)
    reqs = []
    for line in direct:
        r = Requirement(line)
        if canonicalize_name(r.name) == "torch":
            pins = [s.version for s in r.specifier if s.operator == "=="]
            stub_wheel(stubs, "torch", pins[0] if pins else "2.13.0")
        reqs.append(line)
    (work / "direct.txt").write_text("\n".join(reqs) + "\n")
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--target", str(work / "target"), "--report", str(work / "report.json"),
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
           "--find-links", str(stubs), "-r", str(work / "direct.txt")]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit("pip could not resolve the requirements:\n" +
                         "\n".join(ln for ln in (p.stderr + p.stdout).splitlines() if "is ignored" not in ln)[-4000:])
    rep = json.loads((work / "report.json").read_text())
    return [{"name": canonicalize_name(i["metadata"]["name"]), "version": i["metadata"]["version"],
             "requires_dist": i["metadata"].get("requires_dist") or [],
             "requested_extras": [canonicalize_name(e) for e in i.get("requested_extras") or []]}
            for i in rep["install"]]


def derive(wheel: Path, out: Path) -> dict:
    name, version, rdist = requires_dist(wheel)
    direct = [r for r in rdist if active(Requirement(r), set())]
    with tempfile.TemporaryDirectory(prefix="bundle-reqs-") as tmp:
        pkgs = resolve(direct, Path(tmp))
    by = {p["name"]: p for p in pkgs}
    # who requires whom, with the extras each package is asked for (to a fixpoint)
    extras: dict[str, set[str]] = {n: set(p["requested_extras"]) for n, p in by.items()}
    parents: dict[str, dict[str, str]] = {n: {} for n in by}
    edges = [(canonicalize_name(name), Requirement(r)) for r in rdist]
    edges += [(n, Requirement(r)) for n, p in by.items() for r in p["requires_dist"]]
    for r in (Requirement(x) for x in direct):
        extras.setdefault(canonicalize_name(r.name), set()).update(canonicalize_name(e) for e in r.extras)
    for _ in range(10):
        changed = False
        for parent, r in edges:
            child = canonicalize_name(r.name)
            pe = extras.get(parent, set())
            if child not in by or not active(r, pe):
                continue
            if str(r.specifier) != parents[child].get(parent):
                parents[child][parent] = str(r.specifier)
            new = {canonicalize_name(e) for e in r.extras} - extras.setdefault(child, set())
            if new:
                extras[child] |= new
                changed = True
        if not changed:
            break
    parents.pop(canonicalize_name(name), None)
    # exclusive dependencies of the dropped CUDA extras go with them
    reach_from_kept: set[str] = set()
    roots = [canonicalize_name(Requirement(r).name) for r in direct]
    stack = [r for r in roots if r not in CUDA_EXTRAS and r in by]
    while stack:
        n = stack.pop()
        if n in reach_from_kept:
            continue
        reach_from_kept.add(n)
        stack += [c for c, ps in parents.items() if n in ps and c not in CUDA_EXTRAS]
    image = {canonicalize_name(x) for x in IMAGE}
    rows = []
    for n in sorted(by):
        if n == canonicalize_name(name):
            continue
        p = by[n]
        row = {"name": n, "version": p["version"], "required_by": parents.get(n, {})}
        known = IMAGE_VERSIONS.get(n)
        if n in CARRIED or p["version"].endswith("+carried"):
            row["drop"] = "carried by the torch chunks"
        elif n.startswith(("nvidia-", "cuda-")) and n in image:
            row["drop"] = "in the image (CUDA libraries)"
        elif n in CUDA_EXTRAS:
            row["drop"] = "optional CUDA kernel package (left out as in the 0.25.1 bundle)"
        elif n not in reach_from_kept:
            row["drop"] = "needed only by a left-out CUDA kernel package"
        elif n in image:
            bad = {par: spec for par, spec in row["required_by"].items()
                   if known and spec and Version(known) not in SpecifierSet(spec, prereleases=True)}
            if canonicalize_name(name) in bad:  # vLLM's own pin: carry what vLLM asks for
                row["keep"] = f"the image has {known}, which fails {bad}"
            else:  # another package's cap only: shadowing the image's copy would move every image package
                row["drop"] = (f"in the image ({known})" if known else "in the image (version not recorded)") + (
                    f"; it fails only other packages' caps {bad}" if bad else "")
        elif n.startswith(("nvidia-", "cuda-")):
            row["drop"] = "nvidia-*/cuda-* (not carried: the image's CUDA or an optional kernel package)"
        else:
            row["keep"] = "not in the image"
        rows.append(row)
    kept = [r for r in rows if "keep" in r]
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# {name}=={version} site bundle for the H200 image: {len(kept)} of {len(rows)} resolved packages.",
             f"# Derived by benchmarks/gpu/bundle_reqs.py from {wheel.name}'s Requires-Dist (Linux x86_64, CPython",
             "# 3.12, no extras), resolved by pip; requirements.json says why each other package is left out."]
    lines += [f"{r['name']}=={r['version']}" for r in kept]
    (out / "requirements.txt").write_text("\n".join(lines) + "\n")
    summary = {"vllm": version, "wheel": wheel.name, "direct": direct, "resolved": len(rows), "kept": len(kept),
               "packages": rows}
    (out / "requirements.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    s = derive(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{s['wheel']}: {len(s['direct'])} direct requirements, {s['resolved']} packages resolved, "
          f"{s['kept']} carried in the bundle")
    for r in s["packages"]:
        print(f"  {'keep' if 'keep' in r else 'drop'} {r['name']}=={r['version']}: {r.get('keep') or r.get('drop')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
