"""One weight update of one engine, as one list of steps (:func:`steps`) run by two drivers: :func:`run_sync`
(``push_weights``) and :func:`run_async` (``push_weights_async`` on an ``AsyncLLM``'s own event loop).

The steps, in order:

1. the engine's schema (cached per engine, :mod:`.caches`);
2. the sender (:class:`~.outgoing.Outgoing`): metadata checked, the bytes placed and digested; a refusal (bad
   metadata, NaN) is reported here, before any RPC;
3. the engine runs the update (:mod:`.coordinator`, where the engine lives);
4. an engine that lost the update template it was sent: steps 2-3 once more, in full;
5. the bytes still moving (a broadcast) are waited for;
6. the report.

A step yields what it needs done (``DESCRIBE``, ``SEND``, ``RUN``, ``FINISH``); the sync driver does it in this
thread, the async one on the event loop (the trainer-side work in a worker thread, so the loop stays free).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Generator

from vllm_rlpatch.refit.caches import schema_for, schema_for_async
from vllm_rlpatch.refit.options import Options
from vllm_rlpatch.refit.outgoing import Outgoing
from vllm_rlpatch.refit.report import RefitReport
from vllm_rlpatch.refit.target import AsyncTarget, Target

DESCRIBE, SEND, RUN, FINISH = "describe", "send", "run", "finish"
Steps = Generator[tuple[str, Any], Any, RefitReport]


def steps(tgt: Target, named_tensors: Any, opts: Options, raise_on_error: bool) -> Steps:
    schema = yield DESCRIBE, None
    out_ = Outgoing(tgt, named_tensors, opts, schema)
    try:
        yield SEND, out_
        if out_.refused is not None:
            return out_.report(out_.refused, raise_on_error)
        t2 = time.perf_counter()
        out = yield RUN, out_.req
        if out_.template_result(out):  # the engine lost the template: once more, in full
            out_ = Outgoing(tgt, named_tensors, opts, schema)
            yield SEND, out_
            out = yield RUN, out_.req
            out_.template_result(out)
        out_.stages["engine"] = time.perf_counter() - t2
        out_.mark("engine_done")
        yield FINISH, out_
        return out_.report(out, raise_on_error)
    finally:
        out_.close()


def run_sync(tgt: Target, gen: Steps) -> RefitReport:
    ops: dict[str, Callable[[Any], Any]] = {
        DESCRIBE: lambda _: schema_for(tgt),
        SEND: lambda o: o.send(o.schema.workers),
        RUN: tgt.run,
        FINISH: lambda o: o.finish_send(),
    }
    value, error = None, None
    while True:
        try:
            op, arg = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as done:
            return done.value
        try:
            value, error = ops[op](arg), None
        except BaseException as e:  # noqa: BLE001 - raised into the steps, whose clean-up runs
            value, error = None, e


async def run_async(tgt: AsyncTarget, gen: Steps) -> RefitReport:
    ops: dict[str, Callable[[Any], Any]] = {
        DESCRIBE: lambda _: schema_for_async(tgt),
        SEND: lambda o: asyncio.to_thread(o.send, o.schema.workers),
        RUN: tgt.run_async,
        FINISH: lambda o: asyncio.to_thread(o.finish_send),
    }
    value, error = None, None
    while True:
        try:
            op, arg = gen.throw(error) if error is not None else gen.send(value)
        except StopIteration as done:
            return done.value
        try:
            value, error = await ops[op](arg), None
        except BaseException as e:  # noqa: BLE001 - raised into the steps, whose clean-up runs
            value, error = None, e
