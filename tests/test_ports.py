"""vllm_rlpatch.hooks.ports: host-wide port leases (real sockets, real flock across processes; no vLLM needed)."""

import socket
import subprocess
import sys
import time

import pytest

from vllm_rlpatch.hooks import ports


@pytest.fixture(autouse=True)
def _lease_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_RLPATCH_PORT_LEASE_DIR", str(tmp_path / "leases"))
    yield
    for p in list(ports._HELD):
        ports.release(p)


def _free_band(n: int) -> int:
    """A start port with n free ports above it."""
    for start in range(23000, 60000, 97):
        if all(ports._bind_probe(p) is not None for p in range(start, start + n)):
            return start
    raise RuntimeError("no free band")


def test_pick_port_skips_bound_and_leased_ports():
    start = _free_band(4)
    with socket.socket() as s:
        s.bind(("", start))
        s.listen()
        a = ports.pick_port(start, 4)
        assert a == start + 1  # start is bound
        b = ports.pick_port(start, 4)
        assert b == start + 2  # start + 1 is leased by this process now
        assert ports.is_leased(a) and ports.is_leased(b)


def test_lease_is_seen_by_another_process_and_dies_with_it(tmp_path):
    start = _free_band(2)
    code = ("import sys, time; from vllm_rlpatch.hooks import ports; "
            f"p = ports.pick_port({start}, 2); print(p, flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        held = int(proc.stdout.readline())
        assert held == start
        assert ports.is_leased(start)
        assert ports.pick_port(start, 2) == start + 1  # the other process's lease is skipped
    finally:
        proc.kill()
        proc.wait()
    assert not ports.is_leased(start)  # the lease ends with its process


def test_lease_expires():
    start = _free_band(1)
    assert ports.pick_port(start, 1, seconds=0.2) == start
    assert ports.is_leased(start)
    time.sleep(0.5)
    assert not ports.is_leased(start)


def test_exhausted_band_names_the_range():
    start = _free_band(2)
    socks = []
    try:
        for p in (start, start + 1):
            s = socket.socket()
            s.bind(("", p))
            s.listen()
            socks.append(s)
        with pytest.raises(ports.PortRangeExhausted) as e:
            ports.pick_port(start, 2, what="TCPStore")
        assert f"{start}-{start + 1}" in str(e.value) and "VLLM_RLPATCH_PORT_BAND" in str(e.value)
    finally:
        for s in socks:
            s.close()


def test_ephemeral_pick_is_leased():
    p = ports.pick_port(None)
    assert 1024 < p < 65536 and ports.is_leased(p)


def test_bad_env_values_are_clear_errors(monkeypatch):
    from vllm_rlpatch import envs

    monkeypatch.setenv("VLLM_RLPATCH_PORT_BAND", "lots")
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_PORT_BAND='lots' is not a whole number"):
        ports.band_size()
    monkeypatch.setenv("VLLM_RLPATCH_PORT_BAND", "0")
    with pytest.raises(envs.EnvError, match="out of range"):
        ports.band_size()
    monkeypatch.setenv("VLLM_RLPATCH_PORT_LEASE_S", "-1")
    with pytest.raises(envs.EnvError, match="VLLM_RLPATCH_PORT_LEASE_S"):
        ports.lease_seconds()


def test_claim_and_pick_exclude_each_other():
    start = _free_band(1)
    with ports.claim(start) as mine:
        assert mine
        with pytest.raises(ports.PortRangeExhausted):  # a band binder is checking this port right now
            ports.pick_port(start, 1)
    assert ports.pick_port(start, 1) == start
    with ports.claim(start) as mine:
        assert not mine  # leased for a TCPStore: a band binder skips it
