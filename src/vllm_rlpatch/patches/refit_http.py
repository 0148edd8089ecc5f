"""Refit routes on ``vllm serve``, and per-token weight versions and support information in its responses.

Why:   RL frameworks that run vLLM as a server (verl, SkyRL, prime-rl, AReaL, TRL's vllm-serve, PipelineRL) need a
       weight update path into it; vLLM's own RL routes exist only with ``VLLM_SERVER_DEV_MODE=1``, changed module
       and shape between 0.20, 0.25 and 0.32, carry no authentication, and nothing in an OpenAI response
       says which weights sampled it, or what the sampler's kept set was (``rlpatch_support``, in process only).
How:   wraps the API server's ``build_app`` (``vllm.entrypoints.openai.api_server`` on 0.20/0.25,
       ``vllm.entrypoints.launchers.api_server.entry`` on 0.32) to add ``/rlpatch/v1/{refit, weight_version,
       describe, fingerprint}`` (:mod:`vllm_rlpatch.refit.http`, handed over by the plugin: JSON only, bearer token,
       loopback clients unless ``VLLM_RLPATCH_HTTP_REMOTE=1``) and an ``x-rlpatch-weight-version`` header.
       Completion and chat-completion choices carry ``rlpatch_weight_versions`` (``[[start, end, version,
       kv_version], ...]`` over the choice's generated tokens, echoed prompt tokens excluded) and, when the request
       asked (``"vllm_xargs": {"rlpatch_support": true}``: vLLM copies ``vllm_xargs`` into
       ``SamplingParams.extra_args`` on 0.20-0.32), ``rlpatch_support``: ``{"log_mass_kept": [...], "kept_count":
       [...], "engine": {...}}``, one entry per generated token (null / -1: no information), which
       ``processed_logprobs(engine_info=[choice["rlpatch_support"], ...])`` takes as it is. Full responses: wraps
       the completion / chat response builders. Streams: wraps the stream generators, taps the engine's
       RequestOutputs they read (DELTA: the new tokens only; their spans index the whole output so far) and
       adds to each chunk's choice the fields of the tokens that choice generated since its previous chunk: spans
       in the chunk's own token coordinates (0 = its first generated token), support entries for those tokens,
       the engine key in the first chunk with support only. A chat stream's opening ``role`` chunk carries none.
       Offsetting each chunk's spans by the tokens before it and concatenating gives the full response's fields.
Targets: vllm.entrypoints.openai.api_server.build_app (0.20/0.25) or
       vllm.entrypoints.launchers.api_server.entry.build_app (0.32+);
       vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.request_output_to_completion_response
       and .completion_stream_generator;
       vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.chat_completion_full_generator
       and .chat_completion_stream_generator.
Upstream: vLLM's dev-mode RL routes (/update_weights, ...) are the closest; not a bug.
Remove when: never (the plugin's own API surface).
"""

import inspect
import json
import logging
import math
from typing import Any, Callable

from vllm_rlpatch import _wrapping, compat
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "refit_http"
BUILD_APP = ("vllm.entrypoints.openai.api_server:build_app",
             "vllm.entrypoints.launchers.api_server.entry:build_app")
COMPLETION = ("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion."
              "request_output_to_completion_response")
CHAT_SERVING = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat."
CHAT = CHAT_SERVING + "chat_completion_full_generator"
COMPLETION_STREAM = "vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion.completion_stream_generator"
CHAT_STREAM = CHAT_SERVING + "chat_completion_stream_generator"
RESULTS = "result_generator"  # the serving generators' argument with the engine's RequestOutputs
VERSIONS = "rlpatch_weight_versions"  # per choice: [[start, end, version, kv_version], ...]
SUPPORT = "rlpatch_support"  # per choice: {"log_mass_kept": [...], "kept_count": [...], "engine": {...}}


# Adds the routes to a built app: the refit layer's (vllm_rlpatch.refit.http.install_routes), handed over by
# the composition root (vllm_rlpatch.plugin), since the refit layer sits above the patches.
_ROUTES: Callable[[Any], None] | None = None


def set_route_installer(install: Callable[[Any], None] | None) -> None:
    global _ROUTES
    _ROUTES = install


def _build_app_target() -> str:
    """0.32 builds the app in launchers/api_server/entry.py (importing build_app by name): wrap it there."""
    return BUILD_APP[1] if compat.build_app_module() == compat.LAUNCHER_ENTRY else BUILD_APP[0]


