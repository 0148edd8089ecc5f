"""The "mixed weights" state: a model that holds some layers of the old weights and some of the new, after an
update failed part-way with nothing to roll back to. Such an engine must refuse to generate until a complete
update lands.

One type, :class:`MixedWeights`, kept where it is known:

* in each worker process (:func:`set_worker` / :func:`worker_state` / :func:`clear_worker`): the layerwise
  reload hook and the refit transaction set it, a complete update clears it;
* per engine front end (:func:`poison` / :func:`poisoned` / :func:`clear`): what the front end refuses
  requests with. The engine core keeps its own copy on its guard.

Across processes it travels as data (``MixedWeights.as_dict()`` in the ``rlpatch_weight_state`` RPC and in
the refit RPCs' results), never as a substring of an exception's text: after an update RPC fails, the engine
core and the front end ask the workers for their state. The human-readable :data:`MARK` still starts every
message, for people reading logs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

logger = logging.getLogger("vllm.rlpatch")

MARK = "[vllm-rlpatch:mixed-weights]"
# The worker RPC that reports a worker's weight version and mixed state as data (worker_ext implements it).
STATE_RPC = "rlpatch_weight_state"


@dataclasses.dataclass(frozen=True)
class MixedWeights:
    """Why the weights are a mix, and which layers kept their old weights (if known)."""

    reason: str
    layers: tuple[str, ...] = ()
    source: str = ""  # what left it: "reload_weights", "refit", "model.load_weights", ...

    @property
    def message(self) -> str:
        text = self.reason if self.reason.startswith(MARK) else f"{MARK} {self.reason}"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "layers": list(self.layers), "source": self.source}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "MixedWeights | None":
        if not d:
            return None
        return cls(str(d.get("reason", "")), tuple(d.get("layers") or ()), str(d.get("source", "")))


class MixedWeightsError(RuntimeError):
    """Raised where code must not go on with mixed weights (the worker's forward pass, a version query)."""

    def __init__(self, mixed: MixedWeights):
        super().__init__(mixed.message)
        self.mixed = mixed


# ------------------------------------------------------------------------------------------ worker process
_LOCK = threading.Lock()
_worker: MixedWeights | None = None


def set_worker(m: MixedWeights) -> None:
    global _worker
    with _LOCK:
        _worker = m


def clear_worker() -> None:
    global _worker
    with _LOCK:
        _worker = None


def worker_state() -> MixedWeights | None:
    return _worker


def from_results(results: Any) -> MixedWeights | None:
    """The first mixed state in a list of per-worker results (``rlpatch_weight_state`` or refit RPC dicts)."""
    for r in results if isinstance(results, list) else ():
        if not isinstance(r, dict):
            continue
        m = MixedWeights.from_dict(r.get("mixed"))
        if m is not None:
            return m
        if r.get("state") == "mixed":
            return MixedWeights(str(r.get("message") or "a weight update failed part-way"), (), "refit")
    return None


# ------------------------------------------------------------------------------------------ front end
_FRONT: "weakref.WeakKeyDictionary[Any, MixedWeights]" = weakref.WeakKeyDictionary()


def poison(front: Any, m: MixedWeights) -> None:
    try:
        first = front not in _FRONT
        _FRONT[front] = m
    except TypeError:
        return
    if first:
        if m.source == "session":
            logger.info("vllm-rlpatch: requests are refused while %s", m.reason)
        else:
            logger.error("vllm-rlpatch: this engine refuses to generate until a good weight update lands: %s",
                         m.message)


def clear(front: Any) -> None:
    try:
        _FRONT.pop(front, None)
    except TypeError:
        pass


def poisoned(front: Any) -> MixedWeights | None:
    try:
        return _FRONT.get(front)
    except TypeError:
        return None
