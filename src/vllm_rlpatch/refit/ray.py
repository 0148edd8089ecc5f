"""A Ray actor that hosts a ``vllm.LLM`` (or ``LLMEngine``) as a refit target.

``push_weights(actor_handle, ...)`` runs the coordinator inside the actor through Ray's built-in
``__ray_call__`` (the actor's class needs no method of ours): it finds the engine among the actor's
attributes (or the one named by ``engine_attr``) and drives the worker RPCs there. The bytes go through
``shm`` when the actor is on the caller's node, ``dist`` otherwise.

In a fleet (``push_weights([handle_a, handle_b, llm], ...)``, :mod:`.fleet`) each phase of the update (prepare,
commit keeping the backup, release, abort, weight_state, align_version) is one such call
(:meth:`RayTarget.phase`): the actor's coordinator drives its engine's workers, and the engine's front end (in
the actor) takes the outcome. A dead actor is an error naming it; one that does not answer within the fleet's
``timeout_s`` is declared dead.

The functions below are pickled by reference (``vllm_rlpatch.refit.ray._in_actor_*``): if vllm-rlpatch is
not importable in the actor's environment, Ray cannot even load them and the call fails; that is turned
into a :class:`RefitError` saying so, as is an engine whose workers do not run the plugin.
"""

from __future__ import annotations

from typing import Any

from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.target import EngineUnreachable, Target, is_engine, local_target


def _find_engine(actor: Any, attr: str | None) -> Any:
    if attr is not None:
        if not hasattr(actor, attr):
            raise P.RefitError(f"the actor has no attribute {attr!r}", kind="validation")
        return getattr(actor, attr)
    found = []
    for name, v in vars(actor).items():
        if is_engine(v):
            found.append((name, v))
    if len(found) != 1:
        names = ", ".join(n for n, _ in found) or "none"
        raise P.RefitError(f"cannot tell which attribute of the actor is the vLLM engine (candidates: {names}); "
                           "pass engine_attr=", kind="validation")
    return found[0][1]


def _in_actor_describe(actor: Any, attr: str | None) -> dict[str, Any]:
    import ray

    tgt = local_target(_find_engine(actor, attr))
    return {"workers": tgt.describe(), "node": ray.get_runtime_context().get_node_id()}


def _in_actor_run(actor: Any, attr: str | None, req: dict[str, Any]) -> dict[str, Any]:
    return local_target(_find_engine(actor, attr)).run(req)


def _in_actor_phase(actor: Any, attr: str | None, phase: str, args: dict[str, Any]) -> dict[str, Any]:
    """One phase of a fleet update, inside the actor: its coordinator drives its engine's workers, and the
    engine's front end (in the actor) takes the outcome (a mixed state refuses requests there)."""
    return local_target(_find_engine(actor, attr)).phase(phase, args)


def _in_actor_call(actor: Any, attr: str | None, method: str) -> list:
    return local_target(_find_engine(actor, attr)).call(method)


def _in_actor_version(actor: Any, attr: str | None) -> int:
    return local_target(_find_engine(actor, attr)).version()


class RayTarget(Target):
    kind = "ray"

    def __init__(self, handle: Any, engine_attr: str | None = None):
        self.handle = handle
        self.attr = engine_attr
        self.front = None
        self._node: str | None = None

    @property
    def label(self) -> str:
        """How a fleet names this engine: the actor's class and id."""
        try:
            aid = self.handle._actor_id.hex()[:12]
        except Exception:  # noqa: BLE001 - Ray internals; the name is only a label
            aid = "?"
        cls = getattr(getattr(self.handle, "_ray_actor_creation_function_descriptor", None), "class_name", None)
        cls = cls.rsplit(".", 1)[-1] if cls else None  # (a class defined in a function: "main.<locals>.Host")
        return f"Ray actor {cls + ' ' if cls else ''}{aid}"

    def key(self) -> Any:
        """One per actor (two handles of one actor are the same engine)."""
        try:
            return ("ray", self.handle._actor_id.hex())
        except Exception:  # noqa: BLE001
            return ("ray", id(self.handle))

    def _call(self, fn, *args, timeout_s: float | None = None):
        import ray

        try:
            return ray.get(self.handle.__ray_call__.remote(fn, self.attr, *args), timeout=timeout_s)
        except P.RefitError:
            raise
        except Exception as e:  # noqa: BLE001 - Ray wraps what happened in the actor
            text = f"{type(e).__name__}: {e}"
            if "No module named 'vllm_rlpatch'" in text or ("vllm_rlpatch" in text and "ModuleNotFoundError" in text):
                raise P.RefitError("vllm-rlpatch is not importable in the Ray actor's environment: install it there "
                                   "(pip in the image, or runtime_env={'pip': ['vllm-rlpatch']}) so the engine's "
                                   "processes load the plugin", kind="refused") from e
            cause = getattr(e, "cause", None)
            if isinstance(cause, P.RefitError):
                raise cause from e
            if "RefitError" in text:
                line = next((ln for ln in str(e).splitlines() if "RefitError" in ln), text)
                raise P.RefitError(line.split("RefitError: ", 1)[-1], kind="refused") from e
            if type(e).__name__ == "GetTimeoutError":
                raise EngineUnreachable(f"{self.label}: no answer within {timeout_s:.1f} s") from e
            if type(e).__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError"):
                first = (text.splitlines() or [text])[0]
                raise EngineUnreachable(f"{self.label} is dead or unreachable: {first}") from e
            raise P.RefitError(f"Ray actor call failed: {text.splitlines()[0]}", kind="commit") from e

    def describe(self) -> list[dict[str, Any]]:
        d = self._call(_in_actor_describe)
        self._node = d["node"]
        return d["workers"]

    def same_host(self) -> bool:
        import ray

        if self._node is None:
            self.describe()
        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:
            return False
        return here == self._node

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return self._call(_in_actor_run, req)

    def phase(self, phase: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One phase of a fleet update as one Ray call (``__ray_call__``), run by the actor's coordinator."""
        return self._call(_in_actor_phase, phase, args, timeout_s=timeout_s)

    def version(self) -> int:
        return int(self._call(_in_actor_version))

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return self._call(_in_actor_call, method)
