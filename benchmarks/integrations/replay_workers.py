"""The engine-side halves of the SkyRL and NeMo-RL replays: one vLLM ``worker_extension_cls`` holding the
receiving methods of both frameworks, rewritten call for call from their sources (neither package is
importable here: skyrl-train 0.3.1 requires Python 3.12, NeMo-RL is not on the package registry).

SkyRL (skyrl-train 0.3.1, ``skyrl_train/inference_engines/vllm/vllm_engine.py``):
  * ``WorkerWrap.init_weight_update_communicator`` (lines 74-102) builds the receiver of the chosen strategy;
    the broadcast receiver joins a process group at rank ``local rank + rank_offset``
    (``weight_sync/broadcast_strategy.py`` 273-300);
  * ``WorkerWrap.load_weights`` (lines 104-126): unpickles the request, collects every ``(name, tensor)`` the
    receiver yields, then one ``self.model_runner.model.load_weights(weights=weight_list)``;
  * broadcast receiver (``broadcast_strategy.py`` 171-189): ``torch.empty(shape, dtype, device="cuda")`` then
    ``torch.distributed.broadcast(weight, 0, group)`` per name; here the tensor is on the CPU and the group is
    gloo;
  * CUDA IPC receiver (``cuda_ipc_strategy.py`` 202-230): one packed buffer per request, opened from its IPC
    handle and sliced per parameter; here the buffer is a file in shared memory, opened by name.

NeMo-RL (main at 7ea279abf, 2026-08-22, the commit that pins vLLM 0.25.1;
``nemo_rl/models/generation/vllm/vllm_backend.py``, class ``VllmInternalWorkerExtension``):
  * ``prepare_refit_info`` (317-324) stores ``{name: (shape, dtype)}``;
  * ``update_weights_via_ipc_zmq`` (641-749): a ZMQ REP socket; per payload ``(ipc_handle, keys, used_bytes)``
    the buffer is rebuilt, sliced at 512-byte aligned offsets, ``_load_weights`` (574-594, which calls
    ``model_runner.model.load_weights(weights=...)``) loads the batch, and an ACK is sent; on ``COMPLETE``
    ``finalize()`` (``_weight_update_lifecycle``, 610-630) runs vLLM's ``process_weights_after_loading`` on the
    whole model; an exception is logged and the method returns False. Here the IPC handle is the name of a
    shared-memory file;
  * ``init_collective`` (228-251) joins a ``StatelessProcessGroup`` (NCCL) at rank ``train_world_size + ...``;
    ``update_weights_from_collective`` (751-779) runs ``packed_broadcast_consumer``
    (``nemo_rl/utils/packed_tensor.py`` 129-250: uint8 packs broadcast from rank 0, unpacked with
    ``split_with_sizes`` and passed to ``_load_weights``), then ``finalize()``. Here the group is gloo.
"""

from __future__ import annotations

import datetime
import logging
import math
import pickle

import torch
import zmq
from torch.distributed import ProcessGroupGloo, TCPStore
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading

logger = logging.getLogger(__name__)
ALIGN = 512  # nemo_rl/models/policy/utils.py calculate_aligned_size
COMPLETE = "complete"  # nemo_rl/models/policy/utils.py IPCProtocol.COMPLETE
ACK = b"ack"


def aligned(nbytes: int) -> int:
    return int(math.ceil(nbytes / ALIGN) * ALIGN)


def gloo_group(host: str, port: int, rank: int, world: int) -> ProcessGroupGloo:
    """A process group outside vLLM's own (SkyRL's ``init_custom_process_group``, NeMo-RL's stateless group)."""
    timeout = datetime.timedelta(seconds=120)
    return ProcessGroupGloo(TCPStore(host, port, world, rank == 0, timeout=timeout), rank, world, timeout)


