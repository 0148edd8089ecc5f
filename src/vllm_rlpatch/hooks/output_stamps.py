"""Outputs stamped with the weights they ran with, and per-request data carried from the workers to the user.

* **Version spans.** The version current when a batch was *scheduled* (so async scheduling's batch in
  flight is attributed to the weights it ran with) and the version the request's KV was computed under
  travel to the front end inside ``EngineCoreOutput.kv_transfer_params`` (key :data:`TAG_KEY`, only when
  they change for a request: :func:`tag_outputs`), where :func:`process_outputs_wrapper` pops them before
  vLLM sees them and every ``CompletionOutput`` gets ``rlpatch_weight_versions``: a list of
  :class:`~vllm_rlpatch.hooks.update_events.VersionSpan` over its output-token indexes (:func:`spans_of`).
* **Payload channels** (:func:`add_channel`): a channel reads what a worker attached to its
  ``ModelRunnerOutput`` in the engine core, puts it into the request's ``EngineCoreOutput``
  (:func:`put_payload`: ``kv_transfer_params`` key :data:`PAYLOAD_KEY`, popped in the front end before vLLM
  sees it) and sets it on the ``CompletionOutput`` (the ``sampling_support`` patch's per-token support).

The wrappers here are installed by :mod:`vllm_rlpatch.hooks.engine_core`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from vllm_rlpatch.hooks.update_events import Guard, VersionSpan, guard_of_scheduler, policies

logger = logging.getLogger("vllm.rlpatch")

TAG_KEY = "__vllm_rlpatch__"
PAYLOAD_KEY = "__vllm_rlpatch_payload__"


@dataclasses.dataclass
class Channel:
    """Per-request data from the workers to the ``CompletionOutput`` (each callback runs in its process).

    engine_core:  ``(scheduler, model_runner_output, outputs)`` after ``Scheduler.update_from_output``;
                  calls :func:`put_payload` for the requests it has data for.
    frontend:     ``(request_state, payload, n_before)`` in the front end, for each payload of this channel
                  (``n_before``: the request's output tokens before this output's new ones).
    completion:   ``(request_state, completion_output)`` when vLLM builds a ``CompletionOutput``.
    merge:        ``(completion_output, next_completion_output)`` when vLLM merges a DELTA output that nobody
                  read yet into the next one (``RequestOutput.add(..., aggregate=True)``: a stream read more
                  slowly than the engine produces): the channel's data for the later tokens joins the earlier.
    """

    name: str
    engine_core: Callable[[Any, Any, dict], None] | None = None
    frontend: Callable[[Any, Any, int], None] | None = None
    completion: Callable[[Any, Any], None] | None = None
    merge: Callable[[Any, Any], None] | None = None



_LOCK = threading.Lock()
_CHANNELS: dict[str, Channel] = {}


def add_channel(ch: Channel) -> None:
    with _LOCK:
        _CHANNELS[ch.name] = ch


def remove_channel(name: str) -> None:
    with _LOCK:
        _CHANNELS.pop(name, None)


def _channels() -> list[Channel]:
    with _LOCK:
        return list(_CHANNELS.values())


def put_payload(output: Any, channel: str, payload: Any) -> None:
    """Attach ``payload`` (msgpack-able) for ``channel`` to one ``EngineCoreOutput``."""
    params = output.kv_transfer_params
    if params is None:
        output.kv_transfer_params = params = {}
    params.setdefault(PAYLOAD_KEY, {})[channel] = payload


# ---------------------------------------------------------------------------------------------- engine core
def tag_outputs(g: Guard, version: int, outputs: dict[int, Any]) -> None:
    """Stamp each request's output with (batch version, KV version) when the pair changed for it."""
    last = g.last_tag
    kv = g.kv_version
    for eco in outputs.values():
        for o in getattr(eco, "outputs", ()) or ():
            rid = o.request_id
            if o.new_token_ids:
                tag = (version, kv.get(rid, version))
                if last.get(rid) != tag:
                    last[rid] = tag
                    params = o.kv_transfer_params
                    if params is None:
                        o.kv_transfer_params = {TAG_KEY: tag}
                    else:
                        params[TAG_KEY] = tag
            if o.finish_reason is not None:
                last.pop(rid, None)
                kv.pop(rid, None)
    g.outputs_seen += 1
    if g.outputs_seen % 2048 == 0:  # requests aborted by clients produce no final output
        live = getattr(g.scheduler, "requests", None)
        if isinstance(live, dict):
            for d in (last, kv):
                for rid in [r for r in d if r not in live]:
                    d.pop(rid, None)


