import logging

import pytest

from vllm_rlpatch import envs

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick


def test_bool_parsing(monkeypatch):
    for raw, want in [("1", True), ("true", True), ("ON", True), ("0", False), ("no", False), (" off ", False)]:
        monkeypatch.setenv("VLLM_RLPATCH_STRICT", raw)
        assert envs.STRICT.get() is want


def test_invalid_bool_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_ENABLED", "maybe")
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_ENABLED='maybe' is not a boolean"):
        envs.ENABLED.get()
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_ENABLED"):
        envs.validate_environment()


def test_value_typed_setting_has_its_validator(monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_LOG_LEVEL", "loud")
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_LOG_LEVEL='loud' is not valid; use one of: debug"):
        envs.validate_environment()
    monkeypatch.setenv("VLLM_RLPATCH_LOG_LEVEL", "DEBUG")
    assert envs.LOG_LEVEL.get() == "debug"
    monkeypatch.setenv("VLLM_RLPATCH_STATUS_DIR", "  ")
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_STATUS_DIR is set but empty"):
        envs.STATUS_DIR.get()


def test_per_patch_toggles_come_from_the_specs():
    from vllm_rlpatch.patches import ALL_PATCHES

    names = envs.known_names()
    for spec in ALL_PATCHES:
        assert f"VLLM_RLPATCH_{spec.name.upper()}" in names
    assert len(names) == len(set(names))
    assert all(v.doc for v in envs.all_vars())


def test_unknown_name_warns_with_closest(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_RLPATCH_RL_DEFAULT", "0")  # missing S
    with caplog.at_level(logging.WARNING, logger="vllm.rlpatch"):
        warnings = envs.validate_environment()
    assert warnings == ["unknown environment variable VLLM_RLPATCH_RL_DEFAULT (ignored); "
                        "did you mean VLLM_RLPATCH_RL_DEFAULTS?"]
    assert "did you mean VLLM_RLPATCH_RL_DEFAULTS" in caplog.text
