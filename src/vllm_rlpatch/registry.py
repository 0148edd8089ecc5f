"""Patch specs, the one place that decides whether a patch applies, and per-process status.

A patch module ends in ``SPEC = PatchSpec(...)``; :data:`vllm_rlpatch.patches.ALL_PATCHES` lists them in
application order. Nothing is applied as an import side effect: :func:`apply_all` (called by the plugin
entry point in every vLLM process) walks the list and records one :class:`PatchStatus` per patch.

Decision order for one patch (first match wins):
1. ``VLLM_RLPATCH_ENABLED=0``                            -> ``disabled``
2. ``VLLM_RLPATCH_PROFILE=stock``, not a host fix         -> ``disabled``
   ``VLLM_RLPATCH_<NAME>`` off (or default off, unset)   -> ``disabled``
3. vLLM not importable                                   -> ``unsupported``
4. vLLM >= ``fixed_in`` (upstream fixed the bug)         -> ``not_needed``
5. vLLM older than the spec's range                      -> ``unsupported``
6. vLLM newer than the range's upper bound               -> ``unsupported``
7. the behaviour probe says the bug is absent            -> ``not_needed`` (before 8: upstream's fix may be
   what removed a target)
8. a target missing (inner API drift)                    -> ``unsupported``
9. ``apply()`` raises                                    -> ``failed`` (raises under STRICT / explicit enable)
10. otherwise                                            -> ``applied`` (with one WARNING if vLLM is newer
    than the newest tested release)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from vllm_rlpatch import _wrapping, envs
from vllm_rlpatch.versions import NEWEST_TESTED, VllmInfo, vllm_info

logger = logging.getLogger("vllm.rlpatch")

STATES = ("applied", "disabled", "not_needed", "unsupported", "failed")


class PatchError(RuntimeError):
    """A patch failed to apply and strict mode (or an explicit enable) asked for an error."""


@dataclass(frozen=True)
class PatchSpec:
    """Declarative description of one patch.

    name:      short id; the env toggle is ``VLLM_RLPATCH_<NAME>``.
    summary:   one line for the README table and ``doctor``.
    vllm:      PEP 440 specifier of the vLLM releases the patch is written for (release part compared).
    fixed_in:  first vLLM release whose upstream code no longer has the bug (``None``: still present).
    targets:   ``"module:Qual.name"`` paths that must exist (feature detection for API drift).
    lazy_targets: targets whose module is only wrapped once something else imports it.
    apply/revert: callables; both must be idempotent. ``revert`` undoes exactly what ``apply`` did.
    probe:     optional cheap behaviour check; returns True if the bug is present in this vLLM.
    default:   applied when the toggle is unset.
    upstream:  upstream issue/PR reference (or "not reported upstream").
    remove_when: when the patch can be deleted.
    """

    name: str
    summary: str
    vllm: str
    targets: tuple[str, ...]
    apply: Callable[[], None]
    revert: Callable[[], None]
    fixed_in: str | None = None
    probe: Callable[[], bool] | None = None
    default: bool = True
    upstream: str = ""
    remove_when: str = ""
    # Targets in modules the plugin must not import itself (e.g. the worker module, 1.7 s to import, in
    # process 0): checked here only if their module is already loaded, otherwise by the patch when it is.
    lazy_targets: tuple[str, ...] = ()
    # A toggle that takes a mode instead of 1/0 (``envs.mode_toggle``); its ``off`` mode disables the patch.
    toggle: envs.EnvVar | None = None
    # A host-compatibility fix, not RL behaviour (e.g. vLLM dies on some CPUs without it): kept on under
    # ``VLLM_RLPATCH_PROFILE=stock``, the profile that stands for "vLLM as installed" in tests and `parity`.
    host_fix: bool = False

    @property
    def env(self) -> envs.EnvVar:
        return self.toggle if self.toggle is not None else envs.patch_toggle(self.name, self.default)

    def enabled_by_env(self) -> bool:
        toggle = self.env
        return not envs.is_off(toggle, toggle.get())

    @property
    def specifier(self) -> SpecifierSet:
        return SpecifierSet(self.vllm)


@dataclass
class PatchStatus:
    name: str
    state: str
    reason: str
    vllm_range: str
    fixed_in: str | None
    default: bool
    env: str
    explicit: bool = False  # the user set the toggle

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _State:
    statuses: dict[str, PatchStatus] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)  # application order
    untested_warned: bool = False


_LOCK = threading.RLock()
_STATE = _State()


def _upper_bound_exceeded(spec: SpecifierSet, v: Version) -> bool:
    for s in spec:
        if s.operator in ("<", "<=") and not s.contains(v):
            return True
        if s.operator == "==" and not s.contains(v) and v > Version(s.version.rstrip(".*")):
            return True
    return False


def decide(spec: PatchSpec, info: VllmInfo | None = None) -> tuple[str | None, str]:
    """Steps 1-8 of the decision order. Returns (final state or None = go ahead and apply, reason)."""
    info = info or vllm_info()
    if not envs.ENABLED.get():
        return "disabled", "VLLM_RLPATCH_ENABLED=0"
    if envs.PROFILE.get() == "stock" and not spec.host_fix:
        return "disabled", "VLLM_RLPATCH_PROFILE=stock (vLLM's own behaviour; host fixes kept)"
    toggle = spec.env
    if not spec.enabled_by_env():
        how = (f"{toggle.name}={os.environ[toggle.name]}" if envs.toggle_is_set(toggle)
               else f"off by default (set {toggle.name}=1)")
        return "disabled", how
    if not info.installed:
        return "unsupported", "vLLM is not importable in this environment"
    v = info.release
    if spec.fixed_in is not None and v >= Version(spec.fixed_in):
        return "not_needed", f"fixed upstream in vLLM {spec.fixed_in} (this is {info.raw_version})"
    sset = spec.specifier
    if not sset.contains(v, prereleases=True):
        if _upper_bound_exceeded(sset, v):
            return "unsupported", f"vLLM {info.raw_version} is newer than the supported range {spec.vllm}"
        return "unsupported", f"vLLM {info.raw_version} is outside the supported range {spec.vllm}"
    if spec.probe is not None:
        try:
            present = spec.probe()
        except Exception as e:  # a probe that cannot run does not block the patch
            logger.debug("vllm-rlpatch: probe of %s failed: %r", spec.name, e)
            present = True
        if not present:
            return "not_needed", f"behaviour probe: the bug is absent in vLLM {info.raw_version}"
    missing = [t for t in spec.targets if not _wrapping.target_exists(t)]
    missing += [t for t in spec.lazy_targets
                if t.partition(":")[0] in sys.modules and not _wrapping.target_exists(t)]
    if missing:
        return "unsupported", f"target(s) missing in vLLM {info.raw_version}: {', '.join(missing)}"
    reason = f"vLLM {info.raw_version} in {spec.vllm}"
    if info.untested:
        reason += f" (untested: newest tested is {NEWEST_TESTED})"
    return None, reason


def _strict_for(spec: PatchSpec) -> bool:
    return envs.STRICT.get() or (envs.toggle_is_set(spec.env) and spec.enabled_by_env())


def apply_one(spec: PatchSpec, info: VllmInfo | None = None) -> PatchStatus:
    info = info or vllm_info()
    with _LOCK:
        explicit = envs.toggle_is_set(spec.env)
        state, reason = decide(spec, info)
        if state is None:
            try:
                spec.apply()
            except Exception as e:
                state, reason = "failed", f"{type(e).__name__}: {e}"
                if spec.name not in _STATE.applied:
                    try:  # leave nothing half-applied
                        spec.revert()
                    except Exception:
                        logger.debug("vllm-rlpatch: revert after failed apply of %s raised", spec.name, exc_info=True)
                status = PatchStatus(spec.name, state, reason, spec.vllm, spec.fixed_in, spec.default,
                                     spec.env.name, explicit)
                _STATE.statuses[spec.name] = status
                if _strict_for(spec):
                    raise PatchError(f"vllm-rlpatch: patch {spec.name!r} failed to apply: {reason}") from e
                logger.warning("vllm-rlpatch: patch %s FAILED to apply (vLLM keeps running unpatched for it): %s "
                               "(set VLLM_RLPATCH_STRICT=1 to make this an error)", spec.name, reason)
                return status
            state = "applied"
            if spec.name not in _STATE.applied:
                _STATE.applied.append(spec.name)
            if info.untested and not _STATE.untested_warned:
                _STATE.untested_warned = True
                logger.warning("vllm-rlpatch: vLLM %s is newer than the newest tested release %s; patches whose "
                               "targets exist are applied, the others report `unsupported`",
                               info.raw_version, NEWEST_TESTED)
        status = PatchStatus(spec.name, state, reason, spec.vllm, spec.fixed_in, spec.default, spec.env.name,
                             explicit)
        _STATE.statuses[spec.name] = status
        logger.debug("vllm-rlpatch: %s -> %s (%s)", spec.name, state, reason)
        return status


def revert_one(spec: PatchSpec) -> None:
    with _LOCK:
        spec.revert()
        if spec.name in _STATE.applied:
            _STATE.applied.remove(spec.name)
        old = _STATE.statuses.get(spec.name)
        if old is not None and old.state == "applied":
            old.state, old.reason = "disabled", "reverted"


_PATCHES: tuple[PatchSpec, ...] | None = None


def use(specs: Iterable[PatchSpec]) -> None:
    """The composition root (:func:`vllm_rlpatch.plugin.compose`) hands over the patch list, in application
    order; :mod:`vllm_rlpatch.envs` learns their toggles from here."""
    global _PATCHES
    with _LOCK:
        _PATCHES = tuple(specs)
        envs.declare_patch_toggles([s.env for s in _PATCHES])


def patches() -> tuple[PatchSpec, ...]:
    """Every known patch spec, in application order."""
    if _PATCHES is None:
        raise RuntimeError("vllm-rlpatch: the registry has no patch list; call vllm_rlpatch.plugin.compose() "
                           "first (the composition root hands it over)")
    return _PATCHES


def apply_all(specs: Iterable[PatchSpec] | None = None, info: VllmInfo | None = None) -> list[PatchStatus]:
    return [apply_one(s, info) for s in (patches() if specs is None else specs)]


def revert_all(specs: Iterable[PatchSpec] | None = None) -> None:
    with _LOCK:
        for s in reversed(list(patches() if specs is None else specs)):
            revert_one(s)


def status() -> list[PatchStatus]:
    """One record per known patch. Patches never evaluated in this process are evaluated (not applied)."""
    out = []
    with _LOCK:
        for s in patches():
            st = _STATE.statuses.get(s.name)
            if st is None:
                state, reason = decide(s)
                st = PatchStatus(s.name, state or "disabled",
                                 reason if state else f"not loaded in this process (would apply: {reason})",
                                 s.vllm, s.fixed_in, s.default, s.env.name, envs.toggle_is_set(s.env))
            out.append(st)
    return out


def applied_names() -> list[str]:
    with _LOCK:
        return list(_STATE.applied)


def _reset_for_tests() -> None:
    with _LOCK:
        _STATE.statuses.clear()
        _STATE.applied.clear()
        _STATE.untested_warned = False
