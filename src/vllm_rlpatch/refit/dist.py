"""The ``dist`` transport: buckets broadcast over a ``torch.distributed`` process group of the update's own.

Sender (trainer side, :class:`DistSender`): hosts a TCPStore, joins a fresh process group with every worker
(trainer = rank 0; gloo between CPU processes or hosts, NCCL between GPUs) and broadcasts the buckets in order
from a background thread. It digests its tensors first (one fused pass), so a NaN is refused before anything
is sent.

Source (worker side, :class:`DistSource`): receives bucket by bucket into this worker's memory. The bytes
crossed a network: the worker digests what it received and compares (``trusted_digests`` is False). Its rank in
the group is the spec's ``rank_base`` + the worker's rank in its engine: 1 + rank for one engine; a fleet
(:mod:`.fleet`) gives each engine the offset of its workers in one group spanning every engine's workers, so
the bytes are broadcast once for the whole fleet. The broadcast is a collective: a worker that refuses the
update must still take part (:meth:`DistSource.drain`), or every other rank waits for it until the group's
timeout. ``stream`` (default True) False: never streamed into the weights (a fleet receives in prepare).

How a bucket moves (``algo`` in the spec, chosen by the sender): ``broadcast`` is the backend's broadcast, used
with NCCL (pipelined in chunks along a ring: the sender's link carries the bytes once) and with a single gloo
receiver. gloo's broadcast is a binomial tree rooted at the sender, which sends the bucket ``ceil(log2(world))``
times (1, 2, 2, 3 sends for 1-4 receivers: gloo/broadcast.cc), so with several gloo receivers the sender's time
grew with the fleet. ``relay`` (gloo, several receivers): the sender sends each bucket once, to rank 1, and the
receivers pass it on among themselves along the same binomial tree rooted at rank 1 (:func:`relay`); a relaying
rank posts its receive of the next bucket before it waits for its own sends of this one, so the buckets overlap.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import uuid
from typing import Any

import torch

from vllm_rlpatch.refit import checks
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.sender import Sender, SendJob
from vllm_rlpatch.refit.source import Source
from vllm_rlpatch.refit.target import is_loopback

logger = logging.getLogger("vllm.rlpatch")


def joined_key(txid: str, rank: int) -> str:
    return f"rlpatch-joined/{txid}/{rank}"


def log2ceil(n: int) -> int:
    return (int(n) - 1).bit_length() if n > 1 else 0


def relay(pg, buf: torch.Tensor, rank: int, world: int, tag: int) -> list:
    """This rank's part of one bucket under ``algo="relay"``; returns the sends still in flight (the caller waits
    for them, after posting its next receive). Rank 0 (the sender) sends ``buf`` once, to rank 1. Ranks 1..world-1
    are virtual ranks 0..world-2 of a binomial tree rooted at rank 1 (gloo's broadcast, gloo/broadcast.cc): in
    round i, a virtual rank below 2**i that holds the bucket sends it to its peer with bit i set."""
    if rank == 0:
        return [pg.send([buf], 1, tag)]
    v, vsize = rank - 1, world - 1
    if v == 0:
        pg.recv([buf], 0, tag).wait()
    dim = log2ceil(vsize)
    mask = (1 << dim) - 1
    sends = []
    for i in range(dim):
        mask ^= 1 << i
        if v & mask:
            continue
        vpeer = v ^ (1 << i)
        if vpeer >= vsize:
            continue
        if v & (1 << i):
            pg.recv([buf], vpeer + 1, tag).wait()
        else:
            sends.append(pg.send([buf], vpeer + 1, tag))
    return sends


def wait_all(works: list) -> None:
    while works:
        works.pop(0).wait()


def broadcast_opts(root: int = 0):
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    return opts


class DistSender(Sender):
    """Rank 0 of a per-update process group; broadcasts the buckets in order from a background thread."""

    kind = "dist"
    streams_bytes = True
    packs_segments = True
    needs_receivers = True
    same_host_only = False
    offered_over_http = True
    in_sessions = False

    def __init__(self, tensors: list[tuple[str, torch.Tensor]], metas: list[P.TensorMeta], bucket_bytes: int, *,
                 n_workers: int, host: str, port: int = 0, backend: str = "gloo", timeout_s: float = 120.0,
                 verify: bool = True, device: torch.device | None = None):
        import torch.distributed as dist

        self.tensors, self.metas = tensors, metas
        self.sizes = P.assign_buckets(metas, bucket_bytes)
        self.backend = backend
        self.world = n_workers + 1
        self.algo = "relay" if backend != "nccl" and self.world > 2 else "broadcast"
        self.txid = uuid.uuid4().hex
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                                 else torch.device("cpu"))
        self.seconds_fingerprint = 0.0
        if verify:
            t1 = time.perf_counter()
            for m, d in zip(metas, checks.digests([t for _, t in tensors])):
                m.fingerprint, m.nonfinite = d.key, d.nonfinite
            self.seconds_fingerprint = time.perf_counter() - t1
        self.store = dist.TCPStore(host, port, self.world, is_master=True, timeout=self.timeout,
                                   wait_for_workers=False)
        self.host, self.port = host, self.store.port
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.sent_buckets = 0
        self.seconds_send = 0.0  # the buckets, from the group formed to the last one sent
        self.seconds_group = 0.0  # forming the group: waiting for every receiver to join
        self._thread: threading.Thread | None = None
        self.on_bucket = None  # test hook: called with the bucket index before it is sent

    @classmethod
    def build(cls, job: SendJob) -> "DistSender":
        if not job.fleet and not job.target.same_host() and (not job.dist_host or is_loopback(job.dist_host)):
            raise P.RefitError(f"the engine is on another host: a dist group hosted at {job.dist_host or '127.0.0.1'} "
                               "(loopback) is out of its reach: pass dist_host= an address of this host that "
                               "the engine can reach", kind="validation")
        backend = job.dist_backend or ("nccl" if any(t.is_cuda for _, t in job.tensors) else "gloo")
        return cls(job.tensors, job.metas, job.bucket_bytes, n_workers=job.n_workers or 1,
                   host=job.dist_host or "127.0.0.1", port=job.dist_port, backend=backend, timeout_s=job.timeout_s,
                   verify=job.verify)

    def spec(self) -> dict[str, Any]:
        return {"kind": "dist", "host": self.host, "port": self.port, "world_size": self.world,
                "backend": self.backend, "timeout_s": self.timeout_s, "segments": list(self.sizes),
                "txid": self.txid, "rank_base": 1, "algo": self.algo}

    def _bucket(self, seg: int) -> torch.Tensor:
        buf = torch.empty(self.sizes[seg], dtype=torch.uint8, device=self.device)
        with torch.no_grad():
            for (name, t), m in zip(self.tensors, self.metas):
                if m.segment == seg:
                    buf[m.offset: m.offset + m.nbytes].view(t.dtype).view(t.shape).copy_(t)
        return buf

    def _run(self) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            store = dist.PrefixStore(f"rlpatch/{self.txid}", self.store)
            if self.backend == "nccl":
                pg = dist.ProcessGroupNCCL(store, 0, self.world, dist.ProcessGroupNCCL.Options())
            else:
                pg = dist.ProcessGroupGloo(store, 0, self.world, self.timeout)
            t_formed = time.perf_counter()
            self.seconds_group = t_formed - t0
            for seg in range(len(self.sizes)):
                if self.on_bucket is not None:
                    self.on_bucket(seg)
                if self.algo == "relay":
                    wait_all(relay(pg, self._bucket(seg), 0, self.world, seg))
                else:
                    pg.broadcast([self._bucket(seg)], broadcast_opts()).wait()
                self.sent_buckets += 1
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                with contextlib.suppress(Exception):
                    shutdown()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            self.error = e
        self.seconds_send = time.perf_counter() - (t0 + self.seconds_group)

    @property
    def stages(self) -> dict[str, float]:
        return {"fingerprint": self.seconds_fingerprint}

    @property
    def segments(self) -> int:
        return len(self.sizes)

    def send(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rlpatch-dist-send", daemon=True)
        self._thread.start()

    def finish(self, timeout: float) -> dict[str, float]:
        if self._thread is not None:
            self._thread.join(timeout)
        if self.running:
            return {}  # still waiting in the group (a receiver never joined): it ends on the group's timeout
        if self.error is not None:
            logger.warning("vllm-rlpatch: dist sender reported %r", self.error)
        return {"group": self.seconds_group, "send": self.seconds_send}

    def missing_ranks(self) -> list[int]:
        """The receivers' ranks that never joined this update's group (each marks itself before it joins)."""
        try:
            return [r for r in range(1, self.world) if not self.store.check([joined_key(self.txid, r)])]
        except Exception:  # noqa: BLE001 - the store is gone: nothing to say
            return []

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


class DistSource(Source):
    """Buckets received from the trainer (rank 0), bucket by bucket, into this worker's memory."""

    kind = "dist"
    collective = True

    @classmethod
    def for_rank(cls, metas, spec: dict[str, Any], worker_rank: int, device: torch.device) -> "DistSource":
        return cls(metas, spec, int(spec.get("rank_base", 1)) + worker_rank, device)

    def __init__(self, metas, spec: dict[str, Any], rank: int, device: torch.device):
        self.metas, self.spec, self.rank, self.device = metas, spec, rank, device
        self.pg = None
        self.buffers: dict[int, torch.Tensor] = {}
        self.received = 0  # buckets received so far (in order: the next one is this index)
        self.opened = False
        self.failed = False  # a receive failed: the group is broken, nothing more to take part in
        self.streaming_ok = bool(spec.get("stream", True))
        self._sends: list = []  # algo "relay": this rank's sends of the previous bucket, still in flight

    def open(self) -> None:
        import torch.distributed as dist

        s = self.spec
        self.opened = True
        timeout = datetime.timedelta(seconds=float(s.get("timeout_s", 120)))
        try:
            raw = dist.TCPStore(s["host"], int(s["port"]), int(s["world_size"]), is_master=False, timeout=timeout)
            raw.set(joined_key(s["txid"], self.rank), "1")  # the sender can name the ranks that never joined
            store = dist.PrefixStore(f"rlpatch/{s['txid']}", raw)
            if s.get("backend", "gloo") == "nccl":
                self.pg = dist.ProcessGroupNCCL(store, self.rank, int(s["world_size"]),
                                                dist.ProcessGroupNCCL.Options())
            else:
                self.pg = dist.ProcessGroupGloo(store, self.rank, int(s["world_size"]), timeout)
        except Exception as e:
            self.failed = True
            first = str(e).splitlines()[0] if str(e) else ""
            raise P.TransportError(f"dist transport: the broadcast group did not form within "
                                   f"{timeout.total_seconds():.1f} s (rank {self.rank} of {s['world_size']}; "
                                   f"{type(e).__name__}: {first}): another rank never joined (a hung engine or "
                                   "worker) or the sender died") from e

    def _receive(self, seg: int) -> torch.Tensor:
        size = int(self.spec["segments"][seg])
        dev = self.device if self.spec.get("backend") == "nccl" else torch.device("cpu")
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
        try:
            self._take(buf, seg)
        except Exception as e:
            self.failed = True
            raise P.TransportError(f"dist transport: bucket {seg + 1}/{len(self.spec['segments'])} did not arrive "
                                   f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): the sender "
                                   "died or the network failed") from e
        self.received += 1
        self.extra_host_bytes += size if dev.type == "cpu" else 0
        return buf

    def _take(self, buf: torch.Tensor, seg: int) -> None:
        """This rank's part of bucket ``seg``; with ``relay`` the sends of the previous bucket complete after this
        one's receive is posted (the next bucket arrives while this rank passes the previous one on)."""
        if self.spec.get("algo") == "relay":
            sends = relay(self.pg, buf, self.rank, int(self.spec["world_size"]), seg)
            wait_all(self._sends)
            self._sends = sends
            if seg == len(self.spec["segments"]) - 1:
                wait_all(self._sends)
        else:
            self.pg.broadcast([buf], broadcast_opts()).wait()

    def streams(self) -> bool:
        return self.streaming_ok

    def receive_all(self) -> None:
        for seg in range(len(self.spec["segments"])):
            if seg not in self.buffers:
                self.buffers[seg] = self._receive(seg)

    def drain(self) -> int:
        """Take part in the rest of the broadcast without keeping the bytes (joining the group first if this
        worker never did): the update was refused here, but the sender and every other receiver of the group
        wait for this rank in each bucket's collective. Returns the buckets drained; closes the group."""
        n = 0
        try:
            if self.failed or (self.opened and self.pg is None):
                return 0  # the group is broken, or this worker already left it
            if self.pg is None:
                self.open()
            dev = self.device if self.spec.get("backend") == "nccl" else torch.device("cpu")
            segs = [int(x) for x in self.spec["segments"]]
            # two scratch buffers: with relay, a bucket may still be on its way out while the next one arrives
            scratch = [torch.empty(max(segs[self.received:], default=0), dtype=torch.uint8, device=dev)
                       for _ in range(2 if self.spec.get("algo") == "relay" else 1)]
            for seg in range(self.received, len(segs)):
                self._take(scratch[seg % len(scratch)][: segs[seg]], seg)
                self.received += 1
                n += 1
            return n
        finally:
            self.buffers.clear()
            self.close()

    def tensors(self):
        for m in self.metas:
            if m.segment not in self.buffers:
                # streaming: buckets arrive in order; drop the ones fully consumed
                for s in [s for s in self.buffers if s < m.segment and self.streaming]:
                    del self.buffers[s]
                self.buffers[m.segment] = self._receive(m.segment)
            buf = self.buffers[m.segment][m.offset: m.offset + m.nbytes]
            yield m, buf.view(P.dtype_of(m.dtype)).view(m.shape)

    def close(self) -> None:
        self.buffers.clear()
        with contextlib.suppress(Exception):
            wait_all(self._sends)
        self._sends = []
        pg, self.pg = self.pg, None
        shutdown = (getattr(pg, "shutdown", None) or getattr(pg, "abort", None)) if pg is not None else None
        if shutdown is not None:
            with contextlib.suppress(Exception):  # a group a failed rank broke: nothing left to shut down
                shutdown()
