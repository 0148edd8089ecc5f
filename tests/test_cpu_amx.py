"""cpu_amx_permission: vLLM's CPU attention (every release from 0.20) runs AMX tile instructions without the
process asking the kernel for the AMX permission; on AMX hosts an engine can die with SIGILL at its first
forward pass (seen on 0.28.0 and 0.32.0). The patch is gated by its behaviour probe, not by version, and it is
a host fix: the `stock` profile keeps it."""

import json

import pytest

from support.env import amx_host, amx_sigill_here, model_path
from support.runs import run_engine, run_py

pytestmark = pytest.mark.vllm

_STATUS = ("import json, vllm_rlpatch, vllm_rlpatch.plugin as p; "
           "from vllm_rlpatch.patches import cpu_amx_permission as c; p.register_as('test'); "
           "print('ST', json.dumps({'status': [(s['name'], s['state'], s['reason']) for s in vllm_rlpatch.status()], "
           "'held': c.amx_permission_held()}))")


def _status(**env):
    r = run_py(_STATUS, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("ST ", 1)[1])
    return {n: (st, why) for n, st, why in out["status"]}, out["held"]


@pytest.mark.parametrize("profile", ["rl", "stock"])
def test_the_decision_is_the_probe_on_every_version(profile, version):
    """applied exactly where the host has AMX (CPU flags, read independently) and the process does not hold
    the permission yet; not_needed elsewhere; never `unsupported` by version; the same under the stock profile."""
    st, held = _status(VLLM_RLPATCH_PROFILE=profile)
    state, reason = st["cpu_amx_permission"]
    if amx_host() and held is False:
        assert state == "applied", reason
    else:
        assert state == "not_needed" and "behaviour probe" in reason, (state, reason)
    if profile == "stock":  # every other patch is off under the stock profile
        others = {n: s for n, (s, _) in st.items() if n != "cpu_amx_permission"}
        assert set(others.values()) == {"disabled"}, others
        assert all("VLLM_RLPATCH_PROFILE=stock" in why for n, (_, why) in st.items() if n != "cpu_amx_permission")


@pytest.mark.skipif(not amx_sigill_here(), reason="needs an AMX host (amx_tile in /proc/cpuinfo) and vLLM >= 0.28")
def test_unpatched_engine_dies_with_sigill_and_patched_one_generates(tmp_path):
    """Unpatched, the death is intermittent (a torch oneDNN bf16 GEMM that runs first asks for the permission
    as a side effect; seen here in about half the runs): up to 5 tries must show it at least once. Patched,
    every run generates."""
    spec = {"engine": {"model": model_path()}, "logprobs_probe": True}
    deaths = 0
    for i in range(5):
        d = tmp_path / f"off{i}"
        d.mkdir()
        off = run_engine(d, spec, VLLM_RLPATCH_CPU_AMX_PERMISSION="0")
        if off.proc.returncode != 0:
            assert "died unexpectedly (exit code: -4)" in off.log or "Illegal instruction" in off.log, off.log[-3000:]
            deaths += 1
            break
    assert deaths == 1, "5 unpatched engines in a row survived: the bug did not show on this host"
    for i in range(2):
        d = tmp_path / f"on{i}"
        d.mkdir()
        assert run_engine(d, spec).check()["probe"]["positions"] > 0
