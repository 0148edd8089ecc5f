"""Refit targets: what ``push_weights`` can update, behind one interface.

:class:`Target` is public: ``kind``, ``front`` (the engine object whose requests a mixed-weights state
refuses, or None in another process), ``same_host()``, ``describe()`` (the workers' schemas), ``run(req)`` (the
coordinator of one update, where the engine lives), ``phase(name, args)`` (one phase of a fleet update, where
the engine lives), ``call(method)`` and ``version()``. :func:`resolve`
turns what a user passes (a ``vllm.LLM``, an ``AsyncLLM``, a Ray actor handle, ``"http://host:port"``) into
one; :class:`HttpTarget` (:mod:`.http`) and :class:`RayTarget` (:mod:`.ray`) live with their transports.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any

from vllm_rlpatch.hooks import engine_core
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.coordinator import (coordinate_on, coordinate_on_async, coordinate_phase, rpc_error_to_refit,
                                            run_async, run_sync)


def is_loopback(host: str | None) -> bool:
    """A loopback address (or ``localhost``): out of reach of another host. None or empty: False."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


class EngineUnreachable(P.RefitError):
    """The engine cannot answer: a dead Ray actor, a server that cannot be reached or did not answer in time
    (a fleet declares it dead)."""

    def __init__(self, message: str):
        super().__init__(message, kind="transport")


class Target:
    """One engine a refit can update. Subclasses implement the RPCs; the coordinator is the same for all."""

    kind = "?"
    front: Any = None

    def same_host(self) -> bool:
        return True

    def describe(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        raise NotImplementedError

    def version(self) -> int:
        raise NotImplementedError

    def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        """A worker RPC that returns one result per worker (sessions drive the workers through it)."""
        raise P.RefitError(f"a {self.kind} target does not take raw worker RPCs in this process", kind="validation")

    def phase(self, phase: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One phase of a fleet update (:func:`~.coordinator.coordinate_phase`) where the engine lives: here,
        through :meth:`rpc`; a Ray actor or ``vllm serve`` run it there (one call each). ``timeout_s``: how long
        a remote call may take (an in-process one is bounded by the fleet's thread wait)."""
        return run_sync(coordinate_phase(self.front, phase, args), self.rpc)


class LocalTarget(Target):
    """A ``vllm.LLM``/``LLMEngine`` in this process (synchronous RPCs)."""

    kind = "llm"

    def __init__(self, obj: Any):
        self.obj = obj
        self.front = getattr(obj, "llm_engine", obj)

    def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        return engine_core.unpack_answers(self.front.collective_rpc(method, args=args, kwargs=kwargs))

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return self.rpc(method, args, kwargs)

    def describe(self) -> list[dict[str, Any]]:
        try:
            return self.rpc("rlpatch_refit_describe", (), {})
        except Exception as e:  # noqa: BLE001
            raise rpc_error_to_refit(e, "describe") from e

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return coordinate_on(self.front, req, lambda g: run_sync(g, self.rpc))

    def version(self) -> int:
        return max(int(v) for v in self.rpc("rlpatch_weight_version", (), {}))


class AsyncTarget(Target):
    """A ``vllm.v1.engine.async_llm.AsyncLLM``: RPCs are coroutines on its event loop."""

    kind = "async_llm"

    def __init__(self, obj: Any):
        self.obj = self.front = obj

    async def rpc_async(self, method: str, args: tuple, kwargs: dict) -> list:
        return engine_core.unpack_answers(await self.obj.collective_rpc(method, args=args, kwargs=kwargs))

    def _loop(self) -> asyncio.AbstractEventLoop:
        for attr in ("output_handler", "_output_handler"):
            task = getattr(self.obj, attr, None)
            if task is not None and hasattr(task, "get_loop"):
                return task.get_loop()
        loop = getattr(self.obj, "_rlpatch_loop", None)
        if loop is not None:
            return loop
        raise P.RefitError("push_weights(AsyncLLM) from synchronous code needs the engine's event loop; none found "
                           "(it starts with the first request). Call `await push_weights_async(...)` from the "
                           "engine's loop instead", kind="validation")

    def sync(self, coro):
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        loop = self._loop()
        if running is loop:
            coro.close()
            raise P.RefitError("push_weights() called on the AsyncLLM's own event loop would block it: use "
                               "`await vllm_rlpatch.refit.push_weights_async(...)`", kind="validation")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def rpc(self, method: str, args: tuple, kwargs: dict) -> list:
        return self.sync(self.rpc_async(method, args, kwargs))

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        return self.rpc(method, args, kwargs)

    def describe(self) -> list[dict[str, Any]]:
        return self.sync(self.describe_async())

    def phase(self, phase: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        return self.sync(run_async(coordinate_phase(self.front, phase, args), self.rpc_async))

    async def describe_async(self) -> list[dict[str, Any]]:
        try:
            return await self.rpc_async("rlpatch_refit_describe", (), {})
        except Exception as e:  # noqa: BLE001
            raise rpc_error_to_refit(e, "describe") from e

    def run(self, req: dict[str, Any]) -> dict[str, Any]:
        return self.sync(self.run_async(req))

    async def run_async(self, req: dict[str, Any]) -> dict[str, Any]:
        return await coordinate_on_async(self.front, req, lambda g: run_async(g, self.rpc_async))

    def version(self) -> int:
        return self.sync(self.version_async())

    async def version_async(self) -> int:
        return max(int(v) for v in await self.rpc_async("rlpatch_weight_version", (), {}))


def is_async_llm(obj: Any) -> bool:
    return type(obj).__name__ in ("AsyncLLM", "AsyncLLMEngine") and hasattr(obj, "collective_rpc")


def is_ray_handle(obj: Any) -> bool:
    return type(obj).__name__ == "ActorHandle" and type(obj).__module__.startswith("ray")


def is_engine(obj: Any) -> bool:
    return is_async_llm(obj) or (hasattr(obj, "collective_rpc") and (hasattr(obj, "llm_engine")
                                                                      or hasattr(obj, "engine_core")))


def local_target(engine: Any) -> Target:
    """The target for an engine object in this process (a ``vllm.LLM`` / ``LLMEngine`` or an ``AsyncLLM``)."""
    return AsyncTarget(engine) if is_async_llm(engine) else LocalTarget(engine)
