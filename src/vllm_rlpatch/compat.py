"""What this vLLM has, detected once per process: the features that change how a hook or patch works (as
opposed to whether a patch applies, which each spec's range, ``fixed_in`` and probe decide)."""

from __future__ import annotations

import functools
import importlib.util

from packaging.version import Version

from vllm_rlpatch.versions import vllm_info

API_SERVER = "vllm.entrypoints.openai.api_server"
LAUNCHER_ENTRY = "vllm.entrypoints.launchers.api_server.entry"


@functools.cache
def weight_update_sessions() -> bool:
    """vLLM >= 0.25: the native update API is a session (start / update / finish_weight_update); 0.20's
    ``update_weights`` is one complete update per call."""
    info = vllm_info()
    return not (info.installed and info.release < Version("0.25"))


@functools.cache
def native_head_dtype() -> bool:
    """vLLM >= 0.32: ``ModelConfig.head_dtype`` for generation models (``LogitsProcessor._apply_head``)."""
    info = vllm_info()
    return info.installed and info.release >= Version("0.32")


@functools.cache
def build_app_module() -> str:
    """Where the OpenAI server builds its app: 0.32 in launchers/api_server/entry.py (importing ``build_app``
    by name, so it is wrapped there), 0.20 - 0.25 in the api_server module itself."""
    try:
        if importlib.util.find_spec(LAUNCHER_ENTRY) is not None:
            return LAUNCHER_ENTRY
    except ImportError:  # no vllm.entrypoints.launchers.api_server package (0.20 - 0.25)
        pass
    return API_SERVER


@functools.cache
def worker_update_methods() -> tuple[str, ...]:
    """The worker's native method that completes an update: ``finish_weight_update`` (0.25+) or
    ``update_weights`` (0.20). Imports vLLM's worker module: call it once that module is imported."""
    from vllm.v1.worker.gpu_worker import Worker

    if hasattr(Worker, "finish_weight_update"):
        return ("finish_weight_update",)
    return ("update_weights",) if hasattr(Worker, "update_weights") else ()
