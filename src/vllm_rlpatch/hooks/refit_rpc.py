"""The refit API's RPCs as the engine core sees them: their names, their answers, and the session gate.

:mod:`vllm_rlpatch.refit` drives a weight update through three worker RPCs (prepare receives and checks,
commit writes, abort drops a prepared update) and one release after it. Passing the engine core, they need:

* **answers packed** (:func:`pack_answers` / :func:`unpack_answers`): one pickled blob per rank when vLLM's
  insecure serialization is on, read back wherever the refit API calls these RPCs;
* **answers read** (:func:`commit_answers`): a commit every rank answered says the new version itself, so
  the engine core need not ask the workers again;
* **the session gate** (:func:`session_gate` / :func:`session_after`): a multi-call update writes over
  several RPCs, with no request computing in between;
* **the engine core's clock** on a commit's answers (:func:`stamp_commit`), which the front end splits its
  round trip with.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

REFIT_PREPARE = "rlpatch_refit_prepare"
REFIT_COMMIT = "rlpatch_refit_commit"
REFIT_ABORT = "rlpatch_refit_abort"
REFIT_RELEASE = "rlpatch_refit_release"
REFIT_RPCS = frozenset({REFIT_PREPARE, REFIT_COMMIT, REFIT_ABORT})
# the update's last RPCs: they rest the workers' RPC readers when no request is scheduled
LAST_RPCS = frozenset({REFIT_COMMIT, REFIT_RELEASE})

PACKED = "rlpatch_packed"


def insecure_serialization() -> bool:
    """Does vLLM's serializer tag every leaf of a utility result with its type in this process? Asked of
    vLLM's own ``envs`` (0.20 to 0.32 parse the variable alike), so packing follows the serializer, including
    its environment cache once the engine core started."""
    from vllm import envs as vllm_envs  # only an engine core packs: vLLM is loaded there, not in a trainer

    return bool(vllm_envs.VLLM_ALLOW_INSECURE_SERIALIZATION)


def pack_answers(result: list) -> list:
    """The workers' answers to an update RPC, each as one pickled blob, when vLLM's insecure serialization is
    on: vLLM then tags every leaf of a utility result with its type and the client converts each one (an
    answer has ~60 leaves: ~0.4 ms per update on an H100 host, measured by benchmarks/gpu/refit_full_gpu.py's
    probes). Without it vLLM sends plain msgpack, which is fast, and nothing is packed. Read back with
    :func:`unpack_answers` (the refit API does, wherever it calls these RPCs)."""
    if not insecure_serialization():
        return result
    return [{PACKED: pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)} for r in result]


def unpack_answers(result: Any) -> Any:
    """:func:`pack_answers` undone (anything else is returned as it is). A packed answer that is not bytes-like
    raises: passed on, it would read as a failed update while the engine committed it."""
    if not isinstance(result, list):
        return result
    out = []
    for r in result:
        if isinstance(r, dict) and len(r) == 1 and PACKED in r:
            blob = r[PACKED]
            if not isinstance(blob, (bytes, bytearray, memoryview)):
                raise TypeError(f"vllm-rlpatch: a packed refit answer arrived as {type(blob).__name__}, not bytes")
            r = pickle.loads(blob)
        out.append(r)
    return out


def commit_answers(method: str, result: Any) -> tuple[int, bool] | None:
    """(version, final) when ``result`` is a refit commit every rank answered ``ok``: ``committed`` with its
    version (final), or a session's part ``writing`` (the version unchanged: 0). None: ask the workers."""
    if method != REFIT_COMMIT or not isinstance(result, list) or not result:
        return None
    if not all(isinstance(r, dict) and r.get("ok") for r in result):
        return None
    states = {r.get("state") for r in result}
    if states == {"writing"}:
        return 0, False
    versions = [r.get("version") for r in result]
    if states == {"committed"} and all(isinstance(v, int) for v in versions):
        return max(versions), True
    return None


class GatedCore(Protocol):
    """What the session gate needs of an engine core's guard (:class:`vllm_rlpatch.hooks.update_events.Guard`)."""

    session: str | None  # txid of the multi-call update in progress
    inflight_override: str | None

    def running(self) -> list[Any]: ...

    def abort_running(self, reason: str) -> list[str]: ...


def session_gate(g: GatedCore, method: str, rargs: tuple, rkw: dict) -> None:
    """A multi-call update (refit session) writes in several RPCs: no request may compute in between. Its
    first part needs an idle engine (running requests are aborted with ``inflight="abort"``, else the part is
    refused); new requests are refused until the session commits or aborts."""
    if method != REFIT_PREPARE or not rargs or not isinstance(rargs[0], dict) or not rargs[0].get("session"):
        return
    txid = rargs[0].get("txid")
    if g.session == txid:
        return
    running = g.running()
    if running:
        if g.inflight_override == "abort":
            g.abort_running("a multi-call weight update started (inflight=abort)")
        else:
            raise RuntimeError(f"vllm-rlpatch: multi-call weight update refused: {len(running)} request(s) are running; "
                               "a session changes the weights over several calls, so it needs an idle engine (wait "
                               "for them, or pass inflight='abort' to finish them)")
    g.session = txid


def session_after(g: GatedCore, method: str, rargs: tuple, rkw: dict, result: list) -> None:
    """The session ends with its abort, its final commit, or a commit a rank failed."""
    if g.session is None or not rargs or rargs[0] != g.session:
        return
    done = (method == REFIT_ABORT) or (method == REFIT_COMMIT and rkw.get("final", True))
    failed = any(isinstance(r, dict) and not r.get("ok") for r in result)
    if done or (method == REFIT_COMMIT and failed):
        g.session = None


def stamp_commit(result: list, info: dict[str, Any]) -> None:
    """Add the engine core's view of a commit (``info``: its update record, version and clock) to each rank's
    answer, under ``engine_core`` (the front end on the same host splits its round trip with the clock:
    coordinator.rpc_split)."""
    for r in result:
        if isinstance(r, dict):
            r["engine_core"] = info
