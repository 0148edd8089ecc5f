"""The README's generated tables match the code; the README's two commands exist."""

from pathlib import Path

from vllm_rlpatch.tools import table, upstream

ROOT = Path(__file__).resolve().parents[1]


def _section(text: str, name: str) -> str:
    a = text.index(f"<!-- {name}:start -->") + len(f"<!-- {name}:start -->")
    return text[a:text.index(f"<!-- {name}:end -->")].strip()


def test_readme_tables_are_generated_from_the_code():
    readme = (ROOT / "README.md").read_text()
    hint = "run: vllm-rlpatch patches --update-readme README.md"
    assert _section(readme, "patch-table") == table.markdown(), hint
    assert _section(readme, "env-table") == table.env_markdown(), hint
    assert _section(readme, "upstream-table") == upstream.markdown(upstream.load_all()), hint


def test_tested_versions_table_is_generated_from_the_sweep_json():
    import importlib.util

    spec = importlib.util.spec_from_file_location("sweep_table", ROOT / "ci" / "sweep" / "table.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    readme = (ROOT / "README.md").read_text()
    assert mod.START in readme and mod.render() in readme, "run: python ci/sweep/table.py --write README.md"
    assert len(mod.rows()) >= 3  # the sweep's JSON is committed


def test_readme_commands_and_ci_agree():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## The two commands")
    commands = readme[start:readme.index("\n## ", start + 1)]
    assert "bash scripts/parity.sh" in commands and "bash ci/test.sh" in commands
    assert "bash ci/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "scripts" / "parity.sh").exists() and (ROOT / "scripts" / "demo.sh").exists()
    assert "vllm-rlpatch\" parity" in (ROOT / "scripts" / "parity.sh").read_text()
    assert (ROOT / "CHANGELOG.md").exists()
    # the first screen installs as written: the package is on no index yet
    first = readme[:readme.index("## The two commands")]
    assert "pip install ." in first and "pip install vllm-rlpatch" not in first