def update_from_output_wrapper(wrapped, instance, args, kwargs):
    outputs = wrapped(*args, **kwargs)
    g = guard_of_scheduler(instance)
    if g is not None and outputs and any(p.tags_outputs for p in policies()):
        so = args[0] if args else kwargs.get("scheduler_output")
        tag_outputs(g, getattr(so, "_rlpatch_version", g.version), outputs)
    if outputs and _CHANNELS:
        mro = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
        for ch in _channels():
            if ch.engine_core is not None:
                try:
                    ch.engine_core(instance, mro, outputs)
                except Exception:
                    logger.exception("vllm-rlpatch: output channel %s failed in the engine core", ch.name)
    return outputs


# ---------------------------------------------------------------------------------------------- front end
def process_outputs_wrapper(wrapped, instance, args, kwargs):
    ecos = args[0] if args else kwargs.get("engine_core_outputs")
    if ecos:
        states = instance.request_states
        for eco in ecos:
            params = eco.kv_transfer_params
            if not params or (TAG_KEY not in params and PAYLOAD_KEY not in params):
                continue
            tag = params.pop(TAG_KEY, None)
            payloads = params.pop(PAYLOAD_KEY, None)
            if not params:
                eco.kv_transfer_params = None
            st = states.get(eco.request_id)
            if st is None:
                continue
            det = getattr(st, "detokenizer", None)
            n = det.num_output_tokens() if det is not None else 0
            if tag is not None:
                starts = st.__dict__.setdefault("_rlpatch_starts", [])
                starts.append((n, int(tag[0]), int(tag[1])))
            for name, payload in (payloads or {}).items():
                ch = _CHANNELS.get(name)
                if ch is not None and ch.frontend is not None:
                    try:
                        ch.frontend(st, payload, n)
                    except Exception:
                        logger.exception("vllm-rlpatch: output channel %s failed in the front end", name)
    return wrapped(*args, **kwargs)


def spans_of(starts: list[tuple[int, int, int]], end: int) -> list[VersionSpan]:
    out: list[VersionSpan] = []
    for i, (s, v, kv) in enumerate(starts):
        e = starts[i + 1][0] if i + 1 < len(starts) else end
        if out and out[-1].end == s and (out[-1].version, out[-1].kv_version) == (v, kv):
            out[-1] = out[-1]._replace(end=e)
        elif e > s or (i + 1 == len(starts) and not out):
            out.append(VersionSpan(s, e, v, kv))
    return out


def request_output_add_wrapper(wrapped, instance, args, kwargs):
    """``RequestOutput.add(next_output, aggregate)``. vLLM merges DELTA outputs that the caller has not read yet
    (its output collector, under a slow stream reader) by extending the earlier ``CompletionOutput`` in place,
    which keeps the earlier one's fields: the later tokens would lose their spans and channel data. The later
    output's spans index the whole output so far, so they replace the earlier ones; each channel joins its own
    data. Without ``aggregate`` vLLM replaces the outputs, fields included."""
    nxt = args[0] if args else kwargs.get("next_output")
    aggregate = args[1] if len(args) > 1 else kwargs.get("aggregate", False)
    before = {c.index: c for c in instance.outputs}
    result = wrapped(*args, **kwargs)
    if not aggregate or nxt is None:
        return result
    for n in nxt.outputs:
        c = before.get(n.index)
        if c is None or c is n:
            continue
        spans = getattr(n, "rlpatch_weight_versions", None)
        if spans is not None:
            c.rlpatch_weight_versions = spans
        for ch in _channels():
            if ch.merge is not None:
                try:
                    ch.merge(c, n)
                except Exception:
                    logger.exception("vllm-rlpatch: output channel %s failed merging outputs", ch.name)
    return result


def new_completion_output_wrapper(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    for ch in _channels():
        if ch.completion is not None:
            try:
                ch.completion(instance, out)
            except Exception:
                logger.exception("vllm-rlpatch: output channel %s failed on a CompletionOutput", ch.name)
    starts = instance.__dict__.get("_rlpatch_starts")
    if starts:
        det = getattr(instance, "detokenizer", None)
        end = det.num_output_tokens() if det is not None else len(getattr(out, "token_ids", ()) or ())
        try:
            out.rlpatch_weight_versions = spans_of(starts, end)
        except AttributeError:
            pass
    return out

