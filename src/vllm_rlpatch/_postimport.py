"""Post-import hooks: run a function right after a module is imported (at once if it already is).

A leaf of the core: imports only ``sys``. The ``.pth`` start-up hook (:mod:`vllm_rlpatch._startup`) and
every late wrap (:class:`vllm_rlpatch._wrapping.LazyWrap`) use it. wrapt's own post-import machinery pulls in
asyncio and importlib.metadata (~70 ms per interpreter), too much for a hook that runs in every interpreter.
"""

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
