# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The remote (TCP) socket of a MessageQueue writer binds before it publishes.

Before the fix, ``MessageQueue.__init__`` probed a port with ``get_open_port()``
(bind, close) and bound its XPUB socket to that port a few lines later. Another
process could take the port in between, and with ``VLLM_PORT`` set every writer
that probed before the others bound got the *same* port: all but one failed
with ``zmq.error.ZMQError: Address already in use``.

The tests force the bad interleavings deterministically by replacing the
module's ``get_open_port`` (the fixed module no longer calls it, so the
replacement then never runs). CPU only: every queue has one remote reader and
no shared-memory reader.
"""

import errno
import socket
import threading

import pytest
import zmq

from vllm.distributed.device_communicators import shm_broadcast
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.utils import network_utils

LOOPBACK_V4 = "127.0.0.1"
LOOPBACK_V6 = "::1"
TIMEOUT_S = 10


def _ipv6_loopback_available() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind((LOOPBACK_V6, 0))
        return True
    except OSError:
        return False


def _kernel_port() -> int:
    """A port nobody held a moment ago (kernel-assigned, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _port_of(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def _bound_port(mq: MessageQueue) -> int:
    endpoint = mq.remote_socket.getsockopt(zmq.LAST_ENDPOINT).decode()
    return _port_of(endpoint)


def _assert_port_held(port: int) -> None:
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as contender,
        pytest.raises(OSError) as exc_info,
    ):
        contender.bind(("", port))
    assert exc_info.value.errno == errno.EADDRINUSE


@pytest.fixture(autouse=True)
def _destroy_zmq_contexts(monkeypatch):
    """Destroy every zmq context the queues under test create.

    A writer whose bind fails (the bug) raises from ``__init__`` with its
    socket still open; when its context is garbage collected, ``zmq_ctx_term``
    would wait for that socket forever and hang the test process instead of
    reporting the failure.
    """
    made: list[zmq.Context] = []

    class TrackingContext(shm_broadcast.Context):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(shm_broadcast, "Context", TrackingContext)
    yield
    for ctx in made:
        ctx.destroy(linger=0)


def _close(*mqs: MessageQueue) -> None:
    for mq in mqs:
        if mq.remote_socket is not None:
            mq.remote_socket.close(linger=0)


def _writer(connect_ip: str = LOOPBACK_V4) -> MessageQueue:
    return MessageQueue(n_reader=1, n_local_reader=0, connect_ip=connect_ip)


def test_port_stolen_after_probe(monkeypatch):
    """Another process binds the probed port before the writer binds it."""
    monkeypatch.delenv("VLLM_PORT", raising=False)
    thieves: list[socket.socket] = []

    def probe_then_steal() -> int:
        port = network_utils.get_open_port()
        thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        thief.bind(("", port))
        thief.listen()
        thieves.append(thief)
        return port

    # raising=False: the fixed module does not import get_open_port at all.
    monkeypatch.setattr(shm_broadcast, "get_open_port", probe_then_steal, raising=False)
    mq = None
    try:
        mq = _writer()
        port = _port_of(mq.handle.remote_subscribe_addr)
        assert port == _bound_port(mq)
        assert port not in {t.getsockname()[1] for t in thieves}
        _assert_port_held(port)
    finally:
        for thief in thieves:
            thief.close()
        if mq is not None:
            _close(mq)


def test_concurrent_writers_share_vllm_port(monkeypatch):
    """Writers with one VLLM_PORT all probe before any of them binds."""
    n_writers = 4
    base = _kernel_port()
    monkeypatch.setenv("VLLM_PORT", str(base))
    monkeypatch.delenv("VLLM_DP_MASTER_PORT", raising=False)
    all_probed = threading.Barrier(n_writers, timeout=TIMEOUT_S)

    def probe_and_wait() -> int:
        port = network_utils.get_open_port()
        all_probed.wait()  # every writer has probed; none has bound yet
        return port

    monkeypatch.setattr(shm_broadcast, "get_open_port", probe_and_wait, raising=False)

    writers: list[MessageQueue] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def create() -> None:
        try:
            mq = _writer()
        except BaseException as e:  # noqa: BLE001 - reported below
            with lock:
                errors.append(e)
        else:
            with lock:
                writers.append(mq)

    threads = [threading.Thread(target=create) for _ in range(n_writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=2 * TIMEOUT_S)
    try:
        assert not errors, f"{len(errors)}/{n_writers} writers failed: {errors!r}"
        assert len(writers) == n_writers
        ports = [_port_of(mq.handle.remote_subscribe_addr) for mq in writers]
        assert len(set(ports)) == n_writers, ports
        for mq, port in zip(writers, ports):
            assert port == _bound_port(mq)
            # VLLM_PORT is still the start of the range the socket binds in.
            assert base <= port < base + 1000
            _assert_port_held(port)
    finally:
        _close(*writers)


def test_vllm_port_in_use_is_skipped(monkeypatch):
    """With VLLM_PORT held by someone else, the writer binds a later port."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("", 0))
    holder.listen()
    base = holder.getsockname()[1]
    monkeypatch.setenv("VLLM_PORT", str(base))
    monkeypatch.delenv("VLLM_DP_MASTER_PORT", raising=False)
    mq = None
    try:
        mq = _writer()
        port = _port_of(mq.handle.remote_subscribe_addr)
        assert port == _bound_port(mq)
        assert base < port < base + 1000
    finally:
        holder.close()
        if mq is not None:
            _close(mq)


@pytest.mark.parametrize("use_vllm_port", [False, True], ids=["ephemeral", "VLLM_PORT"])
@pytest.mark.parametrize("host", [LOOPBACK_V4, LOOPBACK_V6], ids=["ipv4", "ipv6"])
def test_remote_reader_receives_from_published_address(
    monkeypatch, host, use_vllm_port
):
    """The published address is the bound one: a remote reader gets messages."""
    if host == LOOPBACK_V6 and not _ipv6_loopback_available():
        pytest.skip("IPv6 loopback is not available")
    if use_vllm_port:
        monkeypatch.setenv("VLLM_PORT", str(_kernel_port()))
        monkeypatch.delenv("VLLM_DP_MASTER_PORT", raising=False)
    else:
        monkeypatch.delenv("VLLM_PORT", raising=False)

    writer = _writer(connect_ip=host)
    reader = None
    try:
        handle = writer.export_handle()
        assert handle.remote_addr_ipv6 == (host == LOOPBACK_V6)
        assert _port_of(handle.remote_subscribe_addr) == _bound_port(writer)
        reader = MessageQueue.create_from_handle(handle, rank=1)
        for mq in (writer, reader):
            mq.remote_socket.setsockopt(zmq.RCVTIMEO, TIMEOUT_S * 1000)

        ready_errors: list[BaseException] = []

        def writer_ready() -> None:
            try:
                writer.wait_until_ready()
            except BaseException as e:  # noqa: BLE001 - reported below
                ready_errors.append(e)

        t = threading.Thread(target=writer_ready)
        t.start()
        reader.wait_until_ready()
        t.join(timeout=TIMEOUT_S)
        assert not t.is_alive() and not ready_errors, ready_errors

        payload = {"step": 1, "tokens": list(range(16))}
        writer.enqueue(payload)
        assert reader.dequeue(timeout=TIMEOUT_S) == payload
    finally:
        _close(writer, *([reader] if reader is not None else []))
