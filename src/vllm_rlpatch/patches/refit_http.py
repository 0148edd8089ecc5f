"""Refit routes on ``vllm serve``, and weight versions in its completion responses.

Why:   RL frameworks that run vLLM as a server (verl, SkyRL, prime-rl, AReaL, TRL's vllm-serve) need a weight
       update path into it; vLLM's own RL routes exist only with ``VLLM_SERVER_DEV_MODE=1``, changed module
       and shape between 0.20, 0.25 and 0.32, carry no authentication, and nothing in an OpenAI response
       says which weights sampled it.
How:   wraps the API server's ``build_app`` (``vllm.entrypoints.openai.api_server`` on 0.20/0.25,
       ``vllm.entrypoints.launchers.api_server.entry`` on 0.32) to add ``/rlpatch/v1/{refit, weight_version,
       describe, fingerprint}`` (:mod:`vllm_rlpatch.refit.http`: JSON only, bearer token, loopback clients
       unless ``VLLM_RLPATCH_HTTP_REMOTE=1``) and an ``x-rlpatch-weight-version`` header; wraps the
       completion / chat-completion response builders so every choice carries ``rlpatch_weight_versions``.
Targets: vllm.entrypoints.openai.api_server.build_app (0.20/0.25) or
       vllm.entrypoints.launchers.api_server.entry.build_app (0.32+);
       vllm.entrypoints.openai.completion.serving.OpenAIServingCompletion.request_output_to_completion_response;
       vllm.entrypoints.openai.chat_completion.serving.OpenAIServingChat.chat_completion_full_generator.
Upstream: vLLM's dev-mode RL routes (/update_weights, ...) are the closest; not a bug.
Remove when: never (the plugin's own API surface).
"""

from vllm_rlpatch import _wrapping
from vllm_rlpatch.registry import PatchSpec

NAME = "refit_http"
BUILD_APP = ("vllm.entrypoints.openai.api_server:build_app",
             "vllm.entrypoints.launchers.api_server.entry:build_app")
COMPLETION = ("vllm.entrypoints.openai.completion.serving:OpenAIServingCompletion."
              "request_output_to_completion_response")
CHAT = "vllm.entrypoints.openai.chat_completion.serving:OpenAIServingChat.chat_completion_full_generator"


def _build_app_target() -> str:
    """0.32 builds the app in launchers/api_server/entry.py (importing build_app by name): wrap it there."""
    import importlib.util

    try:
        if importlib.util.find_spec("vllm.entrypoints.launchers.api_server.entry") is not None:
            return BUILD_APP[1]
    except ImportError:  # no vllm.entrypoints.launchers.api_server package (0.20 - 0.25)
        pass
    return BUILD_APP[0]


class _LazyBuildApp(_wrapping.LazyWrap):
    def apply(self) -> None:
        self.target = _build_app_target()
        super().apply()


def _build_app(wrapped, instance, args, kwargs):
    from vllm_rlpatch.refit import http

    return http.build_app_wrapper(wrapped, instance, args, kwargs)


def _completion(wrapped, instance, args, kwargs):
    from vllm_rlpatch.refit import http

    return http.completion_response_wrapper(wrapped, instance, args, kwargs)


def _chat(wrapped, instance, args, kwargs):
    from vllm_rlpatch.refit import http

    return http.chat_full_wrapper(wrapped, instance, args, kwargs)


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
