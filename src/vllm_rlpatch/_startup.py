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
It imports only ``os`` and ``sys`` (wrapt's own post-import machinery pulls in asyncio and
importlib.metadata: ~70 ms per interpreter, measured in benchmarks/results/); the few-line
``sys.meta_path`` finder below defers all real work to the moment vLLM's modules load.
"""

import os
import sys

_HOOKS = {}  # module name -> [callable(module)]


class _HookedLoader:
    """Delegates to the real loader; runs the post-import hooks after the module body executed."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in _HOOKS.pop(self._name, ()):
            try:
                hook(module)
            except Exception as e:  # never break the import of vLLM itself, but say so
                import logging

                logging.getLogger("vllm.rlpatch").error(
                    "vllm-rlpatch: a patch could not be installed when %s was imported: %s: %s",
                    self._name, type(e).__name__, e)

    def __getattr__(self, attr):  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _PostImportFinder:
    _busy = set()

    def find_spec(self, name, path=None, target=None):
        if name not in _HOOKS or name in self._busy:
            return None
        self._busy.add(name)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.discard(name)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _HookedLoader(spec.loader, name)
        return spec


def when_imported(name, hook):
    """Run ``hook(module)`` right after ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        hook(module)
        return
    _HOOKS.setdefault(name, []).append(hook)
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


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
    if any(k.startswith("VLLM_RLPATCH_") for k in os.environ):
        when_imported("vllm.envs", declare_env_names)
    if os.environ.get("VLLM_RLPATCH_ENABLED", "1").strip().lower() not in ("0", "false", "no", "off"):
        when_imported("vllm.engine.arg_utils", _on_arg_utils)
except Exception:
    pass