class _LazyBuildApp(_wrapping.LazyWrap):
    def apply(self) -> None:
        self.target = _build_app_target()
        super().apply()


def _build_app(wrapped, instance, args, kwargs):
    app = wrapped(*args, **kwargs)
    if _ROUTES is not None:
        try:
            _ROUTES(app)
        except Exception:
            logger.exception("vllm-rlpatch: could not install the refit routes")
    return app


# ------------------------------------------------------------------------------------------ full responses
def _spans(output) -> list[list[int]] | None:
    spans = getattr(output, VERSIONS, None)
    return [list(s) for s in spans] if spans else None


def _support(output) -> dict | None:
    """``CompletionOutput.rlpatch_support`` as JSON: what ``processed_logprobs(engine_info=...)`` takes per
    sequence (a NaN -- no information for that token -- becomes null, which it reads as NaN)."""
    sup = getattr(output, SUPPORT, None)
    if sup is None:
        return None
    return {"log_mass_kept": [None if math.isnan(x) else x for x in sup.log_mass_kept],
            "kept_count": list(sup.kept_count), "engine": dict(sup.engine)}


def _annotate(choices, outputs) -> None:
    for choice, out in zip(choices, outputs):
        for field, value in ((VERSIONS, _spans(out)), (SUPPORT, _support(out))):
            if value is not None:
                setattr(choice, field, value)  # vLLM's response models allow extra fields


def _completion(wrapped, instance, args, kwargs):
    resp = wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs.get("final_res_batch")
    try:
        outs = [o for r in batch for o in r.outputs]
        if getattr(resp, "choices", None) is not None and len(outs) == len(resp.choices):
            _annotate(resp.choices, outs)
    except Exception:
        logger.debug("vllm-rlpatch: could not annotate a completion response", exc_info=True)
    return resp


def _chat(wrapped, instance, args, kwargs):
    last: list[Any] = []

    async def tap(g):
        async for item in g:
            last[:] = [item]
            yield item

    bound = _bind(wrapped, args, kwargs)
    bound.arguments[RESULTS] = tap(bound.arguments[RESULTS])

    async def run():
        resp = await wrapped(*bound.args, **bound.kwargs)
        try:
            if last and getattr(resp, "choices", None) is not None:
                _annotate(resp.choices, last[0].outputs)
        except Exception:
            logger.debug("vllm-rlpatch: could not annotate a chat response", exc_info=True)
        return resp

    return run()


def _bind(wrapped, args, kwargs) -> inspect.BoundArguments:
    """The serving methods' arguments by name (their positions differ between vLLM minors)."""
    return inspect.signature(wrapped).bind(*args, **kwargs)


# ------------------------------------------------------------------------------------------ streamed responses
class _Pending:
    """What one choice generated since its last chunk: version spans in these tokens' coordinates, support."""

    __slots__ = ("n", "spans", "lm", "cnt", "support")

    def __init__(self) -> None:
        self.n, self.spans, self.lm, self.cnt, self.support = 0, [], [], [], False

    def add_spans(self, spans, off: int, n: int) -> None:
        """``spans`` (of a DELTA ``CompletionOutput``) index the whole output so far: keep ``[off, off + n)``."""
        for s, e, v, kv in spans or ():
            s, e = max(s, off) - off + self.n, min(e, off + n) - off + self.n
            if e <= s:
                continue
            if self.spans and self.spans[-1][1] == s and self.spans[-1][2:] == [v, kv]:
                self.spans[-1][1] = e
            else:
                self.spans.append([s, e, v, kv])

    def add_support(self, sup, n: int) -> None:
        """A DELTA output's support covers its own tokens; tokens without any stay null / -1."""
        lm = [] if sup is None else [None if math.isnan(x) else x for x in sup.log_mass_kept][:n]
        cnt = [] if sup is None else list(sup.kept_count)[:n]
        self.lm += lm + [None] * (n - len(lm))
        self.cnt += cnt + [-1] * (n - len(cnt))
        self.support = self.support or sup is not None


