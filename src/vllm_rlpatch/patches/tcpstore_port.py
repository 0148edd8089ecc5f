"""TCPStore ports that are free where they are bound and disjoint from this host's other picks.

Why:   vLLM 0.20-0.28 choose the torch.distributed TCPStore port by probing (bind, close) and let the rank-0
       worker bind it later:
       - ``RayExecutorV2._select_tcpstore_port`` (0.25-0.28): with data parallelism off,
         ``ParallelConfig`` falls back to ``local_dp_rank=0`` and ``master_port=0``, so the "disjoint DP
         window" starts at port 100; as root every non-DP engine on a host probes port 100 successfully and
         picks it, and all but the first fail to bind their store (EADDRINUSE). Reproduced here: 32
         concurrent selections as root all returned 100 and 31 stores failed to bind.
       - 0.20's RayExecutorV2 and the mp/uniproc executors (0.20-0.27) call ``get_open_port()``: with
         ``VLLM_PORT`` set concurrent engines get the same port, and the MessageQueue created next in the
         same process (RayExecutorV2 step 4) can take the port the store was promised.
How:   the port is picked by :func:`vllm_rlpatch.hooks.ports.pick_port`: really free now (a bind probe) and
       *leased* host-wide (an exclusive flock, ``VLLM_RLPATCH_PORT_LEASE_S``, default 120 s) so no other
       vllm-rlpatch process - another engine's selection, this engine's MessageQueue band
       (``mq_bind_retry`` skips leased ports) - takes it before the store binds. DP off (``master_port``
       0) means no window: a leased port from ``VLLM_PORT`` upwards, or an ephemeral one. DP on keeps
       upstream's per-rank window (``master_port + 100 + 32 * local_dp_rank``), leased, falling back to the
       band. Wraps ``RayExecutorV2._select_tcpstore_port`` (0.25+) and the ``get_open_port`` that
       ``ray_executor_v2`` (0.20), ``uniproc_executor`` and ``multiproc_executor`` call for their init
       method. Limits: the probe runs where vLLM runs it (the driver); a store that binds on another node
       (bundle 0 elsewhere) is only as safe as a probe on that node would be, and vLLM 0.20-0.28 give no
       way to hand a held socket to the store in another process.
Targets: vllm.v1.executor.ray_executor_v2.{RayExecutorV2._select_tcpstore_port (0.25+), get_open_port (0.20)},
       vllm.v1.executor.uniproc_executor.get_open_port, vllm.v1.executor.multiproc_executor.get_open_port.
Upstream: vllm#53666 (local_dp_rank None for non-DP), vllm#50969 (bind the store before publishing its port:
       rank-0 actor TCPStore(port=0), 0.29.0), vllm#45960 (DP-rank windows); mp/uniproc use a file store
       from 0.28.0. NeMo-RL RL-1104 / PR #3350.
Remove when: the oldest supported vLLM is 0.29.
"""

from __future__ import annotations

import importlib.util
import logging
import os

from vllm_rlpatch import _wrapping
from vllm_rlpatch.hooks import ports
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "tcpstore_port"
RAY_V2 = "vllm.v1.executor.ray_executor_v2"
UNIPROC = "vllm.v1.executor.uniproc_executor"
MULTIPROC = "vllm.v1.executor.multiproc_executor"
SELECT = f"{RAY_V2}:RayExecutorV2._select_tcpstore_port"
GOP = {m: f"{m}:get_open_port" for m in (RAY_V2, UNIPROC, MULTIPROC)}
TARGETS = (SELECT, *GOP.values())
WINDOW = 32


def _dp_reserved() -> range:
    raw = os.environ.get("VLLM_DP_MASTER_PORT")
    if raw and raw.strip().isdigit():
        return range(int(raw), int(raw) + 10)
    return range(0)


def pick_store_port() -> int:
    """A leased port for a TCPStore: from VLLM_PORT upwards when it is set, else ephemeral; never one of
    the ports vLLM reserves for the DP master."""
    reserved = _dp_reserved()
    for _ in range(16):
        p = ports.pick_port(ports.vllm_port(), what="torch.distributed TCPStore")
        if p not in reserved:
            return p
    raise ports.PortRangeExhausted("vllm-rlpatch: every free port picked for the TCPStore was in the DP master's "
                                   f"reserved range {reserved.start}-{reserved.stop - 1}")


def _select_wrapper(wrapped, instance, args, kwargs):
    names = ("local_dp_rank", "master_port")
    vals = dict(zip(names, args))
    vals.update({k: v for k, v in kwargs.items() if k in names})
    rank, master = vals.get("local_dp_rank"), vals.get("master_port")
    if rank is None or not master:  # DP off: ParallelConfig's fallbacks give rank 0 / master port 0
        port = pick_store_port()
    else:
        try:
            port = ports.pick_port(master + 100 + rank * WINDOW, WINDOW, what=f"TCPStore of DP rank {rank}")
        except ports.PortRangeExhausted:
            port = pick_store_port()
    logger.debug("vllm-rlpatch: TCPStore port %d (local_dp_rank=%r, master_port=%r), leased", port, rank, master)
    return port


def _get_open_port_wrapper(wrapped, instance, args, kwargs):
    return pick_store_port()


def _targets_for(module_name: str):
    """The Ray v2 executor selects its port in ``_select_tcpstore_port`` where it has one (else through its
    ``get_open_port``); the others call ``get_open_port``."""
    def targets() -> dict:
        if module_name == RAY_V2 and _wrapping.target_exists(SELECT):
            return {SELECT: _select_wrapper}
        return {GOP[module_name]: _get_open_port_wrapper} if _wrapping.target_exists(GOP[module_name]) else {}

    return targets


_LATE = [_wrapping.LateWraps(m, _targets_for(m), NAME) for m in (RAY_V2, UNIPROC, MULTIPROC)]


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return ""
    with open(spec.origin, encoding="utf-8") as fh:
        return fh.read()


def probe() -> bool:
    """Present where the Ray v2 executor selects by probe, or mp/uniproc build a tcp:// init method from a
    probed port by default (source read, no import: ray_executor_v2 needs ray to import)."""
    ray_src = _source(RAY_V2)
    if "_select_tcpstore_port" in ray_src or "get_distributed_init_method(dist_ip, get_open_port())" in ray_src:
        return True
    return "get_file_store_init_method" not in _source(UNIPROC)


def apply() -> None:
    for late in _LATE:
        late.apply()


def revert() -> None:
    for late in _LATE:
        late.revert()  # each unwraps exactly the targets it chose and wrapped


SPEC = PatchSpec(
    name=NAME,
    summary="TCPStore ports really free and leased host-wide (no port-100 pick for non-DP engines, no clash "
            "with this engine's MessageQueue)",
    vllm=">=0.20,<0.29",
    fixed_in="0.29.0",
    targets=(),
    # ray_executor_v2 cannot even be imported without ray (its annotations name ray types): its two targets
    # (one per vLLM line) are looked up when vLLM imports it, not declared here.
    lazy_targets=(GOP[UNIPROC], GOP[MULTIPROC]),
    probe=probe,
    apply=apply,
    revert=revert,
    upstream="vllm#53666, vllm#50969 (0.29.0), vllm#45960; NeMo-RL RL-1104 / PR #3350",
    remove_when="oldest supported vLLM >= 0.29",
)
