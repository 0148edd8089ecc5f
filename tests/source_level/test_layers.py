"""The package's shape, read from its source (no vLLM): function-local imports only where they defer vLLM,
torch or an optional dependency, no private name used across modules, and the measures of tests/shape.py
(sizes within their limits or listed, transport names and message text only where listed). The layer
contracts themselves (import-linter) and the import-cycle check (grimp) run in .ci/run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import layers  # noqa: E402
import shape  # noqa: E402

pytestmark = pytest.mark.quick


def test_function_local_imports_only_defer_heavy_dependencies():
    assert layers.needless_local_imports() == []


def test_no_private_name_crosses_a_module():
    assert layers.private_names_across_modules() == []


def test_sizes_transport_names_and_message_text_within_their_lists():
    m = shape.Measures.read()
    assert m.problems() == [], m.table()
