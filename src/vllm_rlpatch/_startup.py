"""Interpreter start-up hook, run from ``vllm_rlpatch_startup.pth`` in site-packages.

1. vLLM loads general plugins inside ``EngineArgs.__post_init__``, after the dataclass ``__init__`` has set
   every field, so the plugin alone cannot tell whether ``logprobs_mode="raw_logprobs"`` was passed by the
   user or is the default. A post-import hook on ``vllm.engine.arg_utils`` records the explicitly passed
   arguments before ``__post_init__`` runs (see :mod:`vllm_rlpatch.hooks.explicit`). Skipped when
   ``VLLM_RLPATCH_ENABLED=0``.
2. vLLM 0.32 warns "Unknown vLLM environment variable detected" for every ``VLLM_*`` name it does not
   know; a post-import hook on ``vllm.envs`` declares the ``VLLM_RLPATCH_*`` variables that are set (our
   own validation reports unknown ones, with the closest known name).

It must cost next to nothing in every Python process of the environment and never raise: it imports only
``os`` and ``wrapt`` and defers all real work to the moment vLLM's modules load.
"""

import os


def declare_env_names(module=None):
    """Add the set ``VLLM_RLPATCH_*`` variables to ``vllm.envs.environment_variables``."""
    try:
        if module is None:
            import vllm.envs as module
        table = getattr(module, "environment_variables", None)
        if isinstance(table, dict):
            for name in os.environ:
                if name.startswith("VLLM_RLPATCH_") and name not in table:
                    table[name] = (lambda n=name: os.environ.get(n))
    except Exception:
        pass


def _on_arg_utils(module):
    try:
        from vllm_rlpatch.hooks import explicit

        explicit.install(module)
    except Exception:  # never break the user's interpreter; the plugin reports it later
        pass


try:
    import wrapt

    wrapt.register_post_import_hook(declare_env_names, "vllm.envs")
    if os.environ.get("VLLM_RLPATCH_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off"):
        wrapt.register_post_import_hook(_on_arg_utils, "vllm.engine.arg_utils")
except Exception:
    pass
