"""Host-wide port leases: pick a TCP port that is free now *and* that no other vllm-rlpatch process on this
host will hand out until the socket that needs it binds.

vLLM 0.20-0.28 pick ports by probing (bind, close) and bind them later; in between, any other process can
take the port, and with ``VLLM_PORT`` set every concurrent prober gets the *same* one. A lease closes that
window between processes that use this module: it is an exclusive ``flock`` on
``<lease dir>/<port>.lock``, held (by a daemon timer in the leasing process) for ``VLLM_RLPATCH_PORT_LEASE_S``
seconds or until that process exits, whichever comes first. Ports bound by someone (a MessageQueue's
socket, a TCPStore) are skipped by the bind probe; ports leased by someone are skipped by the lease.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading

from vllm_rlpatch import envs

logger = logging.getLogger("vllm.rlpatch")

DEFAULT_LEASE_S = 120.0
DEFAULT_BAND = 512

_LOCK = threading.Lock()
_HELD: dict[int, int] = {}  # port -> fd of the lease this process holds


class PortRangeExhausted(RuntimeError):
    """No port of the band is free (bound or leased by another process)."""


def lease_dir() -> str:
    d = envs.PORT_LEASE_DIR.get() or os.path.join("/tmp", f"vllm-rlpatch-ports-{os.getuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return d


def lease_seconds() -> float:
    return envs.PORT_LEASE_S.get()


def band_size() -> int:
    return envs.PORT_BAND.get()


def _path(port: int) -> str:
    return os.path.join(lease_dir(), f"{port}.lock")


def is_leased(port: int) -> bool:
    """Leased by a live process (this one included)?"""
    with _LOCK:
        if port in _HELD:
            return True
    try:
        fd = os.open(_path(port), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def lease(port: int, seconds: float | None = None) -> bool:
    """Take the lease on ``port`` (False if another holder has it)."""
    seconds = lease_seconds() if seconds is None else seconds
    fd = os.open(_path(port), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    with _LOCK:
        old = _HELD.pop(port, None)
        _HELD[port] = fd
    if old is not None:
        os.close(old)
    t = threading.Timer(seconds, release, args=(port, fd))
    t.daemon = True
    t.start()
    return True


def release(port: int, fd: int | None = None) -> None:
    with _LOCK:
        held = _HELD.get(port)
        if held is None or (fd is not None and held != fd):
            return
        del _HELD[port]
    try:
        os.close(held)
    except OSError:
        pass


def _bind_probe(port: int, host: str = "") -> int | None:
    """Bind ``port`` (0 = ephemeral) on all interfaces; return the bound port or None if in use."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return None
            raise
        return s.getsockname()[1]


@contextlib.contextmanager
def claim(port: int):
    """Hold ``port``'s lease lock for the duration of a check-and-bind (yields False if someone holds it).

    A socket that binds a port in a band (``mq_bind_retry``) binds under this lock, and :func:`pick_port`
    probes under the lease: the two never both decide the same port is theirs."""
    with _LOCK:
        if port in _HELD:
            yield False
            return
    fd = os.open(_path(port), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # drops the lock


def pick_port(start: int | None = None, size: int | None = None, *, seconds: float | None = None,
              what: str = "port") -> int:
    """A port that is free now and leased to this process.

    ``start`` given (``VLLM_PORT``, a DP window): the lowest such port in ``[start, start + size)``; else an
    ephemeral port. The lease is taken *before* the bind probe, so a band binder holding :func:`claim` and
    this probe exclude each other. Raises :class:`PortRangeExhausted` naming the band when none is left."""
    if start is None:
        for _ in range(64):
            p = _bind_probe(0)
            if p is None or not lease(p, seconds):
                continue
            if _bind_probe(p) is not None:  # still free now that it is leased
                return p
            release(p)
        raise PortRangeExhausted(f"vllm-rlpatch: no ephemeral port could be leased for the {what} (64 tries)")
    size = band_size() if size is None else size
    for p in range(start, min(start + size, 65536)):
        with _LOCK:
            if p in _HELD:
                continue
        if not lease(p, seconds):
            continue
        if _bind_probe(p) is not None:
            return p
        release(p)
    raise PortRangeExhausted(
        f"vllm-rlpatch: no free port for the {what} in {start}-{min(start + size, 65536) - 1} "
        f"({size} ports, all bound or leased); widen it with VLLM_RLPATCH_PORT_BAND or move VLLM_PORT")


def vllm_port() -> int | None:
    raw = os.environ.get("VLLM_PORT")
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:  # vLLM itself rejects it with its own message
        return None

