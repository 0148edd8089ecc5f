"""The fleet update's two phases (vllm_rlpatch.refit.fleet) against scripted engines (no vLLM): who is
aborted when, what the report says, fencing by deadline, a hung engine named within timeout_s, the bytes
packed once; with ``dist``, one real gloo broadcast group spanning every scripted engine's workers
(threads). The same code on real vLLM engines: tests/test_fleet.py."""

import ipaddress
import socket
import threading
import time

import pytest
import torch

from vllm_rlpatch.refit import RefitError, fleet
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.target import Target

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick

SCHEMA = P.Schema({"w": ([4], "float32"), "b": ([2], "float32")}, {}, "test", "float32")
TENSORS = [("w", torch.arange(4, dtype=torch.float32)), ("b", torch.ones(2))]


class Front:
    """Stands for an engine's front end object (hashable, weak-referenceable)."""


class FakeEngine(Target):
    """One engine with one worker that follows the worker protocol: prepare stages, commit writes (and keeps
    a backup while ``rollback``), abort drops or restores, a deadline fences the commit."""

    kind = "llm"

    def __init__(self, guarantee="rollback", refuse=False, fail_commit=False, hang=None, hang_s=3.0):
        self.front = Front()
        self.guarantee, self.refuse, self.fail_commit, self.hang, self.hang_s = (guarantee, refuse, fail_commit,
                                                                                  hang, hang_s)
        self.weights_version, self.calls, self.txs, self.aborted = 0, [], {}, set()
        self.segments = None
        self.state = "clean"

    def describe(self):
        return [{"schema": SCHEMA.as_dict()}]

    def version(self):
        return self.weights_version

    def rpc(self, method, args, kwargs):
        self.calls.append(method)
        if self.hang == method:
            time.sleep(self.hang_s)
        return [getattr(self, method.removeprefix("rlpatch_refit_"))(*args, **kwargs)]

    def prepare(self, req, inflight=None):
        if req["txid"] in self.aborted:
            return {"ok": False, "state": "unchanged", "kind": "refused", "message": "aborted"}
        self.segments = [s["path"] for s in req["transport"]["segments"]]
        if self.refuse:
            return {"ok": False, "state": "unchanged", "kind": "refused", "message": "no room for the backup"}
        self.txs[req["txid"]] = {"deadline": req["deadline"], "version": req["version"], "written": False}
        return {"ok": True, "state": "unchanged", "guarantee": self.guarantee, "weight_version": self.weights_version}

    def commit(self, txid, version=None, release=True, inflight=None):
        tx = self.txs.get(txid)
        if tx is None:
            return {"ok": False, "state": "unchanged", "kind": "refused", "message": f"no prepared update {txid}"}
        if time.time() > tx["deadline"]:
            del self.txs[txid]
            return {"ok": False, "state": "unchanged", "kind": "refused", "message": "passed its deadline"}
        tx["written"] = True
        if self.fail_commit:
            del self.txs[txid]
            self.state = "clean" if self.guarantee == "rollback" else "mixed"
            return {"ok": False, "kind": "fault", "message": "injected fault",
                    "state": "restored" if self.guarantee == "rollback" else "mixed"}
        self.weights_version = max(self.weights_version + 1, version or 0)
        self.state = "new"
        if release:
            del self.txs[txid]
        return {"ok": True, "state": "committed", "version": self.weights_version, "guarantee": self.guarantee}

    def abort(self, txid):
        self.aborted.add(txid)
        tx = self.txs.pop(txid, None)
        if tx is None or not tx["written"]:
            return {"ok": True, "state": "unchanged"}
        if self.guarantee == "rollback":
            self.weights_version += 1
            self.state = "clean"
            return {"ok": True, "state": "restored"}
        self.state = "mixed"
        return {"ok": False, "state": "mixed", "message": "aborted after it wrote, no backup"}

    def release(self, txid):
        self.txs.pop(txid, None)
        return {"ok": True}

    def rlpatch_weight_state(self):
        return {"version": self.weights_version, "mixed": None}

    def align_version(self, version):
        self.weights_version = max(self.weights_version, version)
        return self.weights_version


def _phases(e):
    """The phase RPCs an engine got, in order (a report may ask an engine's version after them)."""
    return [c for c in e.calls if c.startswith("rlpatch_refit_")]


def push(engines, **kw):
    return fleet.push_weights(engines, TENSORS, transport="shm", **kw)