class _StreamFields:
    """The per-token fields of one stream. :meth:`tap` sees each RequestOutput before the serving code turns it
    into chunks (streams get DELTA outputs: the new tokens only); the next chunk of choice ``i`` (the one
    opening a chat with its ``role`` aside) takes what ``i`` generated since its previous chunk."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # choice -> its output tokens so far
        self.pending: dict[int, _Pending] = {}
        self.engine: dict[int, dict] = {}  # choice -> engine key, until a chunk has carried it

    async def tap(self, results, outputs_of):
        async for item in results:
            for i, out in outputs_of(item):
                self.add(i, out)
            yield item

    def add(self, i: int, out: Any) -> None:
        n = len(out.token_ids or ())
        if not n:
            return
        off = self.seen.get(i, 0)
        self.seen[i] = off + n
        p = self.pending.setdefault(i, _Pending())
        p.add_spans(getattr(out, VERSIONS, None), off, n)
        sup = getattr(out, SUPPORT, None)
        p.add_support(sup, n)
        if sup is not None and i not in self.engine:
            self.engine[i] = dict(sup.engine)
        p.n += n

    def fields(self, i: int) -> dict:
        p = self.pending.pop(i)
        out: dict[str, Any] = {VERSIONS: p.spans}
        if p.support or i in self.engine:  # once a choice has support, its chunks all carry entries (null: none)
            out[SUPPORT] = {"log_mass_kept": p.lm, "kept_count": p.cnt}
            if self.engine.get(i) is not None:
                out[SUPPORT]["engine"], self.engine[i] = self.engine[i], None  # once per choice
        return out

    def chunk(self, data: str) -> str:
        if not self.pending or not data.startswith("data: {"):
            return data
        obj = json.loads(data[6:])
        changed = False
        for ch in obj.get("choices") or ():
            i = ch.get("index")
            if i in self.pending and "role" not in (ch.get("delta") or {}):
                ch.update(self.fields(i))
                changed = True
        return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n" if changed else data

    async def annotate(self, chunks):
        try:
            async for data in chunks:
                yield self.chunk(data)
        finally:
            await chunks.aclose()  # now, not at garbage collection: vLLM aborts the request there


def _completion_outputs(request):
    n = getattr(request, "n", None) or 1
    return lambda item: ((o.index + item[0] * n, o) for o in item[1].outputs)  # (prompt index, RequestOutput)


def _chat_outputs(request):
    return lambda res: ((o.index, o) for o in res.outputs)


def _stream(outputs_of):
    def wrapper(wrapped, instance, args, kwargs):
        bound = _bind(wrapped, args, kwargs)
        fields = _StreamFields()
        bound.arguments[RESULTS] = fields.tap(bound.arguments[RESULTS], outputs_of(bound.arguments["request"]))
        return fields.annotate(wrapped(*bound.args, **bound.kwargs))

    return wrapper


_LAZY = [
    _LazyBuildApp(BUILD_APP[0], _build_app, NAME),
    _wrapping.LazyWrap(COMPLETION, _completion, NAME),
    _wrapping.LazyWrap(CHAT, _chat, NAME),
    _wrapping.LazyWrap(COMPLETION_STREAM, _stream(_completion_outputs), NAME),
    _wrapping.LazyWrap(CHAT_STREAM, _stream(_chat_outputs), NAME),
]


def _main_is_api_server() -> bool:
    """``python -m vllm.entrypoints.openai.api_server`` runs the server module as ``__main__`` (a module object
    of its own, never imported under its name): its ``build_app`` is wrapped there."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return getattr(spec, "name", None) == BUILD_APP[0].partition(":")[0] and hasattr(main, "build_app")


def apply() -> None:
    for lz in _LAZY:
        lz.apply()
    if _main_is_api_server():
        _wrapping.wrap("__main__:build_app", _build_app, NAME)


def revert() -> None:
    for lz in _LAZY:
        lz.revert()
    _wrapping.unwrap("__main__:build_app", NAME)


SPEC = PatchSpec(
    name=NAME,
    summary="Refit routes on vllm serve (/rlpatch/v1/*, bearer token, loopback by default); completion and chat "
            "choices, full and streamed, carry rlpatch_weight_versions and (asked per request with vllm_xargs) "
            "rlpatch_support",
    vllm=">=0.20",
    targets=(),
    lazy_targets=(COMPLETION, CHAT, COMPLETION_STREAM, CHAT_STREAM),
    apply=apply,
    revert=revert,
    upstream="vLLM's RL routes need VLLM_SERVER_DEV_MODE=1 and moved between 0.20, 0.25 and 0.32; not a bug",
    remove_when="never (the plugin's own API surface)",
)
