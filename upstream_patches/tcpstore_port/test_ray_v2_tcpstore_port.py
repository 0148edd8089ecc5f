# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""RayExecutorV2: the rank-0 worker binds the world group's TCPStore before
its address is published.

Before the fix the driver chose the port (``_select_tcpstore_port``) and the
rank-0 worker bound it much later, in ``init_process_group``. Without data
parallelism ``ParallelConfig`` falls back to ``data_parallel_rank_local=0``
and ``data_parallel_master_port=0``, so every engine searched from port 100:
as root, every co-located engine picked port 100 and all but one failed with
``EADDRINUSE``; otherwise any process could take the probed port before the
store bound it.

CPU only, no Ray cluster: the rank-0 worker is used detached from Ray.
"""

import errno
import socket
import threading
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

ray = pytest.importorskip("ray")

import torch.distributed as dist  # noqa: E402

from vllm.config import ParallelConfig  # noqa: E402
from vllm.v1.executor import ray_executor_v2  # noqa: E402
from vllm.v1.executor.ray_executor_v2 import RayWorkerProc  # noqa: E402

LOOPBACK = "127.0.0.1"
TIMEOUT_S = 30


@pytest.fixture(autouse=True)
def _loopback_node_ip(monkeypatch):
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: LOOPBACK)


def _detached_rank0_worker(parallel_config=None) -> RayWorkerProc:
    """A rank-0 RayWorkerProc whose dist-init store can be made without Ray."""
    worker = RayWorkerProc.__new__(RayWorkerProc)
    worker._parallel_config = parallel_config or SimpleNamespace(world_size=1)
    return worker


def _assert_port_held(port: int) -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as contender,
        pytest.raises(OSError) as exc_info,
    ):
        contender.bind(("", port))
    assert exc_info.value.errno == errno.EADDRINUSE


def test_published_port_is_held_until_init_process_group():
    """Nobody can take the port between its publication and the world
    group's rendezvous, and the rendezvous reuses the held store."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    worker = _detached_rank0_worker()

    init_method = worker.create_dist_init_method()
    port = urlsplit(init_method).port
    assert port is not None and port == worker._dist_init_store.port
    # Another process tries to take the published port before rank 0 calls
    # init_process_group (the window in which it used to be free).
    _assert_port_held(port)

    # The rendezvous can only succeed by reusing the server bound above: a
    # second bind of that port fails, as the contender just did.
    dist.init_process_group(
        backend="gloo", init_method=init_method, world_size=1, rank=0
    )
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_colocated_non_dp_engines_publish_distinct_ports(monkeypatch):
    """Engines without data parallelism that start together on one host.

    Their ParallelConfig has the non-DP fallbacks (local DP rank 0, master
    port 0) that made every one of them pick port 100 before the fix.
    """
    for var in ("VLLM_DP_SIZE", "VLLM_DP_RANK", "VLLM_DP_RANK_LOCAL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("VLLM_DP_MASTER_PORT", raising=False)
    n_engines = 8
    configs = [ParallelConfig() for _ in range(n_engines)]
    assert configs[0].data_parallel_size == 1
    assert configs[0].data_parallel_rank_local == 0
    assert configs[0].data_parallel_master_port == 0

    workers = [_detached_rank0_worker(cfg) for cfg in configs]
    init_methods: list[str | None] = [None] * n_engines
    errors: list[BaseException] = []
    start = threading.Barrier(n_engines, timeout=TIMEOUT_S)

    def cold_start(i: int) -> None:
        try:
            start.wait()  # all engines reach this step at one instant
            init_methods[i] = workers[i].create_dist_init_method()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=cold_start, args=(i,)) for i in range(n_engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT_S)
    assert not errors, errors

    ports = [urlsplit(m).port for m in init_methods if m is not None]
    assert len(ports) == n_engines
    assert len(set(ports)) == n_engines, ports
    for worker, port in zip(workers, ports):
        assert port == worker._dist_init_store.port
        assert port >= 1024  # never the privileged port 100
        _assert_port_held(port)


def test_initialize_worker_uses_the_published_init_method(monkeypatch):
    """Every rank gets the address rank 0 published, at initialize time."""
    captured: dict = {}

    def fake_worker_proc_init(self, **kwargs):
        captured.update(kwargs)

    monkeypatch.setattr(ray_executor_v2.WorkerProc, "__init__", fake_worker_proc_init)
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size=2))
    worker = RayWorkerProc(
        vllm_config=vllm_config,
        rank=1,
        input_shm_handle=None,
        is_driver_worker=False,
    )
    init_method = f"tcp://{LOOPBACK}:45678"
    worker.initialize_worker(1, {}, init_method)

    assert captured["distributed_init_method"] == init_method
    assert captured["rank"] == 1
    assert captured["local_rank"] == 1