def test_a_good_update_commits_every_engine_at_one_version():
    a, b = FakeEngine(), FakeEngine()
    b.weights_version = 3
    rep = push([a, b])
    assert rep.ok and rep.state == "committed" and rep.version == 4 and rep.versions == [4, 4]
    assert [e["state"] for e in rep.engines] == ["committed", "committed"]
    assert rep.slowest in ("engine0", "engine1") and rep.slowest_seconds >= 0
    # every engine prepared before any engine committed; the backups were released only after all committed
    for e in (a, b):
        assert _phases(e) == [
            "rlpatch_refit_prepare", "rlpatch_refit_commit", "rlpatch_refit_release"]
    assert a.segments == b.segments  # packed once: both engines read the same segments
    assert fleet.weight_version([a, b]) == [4, 4]


def test_a_refusal_in_prepare_aborts_every_engine_and_nothing_is_written():
    a, b = FakeEngine(), FakeEngine(refuse=True)
    with pytest.raises(RefitError) as ei:
        push([a, b])
    rep = ei.value.report
    assert (rep.ok, rep.state, ei.value.state) == (False, "unchanged", "unchanged")
    assert "engine1" in str(ei.value) and "no room for the backup" in str(ei.value)
    assert "rlpatch_refit_commit" not in a.calls + b.calls
    assert _phases(a)[-1] == _phases(b)[-1] == "rlpatch_refit_abort"
    assert (a.state, b.state, a.weights_version, b.weights_version) == ("clean", "clean", 0, 0)
    assert rep.versions == [0, 0]


def test_a_commit_failure_rolls_back_every_engine_with_a_backup_and_versions_agree():
    a, b = FakeEngine(), FakeEngine(fail_commit=True)
    rep = push([a, b], raise_on_error=False)
    assert (rep.ok, rep.state) == (False, "restored")
    assert [e["state"] for e in rep.engines] == ["restored", "restored"]
    assert a.state == b.state == "clean"
    assert a.weights_version == b.weights_version == 2  # a: commit + rollback; b: raised to the same
    assert "commit failed on engine1" in rep.message
    assert fleet.weight_version([a, b]) == [2, 2]


def test_a_commit_failure_without_backups_leaves_the_fleet_mixed():
    a, b = FakeEngine("validate-then-write"), FakeEngine("validate-then-write", fail_commit=True)
    with pytest.raises(RefitError) as ei:
        push([a, b])
    assert ei.value.state == "mixed" and a.state == b.state == "mixed"
    assert [e["state"] for e in ei.value.report.engines] == ["mixed", "mixed"]


