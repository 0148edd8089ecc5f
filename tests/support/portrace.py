"""Port-race trials on real vLLM code: many processes at once, optionally on two "hosts" (Linux network
namespaces joined by a veth pair). Used by tests/test_port_races.py and benchmarks/port_races.py.

Every trial runs tests/scripts/port_stress.py workers in fresh interpreters that load vLLM's general plugins
as vLLM does; `patched=False` turns only the patch under test off (VLLM_RLPATCH_<NAME>=0), or the whole
plugin (`patched=None`: VLLM_RLPATCH_ENABLED=0).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
STRESS = TESTS / "scripts" / "port_stress.py"


def env_for(patch: str, patched: bool | None, lease_dir: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_") and k != "VLLM_PORT"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["VLLM_RLPATCH_PORT_LEASE_DIR"] = lease_dir
    if patched is None:
        env["VLLM_RLPATCH_ENABLED"] = "0"
    elif not patched:
        env[f"VLLM_RLPATCH_{patch.upper()}"] = "0"
    env.update(extra)
    return env


def _ephemeral_low() -> int:
    """The first port the kernel hands out as a connection's source port (Linux: ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_band(n: int, lo: int = 21000, hi: int = 60000) -> int:
    """A start port with n ports above it that nobody on this host binds now, below the kernel's ephemeral range
    where the host allows it: a trial's own outgoing connections (its TCPStore clients, its queues) take
    source ports from that range, and one landing in the band would fail a bind that the code under test
    did right."""
    import random

    if _ephemeral_low() - lo > 4 * n:
        hi = min(hi, _ephemeral_low())
    rnd = random.Random(os.getpid() ^ int(time.time()))
    for _ in range(400):
        start = rnd.randrange(lo, hi - n)
        ok = True
        for p in range(start, start + n):
            with socket.socket() as s:
                try:
                    s.bind(("", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return start
    raise RuntimeError(f"no band of {n} free ports found in {lo}-{hi}")


def _launch(args: list[str], env: dict[str, str], netns: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(STRESS), *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _collect(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    out, deadline = [], time.time() + timeout
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"port-stress worker {p.args} timed out after {timeout:.0f}s")
        lines = [l for l in so.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"port-stress worker {p.args} exited {p.returncode}:\n{(so + se)[-4000:]}")
        out.append(json.loads(lines[-1][7:]))
    return out


class Barrier:
    """Workers import vLLM first (seconds each on 2 cores), say `ready`, and all start at one instant."""

    def __init__(self, root: str):
        self.dir = os.path.join(root, "barrier")
        os.makedirs(self.dir, exist_ok=True)
        self.arg = "@" + self.dir

    def release(self, procs: list[subprocess.Popen], n: int, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while len([f for f in os.listdir(self.dir) if f.startswith("ready-")]) < n:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                so, se = dead[0].communicate()
                raise RuntimeError(f"port-stress worker {dead[0].args} exited {dead[0].returncode} before the "
                                   f"start:\n{(so + se)[-4000:]}")
            if time.time() > deadline:
                raise RuntimeError(f"port-stress workers not ready after {timeout:.0f}s")
            time.sleep(0.05)
        with open(os.path.join(self.dir, "go.tmp"), "w") as fh:
            fh.write(repr(time.time() + 0.5))
        os.replace(os.path.join(self.dir, "go.tmp"), os.path.join(self.dir, "go"))


def mq_trial(*, procs: int, count: int, delay: float, patched: bool | None, ip: str = "127.0.0.1",
             vllm_port: int | None = None, band: int | None = None, timeout: float = 600) -> dict:
    """`procs` processes each create `count` MessageQueues with one remote reader (n_local_reader=0),
    `delay` s between vLLM's port probe and its bind; every message must arrive intact."""
    with tempfile.TemporaryDirectory(prefix="rlp-mq-") as d:
        port = free_band(max(64, procs * 2)) if vllm_port is None else vllm_port
        extra = {"VLLM_PORT": str(port)}
        if band is not None:
            extra["VLLM_RLPATCH_PORT_BAND"] = str(band)
        env = env_for("mq_bind_retry", patched, os.path.join(d, "leases"), **extra)
        t0 = time.time()
        bar = Barrier(d)
        ps = [_launch(["mq", bar.arg, str(count), str(delay), ip], env) for _ in range(procs)]
        bar.release(ps, procs)
        res = _collect(ps, timeout)
    return _mq_summary(res, procs * count, port, time.time() - t0)


def _mq_summary(res: list[dict], attempts: int, vllm_port: int, wall: float) -> dict:
    created = sum(r["created"] for r in res)
    failed = sum(r["failed"] for r in res)
    errors = [e for r in res for e in r["errors"]]
    return {"attempts": attempts, "created": created, "failed": failed,
            "failure_rate": round(failed / attempts, 4) if attempts else None,
            "delivered": sum(r["delivered"] for r in res), "corrupted": sum(r.get("corrupted", 0) for r in res),
            "vllm_port": vllm_port, "ports_seen": sorted({p for r in res for p in r.get("ports", [])}),
            "errors": sorted(set(errors))[:3], "wall_s": round(wall, 1)}


# ---------------------------------------------------------------------------------------------------------
class TwoHosts:
    """Two network namespaces ("hosts") joined by a veth pair: A = 10.77.x.1 / fd77:x::1, B = .2 / ::2."""

    def __init__(self):
        tag = uuid.uuid4().hex[:6]
        self.a, self.b = f"rlpA{tag}", f"rlpB{tag}"
        octet = int(tag[:2], 16) % 250 + 1
        self.ip_a, self.ip_b = f"10.77.{octet}.1", f"10.77.{octet}.2"
        self.ip6_a, self.ip6_b = f"fd77:{octet:x}::1", f"fd77:{octet:x}::2"
        self._va, self._vb = f"va{tag}", f"vb{tag}"

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be built here (None: they can)."""
        if shutil.which("ip") is None:
            return "the `ip` tool (iproute2) is not installed"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"rlpprobe{os.getpid()}"
        p = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if p.returncode != 0:
            return f"`ip netns add` failed: {p.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
        return None

    def _ip(self, *args: str) -> None:
        p = subprocess.run(["ip", *args], capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")

    def __enter__(self) -> "TwoHosts":
        self._ip("netns", "add", self.a)
        self._ip("netns", "add", self.b)
        try:
            self._ip("link", "add", self._va, "type", "veth", "peer", "name", self._vb)
            self._ip("link", "set", self._va, "netns", self.a)
            self._ip("link", "set", self._vb, "netns", self.b)
            for ns, dev, ip4, ip6 in ((self.a, self._va, self.ip_a, self.ip6_a), (self.b, self._vb, self.ip_b, self.ip6_b)):
                self._ip("-n", ns, "addr", "add", f"{ip4}/24", "dev", dev)
                self._ip("-n", ns, "addr", "add", f"{ip6}/64", "dev", dev, "nodad")
                self._ip("-n", ns, "link", "set", dev, "up")
                self._ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.__exit__()
            raise
        return self

    def kill_all(self) -> None:
        """Kill every process left in the namespaces (an engine's workers outlive a killed parent)."""
        for ns in (self.a, self.b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass

    def __exit__(self, *exc) -> None:
        self.kill_all()
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def interfaces(self, ns: str) -> str:
        return subprocess.run(["ip", "-n", ns, "-brief", "addr"], capture_output=True, text=True).stdout


def two_host_trial(hosts: TwoHosts, *, writers: int, count: int, delay: float, patched: bool,
                   ipv6: bool = False, vllm_port: int = 31000, timeout: float = 600) -> dict:
    """`writers` processes on host A each create `count` MessageQueues whose reader is a process on host B
    (connecting over the veth interface); with VLLM_PORT set on A."""
    ip = hosts.ip6_a if ipv6 else hosts.ip_a
    with tempfile.TemporaryDirectory(prefix="rlp-2host-") as d:
        env = env_for("mq_bind_retry", patched, os.path.join(d, "leases"), VLLM_PORT=str(vllm_port))
        t0 = time.time()
        bar = Barrier(d)
        ws = [_launch(["mq-writer", d, str(i), str(count), bar.arg, str(delay), ip], env, hosts.a)
              for i in range(writers)]
        rs = [_launch(["mq-reader", d, str(i), str(count)], env, hosts.b) for i in range(writers)]
        bar.release(ws, writers)
        wres = _collect(ws, timeout)
        rres = _collect(rs, timeout)
    out = _mq_summary(wres, writers * count, vllm_port, time.time() - t0)
    out["received_on_other_host"] = sum(r["received"] for r in rres)
    out["writer_host"], out["reader_host"], out["writer_ip"] = hosts.a, hosts.b, ip
    return out


# ---------------------------------------------------------------------------------------------------------
def tcpstore_trial(*, procs: int, threads: int, hold: float, patched: bool | None, vllm_port: int | None = None,
                   mq_ip: str | None = None, timeout: float = 600) -> dict:
    """`procs` x `threads` concurrent non-DP engine inits: each selects its TCPStore port with vLLM's real
    code (RayExecutorV2), optionally creates the engine's MessageQueue next (as _init_executor does), waits
    `hold` s (the rank-0 actor starting), then binds a real torch.distributed.TCPStore on the port."""
    with tempfile.TemporaryDirectory(prefix="rlp-tcpstore-") as d:
        extra = {} if vllm_port is None else {"VLLM_PORT": str(vllm_port)}
        env = env_for("tcpstore_port", patched, os.path.join(d, "leases"), **extra)
        t0 = time.time()
        bar = Barrier(d)
        args = ["tcpstore", bar.arg, str(hold), str(threads)] + (["--mq", mq_ip] if mq_ip else [])
        ps = [_launch(args, env) for _ in range(procs)]
        bar.release(ps, procs)
        res = _collect(ps, timeout)
    inits = [t for r in res for t in r["inits"]]
    store_ports = [t["port"] for t in inits]
    failed = [t for t in inits if not t["bound"]]
    mq_clash = [t for t in inits if t.get("mq_port") == t["port"]]
    from collections import Counter

    return {"inits": len(inits), "store_bind_failures": len(failed),
            "failure_rate": round(len(failed) / len(inits), 4) if inits else None,
            "distinct_ports": len(set(store_ports)), "most_common_port": Counter(store_ports).most_common(1)[0],
            "port_range": [min(store_ports), max(store_ports)] if store_ports else None,
            "mq_took_store_port": len(mq_clash), "how": sorted({t["how"] for t in inits}),
            "vllm_port": vllm_port, "as_root": os.geteuid() == 0,
            "errors": sorted({t["error"].splitlines()[0][:200] for t in failed})[:3], "wall_s": round(time.time() - t0, 1)}


def two_host_engine(hosts: TwoHosts, model: str, *, env_extra: dict[str, str], timeout: float = 400) -> dict:
    """A TP=2 engine with one rank on each host (vLLM's multi-node mp executor); node 0 generates 8 greedy
    tokens. Returns node 0's RESULT plus both hosts' logs."""
    script = str(TESTS / "scripts" / "multinode_engine.py")
    base = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_") and k != "VLLM_PORT"}
    base["PYTHONPATH"] = os.pathsep.join([str(TESTS), base.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    base.update(env_extra)
    master_port = "29555"
    env_b = dict(base, VLLM_HOST_IP=hosts.ip_b, GLOO_SOCKET_IFNAME=hosts._vb, VLLM_CPU_OMP_THREADS_BIND="1")
    env_a = dict(base, VLLM_HOST_IP=hosts.ip_a, GLOO_SOCKET_IFNAME=hosts._va, VLLM_CPU_OMP_THREADS_BIND="0")
    cmd = lambda ns, role: ["ip", "netns", "exec", ns, sys.executable, script, role, model, hosts.ip_a, master_port]
    t0 = time.time()
    b = subprocess.Popen(cmd(hosts.b, "node1"), env=env_b, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        a = subprocess.run(cmd(hosts.a, "node0"), env=env_a, capture_output=True, text=True, timeout=timeout)
        log_a = a.stdout + a.stderr
        rc = a.returncode
    except subprocess.TimeoutExpired as e:
        log_a = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    finally:
        hosts.kill_all()
        try:
            log_b = b.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            b.kill()
            log_b = b.communicate()[0]
    lines = [l for l in log_a.splitlines() if l.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else None
    return {"result": res, "rc": rc, "log_a": log_a, "log_b": log_b, "wall_s": round(time.time() - t0, 1)}
