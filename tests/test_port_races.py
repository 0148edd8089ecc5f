"""Port races on real vLLM code (issue: atomic MessageQueue bind, TCPStore port deconfliction).

On 2 cores the natural probe->bind window is microseconds, so the tests widen it the way a loaded node does:
`DELAY` s (0.3; 1 where the test needs the race to happen despite start skew on a loaded CI box) between vLLM's own port probe (`network_utils._get_open_port`) and the bind that follows, and
`HOLD` s between the TCPStore port selection and the store's bind (a Ray actor starting). Each bug is
reproduced with the patch off (so each test can fail) and shown gone with it on, over many concurrent
processes (tests/portrace.py, tests/scripts/port_stress.py). The two-host tests run writer and readers in
two network namespaces joined by a veth pair, so the TCP path crosses a real interface.
"""

import dataclasses
import os
import socket

import pytest
from packaging.version import Version

from support import portrace
from support.env import vllm_version

V = Version(vllm_version().split("+")[0])
MQ_BUG = V < Version("0.28")
STORE_BUG = V < Version("0.29")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
only_with_mq_bug = pytest.mark.skipif(not MQ_BUG, reason=f"vLLM {V} binds the MessageQueue atomically itself")
# The MessageQueue's probe-then-bind code is the same in every release that has the bug (0.20.2 and 0.25.1
# differ only in the reader's spin loop), so its multi-process stresses, the two-host runs and the TP=2 engine
# run on one of them, the newest (CI time); older ones keep the cheap checks that the patch is live there
# (exhausted band, IPv6). The TCPStore tests run everywhere: 0.20's port selection is another code path.
MQ_STRESS = MQ_BUG and V >= Version("0.25")
_mq_stress_here = pytest.mark.skipif(MQ_BUG and not MQ_STRESS, reason=f"vLLM {V}: the MessageQueue stresses run on "
                                     "the newest release with the same probe-then-bind code (0.25.x in CI)")


def mq_stress(fn):
    return only_with_mq_bug(_mq_stress_here(fn))
only_with_store_bug = pytest.mark.skipif(not STORE_BUG, reason=f"vLLM {V} binds the TCPStore itself")


def _errors(r):
    return " | ".join(r["errors"])


# ---------------------------------------------------------------------------------------------------------
# MessageQueue: 8 processes (each imports vLLM: that, not the creations, is the test's time), remote readers,
# VLLM_PORT set
@mq_stress
def test_mq_stress_unpatched_fails():
    r = portrace.mq_trial(procs=8, count=2, delay=1.0, patched=False)  # 1 s: robust to start skew
    assert r["failed"] > 0, r
    assert "Address already in use" in _errors(r), r
    assert r["corrupted"] == 0 and r["delivered"] == r["created"], r


@mq_stress
def test_mq_stress_patched_never_fails():
    r = portrace.mq_trial(procs=8, count=126, delay=0.3, patched=True)
    assert r["attempts"] >= 1000
    assert r["failed"] == 0, r
    assert r["delivered"] == r["attempts"] and r["corrupted"] == 0, r
    band = range(r["vllm_port"], r["vllm_port"] + 512)
    assert r["ports_seen"] and all(p in band for p in r["ports_seen"]), r  # VLLM_PORT still honoured


@only_with_mq_bug
def test_mq_exhausted_band_is_a_clear_error():
    start = portrace.free_band(2)
    held = []
    try:
        for p in (start, start + 1):
            s = socket.socket()
            s.bind(("", p))
            s.listen()
            held.append(s)
        r = portrace.mq_trial(procs=1, count=1, delay=0, patched=True, vllm_port=start, band=2)
    finally:
        for s in held:
            s.close()
    assert r["failed"] == 1, r
    err = _errors(r)
    assert "PortRangeExhausted" in err and f"{start}-{start + 1}" in err and "VLLM_RLPATCH_PORT_BAND" in err, r


