"""Tests, their scripts, the benchmarks and the CI scripts take shared helpers from tests/support/ (imported as
``support.<module>``), never from conftest, which holds the pytest fixtures and hooks only."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "benchmarks", "ci", ".ci")


def conftest_imports() -> list[str]:
    out = []
    for folder in FOLDERS:
        for p in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                names = ([node.module] if isinstance(node, ast.ImportFrom) else
                         [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                if "conftest" in names:
                    out.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    return out


def test_nothing_imports_from_conftest():
    found = conftest_imports()
    assert found == [], (f"imports from conftest: {found}. Import the helper from its module in tests/support/ "
                         f"(support.env, support.logs, support.runs, ...) instead.")
