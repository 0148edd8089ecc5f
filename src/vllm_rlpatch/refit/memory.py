"""A worker's memory, as ``vllm-rlpatch kv-pin`` reads it (the ``rlpatch_memory`` worker RPC): device free and
total, PyTorch's allocator, the sleep-mode pools by tag and the KV cache vLLM allocated."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_rlpatch.patches.kv_cache_pin import capacity

logger = logging.getLogger("vllm.rlpatch")


def worker_memory(worker: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            out.update(device_free=int(free), device_total=int(total),
                       torch_allocated=int(torch.cuda.memory_allocated()),
                       torch_reserved=int(torch.cuda.memory_reserved()))
    except Exception as e:
        out["device_error"] = f"{type(e).__name__}: {e}"
    pools: dict[str, int] = {}
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        inst = CuMemAllocator.instance
        for data in list(getattr(inst, "pointer_to_data", {}).values()) if inst is not None else ():
            pools[data.tag] = pools.get(data.tag, 0) + int(data.handle[1])
    except Exception as e:  # noqa: BLE001 - no CUDA build / no cumem: no pools
        logger.debug("vllm-rlpatch: no sleep-mode pools to report: %s: %s", type(e).__name__, e)
    out["pools"] = pools
    kvc = getattr(getattr(worker, "model_runner", None), "kv_cache_config", None)
    if kvc is not None:
        out["kv_num_blocks"] = int(kvc.num_blocks)
        out["kv_bytes"] = int(sum(getattr(t, "size", 0) for t in getattr(kvc, "kv_cache_tensors", None) or []))
        try:
            cap = capacity(worker.vllm_config, kvc)
            out.update(kv_tokens=cap["tokens"], kv_block_size=cap["block_size"])
        except Exception as e:
            out["kv_capacity_error"] = f"{type(e).__name__}: {e}"
    return out
