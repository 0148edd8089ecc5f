"""Put this directory first on PYTHONPATH to run a Python in which `import vllm_rlpatch` fails, as in an
environment where the package is not installed (tests: a Ray actor without the plugin)."""

import sys


class _HideRlpatch:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_rlpatch" or name.startswith("vllm_rlpatch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for _m in [m for m in sys.modules if m == "vllm_rlpatch" or m.startswith("vllm_rlpatch.")]:
    del sys.modules[_m]
sys.meta_path.insert(0, _HideRlpatch())