@only_with_mq_bug
@pytest.mark.parametrize("with_port", [True, False], ids=["VLLM_PORT", "ephemeral"])
def test_mq_ipv6_loopback(with_port):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this kernel")
    port = portrace.free_band(16) if with_port else None
    r = portrace.mq_trial(procs=2, count=5, delay=0.1, patched=True, ip="::1", vllm_port=port)
    assert r["failed"] == 0 and r["delivered"] == 10, r


def test_mq_unaffected_when_upstream_binds_atomically():
    """On a vLLM without the bug the plugin leaves shm_broadcast alone, and stock vLLM itself survives the
    same stress (behaviour, not only the version number)."""
    if MQ_BUG:
        pytest.skip(f"vLLM {V} has the probe-then-bind MessageQueue")
    from vllm_rlpatch import registry
    from vllm_rlpatch.patches import mq_bind_retry

    assert registry.decide(mq_bind_retry.SPEC)[0] == "not_needed"
    forced = dataclasses.replace(mq_bind_retry.SPEC, vllm=">=0", fixed_in=None)
    state, reason = registry.decide(forced)
    assert state == "not_needed" and "behaviour probe" in reason, (state, reason)
    r = portrace.mq_trial(procs=8, count=4, delay=0.3, patched=None)
    assert r["failed"] == 0 and r["delivered"] == r["attempts"], r


# ---------------------------------------------------------------------------------------------------------
# Two hosts: network namespaces + veth
@pytest.fixture(scope="module")
def two_hosts():
    why = portrace.TwoHosts.unavailable()
    if why:
        if IN_CI:
            pytest.fail(f"two-host tests cannot run under CI=true: {why}")
        pytest.skip(f"two-host tests need network namespaces: {why}")
    with portrace.TwoHosts() as h:
        yield h


@mq_stress
def test_two_hosts_unpatched_fails(two_hosts):
    r = portrace.two_host_trial(two_hosts, writers=4, count=2, delay=1.0, patched=False)
    assert r["failed"] > 0 and "Address already in use" in _errors(r), r
    assert r["received_on_other_host"] == r["created"], r


@mq_stress
@pytest.mark.parametrize("ipv6", [False, True], ids=["ipv4", "ipv6"])
def test_two_hosts_patched(two_hosts, ipv6):
    r = portrace.two_host_trial(two_hosts, writers=4, count=25 if not ipv6 else 5, delay=0.3, patched=True,
                                ipv6=ipv6)
    assert r["failed"] == 0, r
    assert r["received_on_other_host"] == r["attempts"] == r["delivered"], r
    assert r["writer_ip"] in two_hosts.interfaces(two_hosts.a)


# ---------------------------------------------------------------------------------------------------------
# TCPStore: 32 concurrent non-DP engine inits (4 processes x 8 threads), real selection + real TCPStore bind
@only_with_store_bug
def test_tcpstore_concurrent_inits_unpatched_collide():
    if os.geteuid() != 0 and V >= Version("0.25"):
        pytest.skip("the port-100 collision needs root (non-root cannot bind port 100 and falls back)")
    r = portrace.tcpstore_trial(procs=4, threads=8, hold=2.0, patched=False, vllm_port=portrace.free_band(64))
    assert r["inits"] == 32 and r["store_bind_failures"] > 0, r
    assert "EADDRINUSE" in _errors(r) or "address already in use" in _errors(r).lower(), r
    if "_select_tcpstore_port(0, 0)" in r["how"]:
        # the port-100 bug, VLLM_PORT or not: every engine probes upward from 100 in a 32-port window, so they
        # crowd onto 100 and the next few (which one is most common depends on who bound first)
        lo, hi = r["port_range"]
        assert lo == 100 and hi < 132 and r["distinct_ports"] < r["inits"] // 2, r


