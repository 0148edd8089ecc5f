"""The shared contract every patch spec must honour, on the real installed vLLM (one forked process each)."""

import pytest
from packaging.version import Version

from vllm_rlpatch import _wrapping, registry
from vllm_rlpatch.patches import ALL_PATCHES
from vllm_rlpatch.versions import VllmInfo, vllm_info

pytestmark = [pytest.mark.forked, pytest.mark.quick]  # quick: engine-free (ci/test.sh --quick)
IDS = [s.name for s in ALL_PATCHES]


# Import every patch target once in the parent so each forked test starts in milliseconds.
for _spec in ALL_PATCHES:
    for _t in (*_spec.targets, *_spec.lazy_targets):
        _wrapping.target_exists(_t)  # a target upstream removed is checked in test_apply_revert_idempotent


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("VLLM_RLPATCH_"):
            monkeypatch.delenv(k)
    registry.revert_all()  # a plugin registered in the parent must not leak into the contract
    registry._reset_for_tests()


def _snapshot(spec):
    snap = {}
    for t in (*spec.targets, *spec.lazy_targets):
        parent, attr, value = _wrapping.resolve(t)
        raw = parent.__dict__.get(attr, value) if isinstance(parent, type) else value
        snap[t] = raw
    return snap


def _all_hook_targets():
    from vllm_rlpatch.tools.targets import all_targets

    return all_targets()


def _unwrapped_state():
    from vllm_rlpatch.hooks import explicit

    explicit.uninstall()  # the .pth start-up hook installed it at import; start from pristine vLLM
    return {t: _wrapping.is_wrapped(t) for t in _all_hook_targets()}


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_spec_is_declarative_and_documented(spec):
    import importlib

    mod = importlib.import_module(f"vllm_rlpatch.patches.{spec.name}")  # one module per patch
    doc = mod.__doc__ or ""
    for section in ("Why:", "How:", "Targets:", "Upstream:", "Remove when:"):
        assert section in doc, f"{mod.__name__} docstring lacks {section}"
    assert spec.summary and spec.upstream and spec.remove_when
    assert spec.env.name == f"VLLM_RLPATCH_{spec.name.upper()}"
    assert all(":" in t for t in (*spec.targets, *spec.lazy_targets))


def _forced(spec):
    """The spec with its gates lifted (range, fixed_in, probe), so apply/revert is exercised on every
    version where its targets exist; the gates themselves are tested below."""
    import dataclasses

    return dataclasses.replace(spec, vllm=">=0", fixed_in=None, probe=None)


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_apply_revert_idempotent(spec):
    missing = [t for t in (*spec.targets, *spec.lazy_targets) if not _wrapping.target_exists(t)]
    if missing:
        # only acceptable where the spec never applies on this vLLM (upstream's fix removed the target)
        state, reason = registry.decide(spec)
        assert state in ("not_needed", "unsupported"), (spec.name, missing, state, reason)
        pytest.skip(f"{spec.name}: {state} on this vLLM ({reason}); targets absent: {', '.join(missing)}")
    spec = _forced(spec)
    before = _unwrapped_state()
    assert not any(before.values())
    originals = _snapshot(spec)
    st = registry.apply_one(spec)
    assert st.state == "applied", st
    assert registry.apply_one(spec).state == "applied"
    registry.revert_one(spec)
    registry.revert_one(spec)
    assert _snapshot(spec) == originals
    assert {t: _wrapping.is_wrapped(t) for t in before} == before, "revert left a wrapper behind"
    assert registry.apply_one(spec).state == "applied"
    registry.revert_one(spec)
    assert {t: _wrapping.is_wrapped(t) for t in before} == before


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_env_toggle_off(spec, monkeypatch):
    before = _unwrapped_state()
    monkeypatch.setenv(spec.env.name, "0")
    st = registry.apply_one(spec)
    assert st.state == "disabled" and spec.env.name in st.reason
    assert {t: _wrapping.is_wrapped(t) for t in before} == before


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_kill_switch(spec, monkeypatch):
    before = _unwrapped_state()
    monkeypatch.setenv("VLLM_RLPATCH_ENABLED", "0")
    assert registry.apply_one(spec).state == "disabled"
    assert {t: _wrapping.is_wrapped(t) for t in before} == before


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_out_of_range_version_is_unsupported(spec):
    before = _unwrapped_state()
    old = VllmInfo(Version("0.8.5"), "0.8.5", "vllm")
    st = registry.apply_one(spec, old)
    assert st.state == "unsupported" and "0.8.5" in st.reason
    assert {t: _wrapping.is_wrapped(t) for t in before} == before


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_gated_patch_leaves_vllm_untouched(spec):
    """On this vLLM: a patch that does not apply (range, fixed_in, probe) wraps nothing and says why."""
    state, reason = registry.decide(spec)
    if state is None:
        pytest.skip(f"{spec.name} applies on this vLLM ({reason})")
    before = _unwrapped_state()
    st = registry.apply_one(spec)
    assert st.state == state and st.reason == reason
    assert {t: _wrapping.is_wrapped(t) for t in before} == before


@pytest.mark.parametrize("spec", ALL_PATCHES, ids=IDS)
def test_fixed_in_retires(spec):
    if spec.fixed_in is None:
        pytest.skip(f"{spec.name}: no upstream fix known (fixed_in=None)")
    info = VllmInfo(Version(spec.fixed_in), spec.fixed_in, "vllm")
    assert registry.apply_one(spec, info).state == "not_needed"


def test_mode_toggle_values():
    from vllm_rlpatch.patches import prefix_cache

    import os
    for raw, mode in (("salt", "salt"), ("RESET", "reset"), ("off", "off"), ("stock", "stock"), ("1", "salt"),
                      ("0", "stock")):
        os.environ["VLLM_RLPATCH_PREFIX_CACHE"] = raw
        assert prefix_cache.mode() == mode
        assert prefix_cache.SPEC.enabled_by_env() is (mode != "stock")
    os.environ["VLLM_RLPATCH_PREFIX_CACHE"] = "stock"
    st = registry.apply_one(prefix_cache.SPEC)
    assert st.state == "disabled" and st.reason == "VLLM_RLPATCH_PREFIX_CACHE=stock"
    del os.environ["VLLM_RLPATCH_PREFIX_CACHE"]


def test_status_lists_every_patch_with_a_state_and_reason():
    registry.apply_all()
    recs = registry.status()
    assert [r.name for r in recs] == IDS
    for r in recs:
        assert r.state in registry.STATES and r.reason
    assert vllm_info().installed


def test_patches_applied_before_vllm_imports_their_targets_wrap_what_they_wrap_after():
    """The order the anchors test and plain wrapping does not: the plugin applies a patch *before* vLLM has
    imported the target's module (the post-import hook wraps it when vLLM does), or after. Both orders
    must leave the same targets wrapped. Two fresh processes (the forked tests run with every target
    imported already)."""
    import json
    import subprocess
    import sys

    from support.env import SCRIPTS

    out = {}
    for order in ("before", "after"):
        p = subprocess.run([sys.executable, str(SCRIPTS / "apply_order.py"), order], capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        out[order] = json.loads(p.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    assert before["applied"] == after["applied"]
    assert before["late_modules"], "every target module was imported before the patches applied: nothing tested"
    assert after["late_modules"] == []
    assert before["wrapped"] == after["wrapped"]
    assert any(before["wrapped"].values())
