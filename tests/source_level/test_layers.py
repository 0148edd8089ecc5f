"""The package's shape, read from its source (no vLLM): function-local imports only where they defer vLLM,
torch or an optional dependency, and no private name used across modules. The layer contracts themselves
(import-linter) and the import-cycle check (grimp) run in .ci/run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layers  # noqa: E402


def test_function_local_imports_only_defer_heavy_dependencies():
    assert layers.needless_local_imports() == []


def test_no_private_name_crosses_a_module():
    assert layers.private_names_across_modules() == []