@only_with_store_bug
@pytest.mark.parametrize("with_port", [True, False], ids=["VLLM_PORT", "ephemeral"])
def test_tcpstore_concurrent_inits_patched(with_port):
    port = portrace.free_band(64) if with_port else None
    r = portrace.tcpstore_trial(procs=4, threads=8, hold=1.0, patched=True, vllm_port=port)
    assert r["inits"] == 32 and r["store_bind_failures"] == 0 and r["distinct_ports"] == 32, r
    assert r["most_common_port"][0] != 100, r


@only_with_store_bug
def test_tcpstore_and_messagequeue_in_one_process():
    """RayExecutorV2 step 3 picks the store port, step 4 creates the MessageQueue: with VLLM_PORT set the
    queue must not take the port the store will bind."""
    port = portrace.free_band(64)
    off = portrace.tcpstore_trial(procs=1, threads=1, hold=0.5, patched=False, vllm_port=port, mq_ip="127.0.0.1")
    if off["how"] == ["get_open_port()"]:  # 0.20: both probes return VLLM_PORT
        assert off["mq_took_store_port"] == 1 and off["store_bind_failures"] == 1, off
    on = portrace.tcpstore_trial(procs=2, threads=2, hold=0.5, patched=True, vllm_port=port, mq_ip="127.0.0.1")
    assert on["inits"] == 4 and on["mq_took_store_port"] == 0 and on["store_bind_failures"] == 0, on
    assert on["distinct_ports"] == 4, on


def test_tcpstore_not_needed_where_upstream_binds_the_store():
    if STORE_BUG:
        pytest.skip(f"vLLM {V} selects TCPStore ports by probing")
    import types

    from vllm.v1.executor import ray_executor_v2, uniproc_executor

    from vllm_rlpatch import registry
    from vllm_rlpatch.patches import tcpstore_port

    assert registry.decide(tcpstore_port.SPEC)[0] == "not_needed"
    forced = dataclasses.replace(tcpstore_port.SPEC, vllm=">=0", fixed_in=None)
    state, reason = registry.decide(forced)
    assert state == "not_needed" and "behaviour probe" in reason, (state, reason)
    # behaviour: the uniproc executor's rendezvous is a file store (no TCP port at all), and the Ray v2
    # executor has no probe-based selection (its rank-0 actor binds port 0 and keeps the store)
    fake = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
        device_config=types.SimpleNamespace(device="cpu")))
    method, rank, _ = uniproc_executor.UniProcExecutor._distributed_args(fake)
    assert method.startswith("file://") and rank == 0, method
    assert not hasattr(ray_executor_v2.RayExecutorV2, "_select_tcpstore_port")
    assert hasattr(ray_executor_v2.RayWorkerProc, "create_dist_init_method")


# ---------------------------------------------------------------------------------------------------------
# One real engine across the two hosts: TP=2, vLLM's multi-node mp executor, VLLM_PORT set
@mq_stress
def test_tp2_engine_across_two_hosts(two_hosts):
    import re

    from support.env import model_path

    vport = 30000
    r = portrace.two_host_engine(two_hosts, model_path(), env_extra={
        "VLLM_PORT": str(vport), "VLLM_RLPATCH_LOG_LEVEL": "DEBUG"})
    assert r["result"] is not None, f"rc={r['rc']}\n--- host A\n{r['log_a'][-5000:]}\n--- host B\n{r['log_b'][-3000:]}"
    assert len(r["result"]["token_ids"]) == 8, r["result"]
    # node 0's executor broadcasts to the rank on host B through a MessageQueue remote socket on host A's
    # interface (n_remote_reader=1)
    assert f"mq_connect_ip={two_hosts.ip_a}" in r["log_a"], r["log_a"][-3000:]
    if MQ_BUG:
        bound = [int(p) for p in re.findall(
            r"MessageQueue remote socket bound atomically at tcp://" + re.escape(two_hosts.ip_a) + r":(\d+)",
            r["log_a"])]
        assert bound and all(vport <= p < vport + 512 for p in bound), r["log_a"][-3000:]
        for log in (r["log_a"], r["log_b"]):
            assert re.search(r"applied=\[[^\]]*mq_bind_retry", log), log[-3000:]