def test_a_hung_engine_is_an_error_naming_it_within_timeout_s_and_the_others_abort():
    a, b = FakeEngine(), FakeEngine(hang="rlpatch_refit_prepare", hang_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(RefitError) as ei:
        push([a, b], timeout_s=1.0)
    took = time.monotonic() - t0
    assert took < 5.0, took  # the hung prepare answers only after 8 s
    assert "engine1: no answer to prepare within 1.0 s" in str(ei.value)
    rep = ei.value.report
    assert rep.engines[1]["dead"] and rep.engines[1]["state"] == "unknown"
    assert rep.engines[0]["state"] == "unchanged" and _phases(a)[-1] == "rlpatch_refit_abort"
    assert "rlpatch_refit_commit" not in a.calls


def test_a_worker_refuses_to_commit_after_the_deadline():
    """The engine that prepared too slowly is fenced by the deadline its own worker checks: the commit it
    receives after timeout_s is refused, nothing is written, and the other engine is rolled back."""
    a, b = FakeEngine(hang="rlpatch_refit_prepare", hang_s=0.6), FakeEngine()
    rep = push([a, b], timeout_s=0.5 + 0.3, raise_on_error=False)  # prepare answers at 0.6 s, deadline 0.8 s
    # a's prepare answered in time, but by commit the deadline may be close: either all committed or a's
    # commit was fenced (refused, unchanged) and b rolled back; on a loaded host a's prepare may even miss the
    # deadline (both unchanged). Never a mix, and never a state without its engines agreeing.
    assert rep.state in ("committed", "restored", "unchanged"), rep
    assert rep.state != "committed" or all(e["state"] == "committed" for e in rep.engines), rep
    a2, b2 = FakeEngine(hang="rlpatch_refit_commit", hang_s=0.0), FakeEngine()
    a2.txs_deadline_shift = True
    orig = a2.commit

    def late_commit(txid, **kw):
        a2.txs[txid]["deadline"] = time.time() - 1  # the deadline has passed when the commit arrives
        return orig(txid, **kw)
    a2.commit = late_commit
    rep = push([a2, b2], raise_on_error=False)
    assert rep.state == "restored" and rep.engines[0]["state"] == "unchanged", rep
    assert "deadline" in rep.message and b2.state == "clean"


def test_an_engine_whose_commit_rpc_raised_is_aborted_too():
    """A live engine whose commit RPC raised may have written: it is aborted (restored from its backup) along
    with the engines that committed."""
    a, b = FakeEngine(), FakeEngine()
    orig = b.commit

    def commit(txid, **kw):
        orig(txid, release=False, **{k: v for k, v in kw.items() if k != "release"})
        raise RuntimeError("the reply was lost")
    b.commit = commit
    rep = push([a, b], raise_on_error=False)
    assert rep.state == "restored" and [e["state"] for e in rep.engines] == ["restored", "restored"], rep
    assert a.state == b.state == "clean" and "the reply was lost" in rep.message


def test_a_fleet_refuses_what_it_cannot_do_yet():
    a = FakeEngine()
    with pytest.raises(RefitError, match="list each engine once"):
        push([a, a])
    b = FakeEngine()
    b.weights_version = 5
    with pytest.raises(RefitError, match="disagree"):
        fleet.weight_version([a, b])


def test_the_worker_fences_a_late_or_aborted_commit():
    """vllm_rlpatch.refit.transaction: a commit after the request's deadline, or of an aborted update, is
    refused before anything is written; an aborted id is never prepared again."""
    from vllm_rlpatch.refit import transaction as T

    class W:
        pass

    w = W()
    wr = T.WorkerRefit(w)
    wr.txs["late"] = T.Transaction(P.RefitRequest.from_wire({"txid": "late", "deadline": time.time() - 2.0}))
    r = wr.commit("late")
    assert (r["ok"], r["kind"], r["state"]) == (False, "refused", "unchanged") and "deadline" in r["message"]
    assert "late" not in wr.txs
    wr.txs["gone"] = T.Transaction(P.RefitRequest.from_wire({"txid": "gone"}))
    assert wr.abort("gone")["state"] == "unchanged"
    for _ in range(2):  # an update this worker never held: absent, and idempotent
        assert wr.abort("never") == {"ok": True, "state": "unchanged", "absent": True, "note": "nothing to abort"}
    r = wr.commit("gone")
    assert (r["ok"], r["kind"]) == (False, "refused") and "aborted" in r["message"]
    r = wr.prepare({"txid": "gone"})
    assert (r["ok"], r["kind"]) == (False, "refused") and "aborted" in r["message"]


# ------------------------------------------------------------------------------------------ dist: one broadcast group
class _Worker:
    """What transaction.WorkerRefit reads of a worker on its refusal path: its rank and device."""

    def __init__(self, rank):
        self.rank, self.device = rank, torch.device("cpu")


class DistEngine(FakeEngine):
    """An engine of ``n`` workers that receive the fleet's broadcast for real: each worker (a thread) joins the
    gloo group as rank ``rank_base`` + its rank and receives every bucket. ``refuse_worker``: that worker refuses
    the update through the real worker code (transaction.WorkerRefit: an aborted id), which must still take part
    in the broadcast."""

    def __init__(self, n=1, refuse_worker=None, **kw):
        super().__init__(**kw)
        self.n, self.refuse_worker = n, refuse_worker
        self.workers = [_Worker(r) for r in range(n)]
        self.ranks, self.received, self.results = [], {}, []

    def describe(self):
        return [{"schema": SCHEMA.as_dict()}] * self.n

    def prepare(self, req, inflight=None):
        from vllm_rlpatch.refit import transaction as T
        from vllm_rlpatch.refit.dist import DistSource

        tr = req["transport"]
        assert tr["kind"] == "dist" and tr["stream"] is False

        def one(w):
            rank = tr["rank_base"] + w
            self.ranks.append(rank)
            if w == self.refuse_worker:
                wr = T.WorkerRefit(self.workers[w])
                wr.aborted.append(req["txid"])
                return wr.prepare(req)
            src = DistSource([P.TensorMeta.from_dict(d) for d in req["tensors"]], tr, rank, torch.device("cpu"))
            try:
                src.open()
                src.receive_all()
                self.received[w] = {m.name: t.clone() for m, t in src.tensors()}
                return {"ok": True, "state": "unchanged"}
            except P.RefitError as e:  # what the real worker reports
                return {"ok": False, "state": "unchanged", "kind": e.kind, "message": str(e)}
            finally:
                src.close()

        outs = [None] * self.n
        ts = [threading.Thread(target=lambda w=w: outs.__setitem__(w, one(w))) for w in range(self.n)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.results = outs
        bad = [o for o in outs if not o["ok"]]
        if bad:
            return bad[0]
        self.txs[req["txid"]] = {"deadline": req["deadline"], "version": req["version"], "written": False}
        return {"ok": True, "state": "unchanged", "guarantee": self.guarantee, "weight_version": self.weights_version}


def push_dist(engines, **kw):
    return fleet.push_weights(engines, TENSORS, transport="dist", **kw)


def test_dist_one_broadcast_group_spans_every_engines_workers():
    """Engines of 2 and 1 workers: world 1 + 3; each engine's workers get their offset; every worker receives
    the same bytes; the request differs between engines only in that offset."""
    a, b = DistEngine(n=2), DistEngine(n=1)
    rep = push_dist([a, b], timeout_s=30)
    assert rep.ok and rep.state == "committed" and rep.versions == [1, 1] and rep.transport == "dist", rep
    assert sorted(a.ranks) == [1, 2] and b.ranks == [3]
    assert rep.buckets >= 1 and "send" in rep.stages and "fingerprint" in rep.stages, rep.stages
    for e in (a, b):
        assert len(e.received) == e.n
        for got in e.received.values():
            assert all(torch.equal(got[n], t) for n, t in TENSORS)


def _this_hosts_address():
    """An address of this host other hosts could reach (the interface of the default route), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent, the kernel picks the interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(ip).is_loopback else ip


def test_an_engine_on_another_host_joins_one_dist_group_hosted_at_dist_host():
    """engine1 is on another host (its target says so): shm is refused naming it, dist on loopback too (it could
    not reach the group); with dist_host= an address of this host, one group spans both engines' workers (auto
    takes dist) and both receive every byte."""
    a, b = DistEngine(n=1), DistEngine(n=2)
    b.same_host = lambda: False
    with pytest.raises(RefitError) as ei:
        push([a, b])
    assert "engine1 is on another host: transport='shm' maps this host's memory" in str(ei.value), str(ei.value)
    with pytest.raises(RefitError) as ei:
        push_dist([a, b])
    assert "(loopback), out of its reach: pass dist_host=" in str(ei.value), str(ei.value)
    assert not _phases(a) + _phases(b)  # refused before any engine
    ip = _this_hosts_address()
    if ip is None:
        pytest.skip("this host has no address but loopback")
    rep = fleet.push_weights([a, b], TENSORS, transport="auto", dist_host=ip, timeout_s=30)
    assert rep.ok and rep.transport == "dist" and rep.versions == [1, 1], rep
    assert sorted(a.ranks) == [1] and sorted(b.ranks) == [2, 3]
    for e in (a, b):
        assert len(e.received) == e.n
        for got in e.received.values():
            assert all(torch.equal(got[n], t) for n, t in TENSORS)


def test_one_engine_on_another_host_is_refused_a_loopback_dist_group():
    """A single engine on another host over dist with no dist_host (the group on 127.0.0.1): refused before any
    RPC, in one line saying what to pass."""
    from vllm_rlpatch.refit import api

    b = DistEngine(n=1)
    b.same_host = lambda: False
    with pytest.raises(RefitError) as ei:
        api.push_weights(b, TENSORS, transport="dist", timeout_s=30)
    assert str(ei.value).startswith("the engine is on another host: a dist group hosted at 127.0.0.1 (loopback)")
    assert not _phases(b)


def test_dist_a_refusing_worker_still_takes_part_and_nothing_is_written():
    """engine1's second worker refuses (the real worker code): it drains the broadcast, so engine0 and
    engine1's other worker receive every bucket at once, and every engine is aborted - long before the
    group's timeout."""
    a, b = DistEngine(n=1), DistEngine(n=2, refuse_worker=1)
    t0 = time.monotonic()
    rep = push_dist([a, b], timeout_s=60, raise_on_error=False)
    took = time.monotonic() - t0
    assert took < 10.0, took  # the group times out after 45 s
    assert rep.state == "unchanged" and [e["state"] for e in rep.engines] == ["unchanged", "unchanged"], rep
    assert "engine1 prepare" in rep.message and "aborted" in rep.message and "\n" not in rep.message
    assert "never joined" not in rep.message  # it refused, but it took part
    assert len(a.received) == 1 and len(b.received) == 1  # both receivers got the whole update
    assert "drain" in b.results[1]["stages"], b.results[1]
    assert _phases(a)[-1] == _phases(b)[-1] == "rlpatch_refit_abort"
    assert "rlpatch_refit_commit" not in a.calls + b.calls


def test_dist_a_hung_engine_is_named_within_timeout_s_and_the_others_get_an_error_not_a_hang():
    a, b = DistEngine(n=1), DistEngine(n=1, hang="rlpatch_refit_prepare", hang_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(RefitError) as ei:
        push_dist([a, b], timeout_s=2.0)
    took = time.monotonic() - t0
    assert took < 5.0, took
    msg = str(ei.value)
    assert "engine1: no answer to prepare within 2.0 s" in msg and "\n" not in msg, msg
    assert msg.endswith("never joined the broadcast group: engine1 (1 worker)"), msg
    rep = ei.value.report
    assert "engine0 prepare: dist transport: the broadcast group did not form within 1.5 s" in \
        rep.engines[0]["errors"][0], rep.engines[0]
    assert rep.engines[1]["dead"] and not rep.engines[0]["dead"], rep.engines
    assert rep.engines[0]["state"] == "unchanged" and _phases(a)[-1] == "rlpatch_refit_abort"
    assert "rlpatch_refit_commit" not in a.calls


def test_dist_relay_the_trainer_sends_each_bucket_once_and_a_draining_rank_passes_it_on(monkeypatch):
    """gloo with several receivers (algo "relay"): engines of 1, 2 and 1 workers (receivers at ranks 1-4), two
    buckets. The trainer sends each bucket once, to rank 1; the receivers pass it on along a binomial tree rooted
    at rank 1 (rank 1 -> 2, 3; rank 2 -> 4). Rank 2 (engine1's first worker) refuses and drains: it still passes
    every bucket on, so rank 4 (engine2) receives the whole update, bit for bit. Then a good update through the
    same tree, every worker equal to the trainer's tensors."""
    from vllm_rlpatch.refit import dist as D

    sends = []
    orig = D.relay

    def counted(pg, buf, rank, world, tag):
        works = orig(pg, buf, rank, world, tag)
        sends.append((rank, tag, len(works)))
        return works

    monkeypatch.setattr(D, "relay", counted)
    a, b, c = DistEngine(n=1), DistEngine(n=2, refuse_worker=0), DistEngine(n=1)
    rep = push_dist([a, b, c], timeout_s=60, raise_on_error=False, bucket_bytes=16)
    assert rep.state == "unchanged" and rep.buckets == 2, rep
    per_rank = {r: sorted((t, n) for rr, t, n in sends if rr == r) for r in range(5)}
    assert per_rank == {0: [(0, 1), (1, 1)], 1: [(0, 2), (1, 2)], 2: [(0, 1), (1, 1)], 3: [(0, 0), (1, 0)],
                        4: [(0, 0), (1, 0)]}, per_rank
    assert "drain" in b.results[0]["stages"], b.results[0]
    assert sorted(b.received) == [1] and sorted(c.received) == [0] and sorted(a.received) == [0]
    for e in (a, b, c):
        for got in e.received.values():
            assert all(torch.equal(got[n], t) for n, t in TENSORS)
    sends.clear()
    a, b, c = DistEngine(n=1), DistEngine(n=2), DistEngine(n=1)
    rep = push_dist([a, b, c], timeout_s=60, bucket_bytes=16)
    assert rep.ok and rep.versions == [1, 1, 1] and len([s for s in sends if s[0] == 0]) == 2, (rep, sends)
    for e in (a, b, c):
        assert len(e.received) == e.n
        for got in e.received.values():
            assert all(torch.equal(got[n], t) for n, t in TENSORS)


def test_dist_relay_tree_reaches_every_receiver_once():
    """The relay's schedule for 1-9 receivers, without a network: every receiver gets the bucket exactly once,
    from a rank that already has it, and the trainer sends once."""
    from vllm_rlpatch.refit import dist as D

    class Rec:
        def __init__(self):
            self.log = []

        def send(self, bufs, dst, tag):
            self.log.append(("send", dst))
            return self

        def recv(self, bufs, src, tag):
            self.log.append(("recv", src))
            return self

        def wait(self):
            return True

    for world in range(2, 11):
        logs = {}
        for rank in range(world):
            pg = Rec()
            D.relay(pg, torch.empty(1), rank, world, 0)
            logs[rank] = pg.log
        assert logs[0] == [("send", 1)]
        for r in range(1, world):
            recvs = [x for x in logs[r] if x[0] == "recv"]
            assert len(recvs) == 1 and logs[r][0] == recvs[0], (world, r, logs)
            src = recvs[0][1]
            assert ("send", r) in logs[src], (world, r, logs)
        assert sum(len(v) for v in logs.values()) == 2 * (world - 1)