def shm_buffer(path: str, nbytes: int) -> torch.Tensor:
    """The CPU stand-in for a CUDA IPC handle: a uint8 tensor mapped from a shared-memory file."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class ReplayWorkerExtension:
    """SkyRL's ``WorkerWrap`` and NeMo-RL's ``VllmInternalWorkerExtension`` receiving paths, on CPU."""

    # ------------------------------------------------------------------ SkyRL 0.3.1 WorkerWrap
    def init_weight_update_communicator(self, init_info: bytes) -> None:
        info = pickle.loads(init_info)
        self._sky_dtype = getattr(torch, info["dtype"])
        if info["strategy"] == "broadcast":
            rank = torch.distributed.get_rank() + info["rank_offset"]
            self._sky_group = gloo_group(info["host"], info["port"], rank, info["world_size"])

    def _sky_receive(self, req: dict):
        if req["strategy"] == "broadcast":  # SkyRL picks one strategy per run; both run on one engine here
            for name, shape in zip(req["names"], req["shapes"]):
                weight = torch.empty(shape, dtype=self._sky_dtype, device="cpu")  # SkyRL: device="cuda"
                self._sky_group.broadcast(weight, 0).wait()
                yield name, weight
            return
        packed = shm_buffer(req["path"], req["nbytes"]).view(self._sky_dtype)
        offset = 0
        for name, shape, size in zip(req["names"], req["shapes"], req["sizes"]):
            yield name, packed[offset:offset + size].view(*shape)
            offset += size

    def load_weights(self, request: bytes) -> None:
        req = pickle.loads(request)
        weight_list = [(name, tensor) for name, tensor in self._sky_receive(req)]
        self.model_runner.model.load_weights(weights=weight_list)

    # ------------------------------------------------------------------ NeMo-RL VllmInternalWorkerExtension
    def prepare_refit_info(self, state_dict_info: dict) -> None:
        self.state_dict_info = {k: (tuple(s), getattr(torch, d)) for k, (s, d) in state_dict_info.items()}

    def init_collective(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.model_update_group = gloo_group(host, port, rank, world_size)

    def _finalize(self) -> None:
        with set_current_vllm_config(self.model_runner.vllm_config):
            process_weights_after_loading(self.model_runner.model, self.model_config, self.device)

    def _nemo_load(self, weights: list) -> None:
        self.model_runner.model.load_weights(weights=weights)

    def update_weights_via_ipc_zmq(self, address: str) -> bool:
        try:
            ctx = zmq.Context.instance()
            sock = ctx.socket(zmq.REP)
            sock.setsockopt(zmq.RCVTIMEO, 120000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            errors = []  # NeMo-RL's _IPCWeightManifest: a failed batch is recorded, the stream consumed
            try:
                while True:
                    payload = sock.recv_pyobj()
                    if payload == COMPLETE:
                        try:
                            if errors:
                                raise RuntimeError(f"weight load failed: {errors[0]}")
                            self._finalize()
                        finally:
                            sock.send(ACK)
                        break
                    (path, nbytes), keys, used = payload
                    buffer = shm_buffer(path, nbytes)
                    weights, offset = [], 0
                    for key in keys:
                        shape, dtype = self.state_dict_info[key]
                        size = dtype.itemsize * math.prod(shape)
                        weights.append((key, buffer[offset:offset + size].view(dtype).view(shape)))
                        offset += aligned(size)
                    assert offset == used, "offset != used bytes"
                    try:
                        self._nemo_load(weights)
                    except Exception as e:  # noqa: BLE001
                        errors.append(f"{type(e).__name__}: {e}")
                    finally:
                        del weights, buffer
                        sock.send(ACK)
            finally:
                sock.close()
            return True
        except Exception as e:  # noqa: BLE001 - NeMo-RL logs and returns False (vllm_backend.py 740-749)
            logger.exception("update_weights_via_ipc_zmq: %s", e)
            self._nemo_error = f"{type(e).__name__}: {e}"
            return False

    def update_weights_from_collective(self, pack_bytes: int) -> bool:
        try:
            items = list(self.state_dict_info.items())
            i, error = 0, None
            while i < len(items):
                meta, total = [], 0
                while i < len(items):  # packed_broadcast_consumer: fill a pack past the target size
                    name, (shape, dtype) = items[i]
                    size = math.prod(shape) * dtype.itemsize
                    meta.append((name, shape, dtype, size))
                    total += size
                    i += 1
                    if total > pack_bytes:
                        break
                packed = torch.empty(total, dtype=torch.uint8)
                self.model_update_group.broadcast(packed, 0).wait()
                if error is None:  # after a failure the packs are still received, so the sender is not left hanging
                    parts = packed.split_with_sizes([m[3] for m in meta])
                    try:
                        self._nemo_load([(n, p.view(d).reshape(s)) for (n, s, d, _), p in zip(meta, parts)])
                    except Exception as e:  # noqa: BLE001
                        error = e
            if error is not None:
                raise error
            self._finalize()
            return True
        except Exception as e:  # noqa: BLE001 - NeMo-RL logs and returns False (vllm_backend.py 770-777)
            logger.exception("update_weights_from_collective: %s", e)
            self._nemo_error = f"{type(e).__name__}: {e}"
            return False

    def last_error(self) -> str | None:
        return getattr(self, "_nemo_error", None)

    def clear_error(self) -> None:
        self._nemo_error = None
