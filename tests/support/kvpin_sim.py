"""A simulated GPU allocator for the kv-pin sizing logic (sleep mode is CUDA-only; the GPU run in
benchmarks/gpu/kv_pin.py checks the same logic for real).

The device has ``total`` bytes and a ledger of allocations. An engine start allocates its CUDA context,
weights (pool ``weights``), non-pool runtime memory, the KV cache (pool ``kv_cache``; the pin, or without a
pin what vLLM's profiling leaves under ``util``) and, at its first generate, the activation peak (kept by
PyTorch's cache). ``sleep(1)`` unmaps both pools (weights offloaded to host), ``wake_up`` maps them again
and first needs ``wake_transient`` extra bytes (what measurement cannot see). Any allocation beyond
``total`` raises the error vLLM's cumem allocator raises.
"""

from __future__ import annotations

import itertools

GiB = 1 << 30
OOM = "CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163"


class SimOOM(RuntimeError):
    pass


class SimDevice:
    def __init__(self, total=140 * GiB, others=1 * GiB, context=int(0.5 * GiB), weights=16 * GiB,
                 runtime=3 * GiB, activations=2 * GiB, per_token=128 * 1024, wake_transient=0, util=0.9,
                 name="Sim H200"):
        self.total, self.name = total, name
        self.cfg = dict(context=context, weights=weights, runtime=runtime, activations=activations,
                        per_token=per_token, wake_transient=wake_transient, util=util)
        self.ledger: dict[int, int] = {}
        self._ids = itertools.count()
        self.starts: list[int | None] = []  # kv pin of every engine started (None: unpinned)
        self.alloc(others)

    # the device
    def alloc(self, n: int) -> int:
        if self.used() + n > self.total:
            raise SimOOM(OOM)
        h = next(self._ids)
        self.ledger[h] = int(n)
        return h

    def free(self, h: int | None) -> None:
        if h is not None:
            self.ledger.pop(h, None)

    def used(self) -> int:
        return sum(self.ledger.values())

    # the Backend protocol
    def device(self):
        return {"name": self.name, "total": self.total}

    def start(self, kv_bytes):
        self.starts.append(kv_bytes)
        return SimEngine(self, kv_bytes)

    def hold(self, nbytes):
        return self.alloc(nbytes)

    def release(self, handle):
        self.free(handle)

    def identity(self):
        return {"sim": self.name, "total": self.total, **self.cfg}


class SimEngine:
    def __init__(self, dev: SimDevice, kv_bytes):
        c = dev.cfg
        self.dev, self.c = dev, c
        self.h = {"context": dev.alloc(c["context"]), "weights": dev.alloc(c["weights"]),
                  "runtime": dev.alloc(c["runtime"])}
        if kv_bytes is None:  # vLLM's profiling: util x total minus everything else it measured
            kv_bytes = int(c["util"] * dev.total) - (dev.used() + c["activations"])
        block = 16 * c["per_token"]
        self.kv = (int(kv_bytes) // block) * block
        self.h["kv_cache"] = dev.alloc(self.kv)
        self.asleep = False
        self.alive = True

    def memory(self):
        return {"pools": {"weights": self.c["weights"], "kv_cache": self.kv}, "kv_bytes": self.kv,
                "kv_tokens": self.kv // self.c["per_token"], "kv_num_blocks": self.kv // (16 * self.c["per_token"]),
                "kv_block_size": 16}

    def generate(self, max_tokens):
        assert self.alive and not self.asleep, "generate on a dead or sleeping engine"
        if "activations" not in self.h:
            self.h["activations"] = self.dev.alloc(self.c["activations"])
        return [[7] * max_tokens for _ in range(32)], 0.5

    def sleep(self, level):
        for tag in ("weights", "kv_cache"):
            self.dev.free(self.h.pop(tag))
        self.asleep = True

    def wake_up(self):
        if not self.alive:
            raise RuntimeError("EngineDeadError")
        got = []
        try:
            t = self.dev.alloc(self.c["wake_transient"]) if self.c["wake_transient"] else None
            got.append(t)
            self.h["weights"] = self.dev.alloc(self.c["weights"])
            self.h["kv_cache"] = self.dev.alloc(self.kv)
            self.dev.free(t)
        except SimOOM:
            for h in got:
                self.dev.free(h)
            self.alive = False  # as on the GPU: the engine core does not survive it (shutdown frees the rest)
            raise
        self.asleep = False

    def shutdown(self):
        for h in list(self.h.values()):
            self.dev.free(h)
        self.h.clear()
        self.alive = False
