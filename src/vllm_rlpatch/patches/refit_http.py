"""Refit routes on ``vllm serve``, and weight versions in its completion responses.

Why:   RL frameworks that run vLLM as a server (verl, SkyRL, prime-rl, AReaL, TRL's vllm-serve) need a weight
       update path into it; vLLM's own RL routes exist only with ``VLLM_SERVER_DEV_MODE=1``, changed module
       and shape between 0.20, 0.25 and 0.32, carry no authentication, and nothing in an OpenAI response
       says which weights sampled it.
How:   wraps the API server's ``build_app`` (``vllm.entrypoints.openai.api_server`` on 0.20/0.25,
       ``vllm.entrypoints.launchers.api_server.entry`` on 0.32) to add ``/rlpatch/v1/{refit, weight_version,
       describe, fingerprint}`` (:mod:`vllm_rlpatch.refit.http`, handed over by the plugin: JSON only, bearer token, loopback clients
       unless ``VLLM_RLPATCH_HTTP_REMOTE=1``) and an ``x-rlpatch-weight-version`` header; wraps the
       completion / chat-completion response builders so every choice carries ``rlpatch_weight_versions``.
Targets: vllm.entrypoints.openai.api_server.build_app (0.20/0.25) or
       vllm.entrypoints.launchers.api_server.entry.build_app (0.32+);
       vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.request_output_to_completion_response;
       vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.chat_completion_full_generator.
Upstream: vLLM's dev-mode RL routes (/update_weights, ...) are the closest; not a bug.
Remove when: never (the plugin's own API surface).
"""

import logging
from typing import Any, Callable

from vllm_rlpatch import _wrapping, compat
from vllm_rlpatch.registry import PatchSpec

logger = logging.getLogger("vllm.rlpatch")

NAME = "refit_http"
BUILD_APP = ("vllm.entrypoints.openai.api_server:build_app",
             "vllm.entrypoints.launchers.api_server.entry:build_app")
COMPLETION = ("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion."
              "request_output_to_completion_response")
CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator"


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


# ------------------------------------------------------------------------------------------ spans in responses
def _spans(output) -> list[list[int]] | None:
    spans = getattr(output, "rlpatch_weight_versions", None)
    return [list(s) for s in spans] if spans else None


def _annotate(choices, outputs) -> None:
    for choice, out in zip(choices, outputs):
        spans = _spans(out)
        if spans is not None:
            try:
                setattr(choice, "rlpatch_weight_versions", spans)
            except Exception:
                pass


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
    args = list(args)
    key = None
    if len(args) > 1:
        gen = args[1]
    else:
        key, gen = "result_generator", kwargs.get("result_generator")

    async def tap(g):
        async for item in g:
            last[:] = [item]
            yield item

    if gen is not None:
        if key is None:
            args[1] = tap(gen)
        else:
            kwargs[key] = tap(gen)

    async def run():
        resp = await wrapped(*args, **kwargs)
        try:
            if last and getattr(resp, "choices", None) is not None:
                _annotate(resp.choices, last[0].outputs)
        except Exception:
            logger.debug("vllm-rlpatch: could not annotate a chat response", exc_info=True)
        return resp

    return run()


_LAZY = [
    _LazyBuildApp(BUILD_APP[0], _build_app, NAME),
    _wrapping.LazyWrap(COMPLETION, _completion, NAME),
    _wrapping.LazyWrap(CHAT, _chat, NAME),
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
    summary="Refit routes on vllm serve (/rlpatch/v1/*, bearer token, loopback by default); completion choices "
            "carry rlpatch_weight_versions",
    vllm=">=0.20",
    targets=(),
    lazy_targets=(COMPLETION, CHAT),
    apply=apply,
    revert=revert,
    upstream="vLLM's RL routes need VLLM_SERVER_DEV_MODE=1 and moved between 0.20, 0.25 and 0.32; not a bug",
    remove_when="never (the plugin's own API surface)",
)
