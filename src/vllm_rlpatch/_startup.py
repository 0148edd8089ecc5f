"""Interpreter start-up hook, run from ``vllm_rlpatch_startup.pth`` in site-packages.

1. vLLM loads general plugins inside ``EngineArgs.__post_init__``, after the dataclass ``__init__`` has set
   every field, so the plugin alone cannot tell whether ``logprobs_mode="raw_logprobs"`` was passed by the
   user or is the default. A post-import hook on ``vllm.engine.arg_utils`` records the explicitly passed
   arguments before ``__post_init__`` runs (see :mod:`vllm_rlpatch.hooks.explicit`). Skipped when
   ``VLLM_RLPATCH_ENABLED=0``.
2. vLLM 0.32 warns "Unknown vLLM environment variable detected" for every ``VLLM_*`` name it does not
   know; a post-import hook on ``vllm.envs`` declares the ``VLLM_RLPATCH_*`` variables that are set (our
   own validation reports unknown ones, with the closest known name).

This runs in *every* interpreter of the environment, so it must cost next to nothing and never raise.
It imports only ``os`` and :mod:`vllm_rlpatch._postimport` (which imports only ``sys``; wrapt's own
post-import machinery pulls in asyncio and importlib.metadata: ~70 ms per interpreter, measured in
benchmarks/results/); its ``sys.meta_path`` finder defers all real work to the moment vLLM's modules load.
"""

import os

from vllm_rlpatch._postimport import when_imported


def declare_env_names(module=None):
    """Add the set ``VLLM_RLPATCH_*`` variables to ``vllm.envs.environment_variables``."""
    if module is None:
        try:
            import vllm.envs as module
        except ImportError:  # no vLLM here: nothing would warn about our variables
            return
    table = getattr(module, "environment_variables", None)
    if isinstance(table, dict):
        for name in os.environ:
            if name.startswith("VLLM_RLPATCH_") and name not in table:
                table[name] = (lambda n=name: os.environ.get(n))


def _on_arg_utils(module):
    try:
        from vllm_rlpatch.hooks import explicit  # wrapt and the hook: loaded only once vLLM is imported

        explicit.install(module)
    except Exception as e:  # never break the import of vLLM; the plugin tries again when it registers
        import logging

        logging.getLogger("vllm.rlpatch").debug("vllm-rlpatch: explicit-argument capture unavailable: %r", e)


try:
    if any(k.startswith("VLLM_RLPATCH_") for k in os.environ):
        when_imported("vllm.envs", declare_env_names)
    # The one VLLM_RLPATCH_* read outside vllm_rlpatch.envs (whose import would double this hook's cost):
    # VLLM_RLPATCH_ENABLED, with envs.parse_bool's spellings of "off".
    if os.environ.get("VLLM_RLPATCH_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off"):
        when_imported("vllm.engine.arg_utils", _on_arg_utils)
except Exception:
    pass
