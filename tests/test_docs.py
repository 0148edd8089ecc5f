"""The documentation: README.md and the pages under docs/ (a mkdocs site, mkdocs.yml; every page also plain
Markdown). Generated tables match the code and the committed results, every page of the navigation exists and
is no stub, every relative link and anchor resolves, the README keeps its shape. Engine-free."""

import importlib.util
import json
import re
import unicodedata
from pathlib import Path

import pytest
import yaml

from vllm_rlpatch.tools import table

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _section(text: str, name: str) -> str:
    a = text.index(f"<!-- {name}:start -->") + len(f"<!-- {name}:start -->")
    return text[a:text.index(f"<!-- {name}:end -->")].strip()


def _script(rel: str):
    spec = importlib.util.spec_from_file_location(Path(rel).stem, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _nav_pages() -> list[str]:
    def walk(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for x in node:
                yield from walk(x)
        elif isinstance(node, dict):
            for v in node.values():
                yield from walk(v)

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    return list(walk(config["nav"]))


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_generated_tables_are_current():
    hint = "run: vllm-rlpatch patches --update-docs docs"
    where = {"patch-table": "reference.md", "env-table": "reference.md", "upstream-table": "upstream.md"}
    for name, body in table.sections().items():
        assert _section((DOCS / where[name]).read_text(), name) == body, hint


def test_tested_versions_table_is_generated_from_the_sweep_json():
    mod = _script("ci/sweep/table.py")
    page = (DOCS / "reference.md").read_text()
    assert mod.START in page and mod.render() in page, "run: python ci/sweep/table.py --write docs/reference.md"
    assert len(mod.rows()) >= 3  # the sweep's JSON is committed


def test_benchmark_results_table_is_generated_from_the_json():
    mod = _script("benchmarks/results_table.py")
    page = (DOCS / "benchmarks.md").read_text()
    assert _section(page, "results-table") == mod.render(), \
        "run: python benchmarks/results_table.py --write docs/benchmarks.md"
    assert all(hw != "not recorded" and v for _, hw, v, _ in mod.rows() if "vllm" in _)


def test_key_figures_are_generated_from_the_json():
    mod = _script("benchmarks/figures.py")
    for page in mod.FIGURES:
        assert _section((DOCS / page).read_text(), "figures") == mod.render(page), \
            f"docs/{page}: run python benchmarks/figures.py --write"
    assert mod.main(["--check"]) == 0


def test_serving_load_table_is_generated_from_the_json():
    mod = _script("benchmarks/serve_table.py")
    page = (DOCS / "serving.md").read_text()
    hint = "run: python benchmarks/serve_table.py --write docs/serving.md"
    assert _section(page, "serve-load-table") == mod.render(), hint


def test_trainer_integrations_tables_are_generated_from_the_json():
    """docs/trainers/index.md holds every framework's row; a framework's page (named after it) its own rows."""
    mod = _script("benchmarks/integrations/table.py")
    results = [json.loads(f.read_text()) for f in (ROOT / "benchmarks" / "results" / "integrations").glob("*.json")]
    frameworks = {r["row"]["framework"] for r in results if "row" in r}
    assert len(frameworks) >= 5, frameworks
    pages = [f for f in sorted((DOCS / "trainers").glob("*.md")) if mod.START in f.read_text()]
    assert {f.stem for f in pages} >= {"index", "trl", "verl", "openrlhf", "skyrl", "nemo-rl"}, pages
    for page in pages:
        table = page.read_text().split(mod.START, 1)[1].split(mod.END, 1)[0].strip()
        want = mod.render(framework=None if page.stem == "index" else page.stem)
        assert want is not None and table == want, f"{page.name}: run bash ci/integrations.sh (or table.py)"
    index = (DOCS / "trainers" / "index.md").read_text()
    assert all(f"\n| {f} |" in index for f in frameworks), frameworks


def test_readme_commands_and_ci_agree():
    readme = README.read_text()
    start = readme.index("## The two commands")
    commands = readme[start:readme.index("\n## ", start + 1)]
    assert "bash scripts/parity.sh" in commands and "bash ci/test.sh" in commands
    assert "bash ci/test.sh --quick" in commands and "--quick" in (ROOT / "ci" / "test.sh").read_text()
    assert "bash ci/test.sh" in (ROOT / ".ci" / "run").read_text()
    assert "mkdocs\" build --strict" in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "scripts" / "parity.sh").exists() and (ROOT / "scripts" / "demo.sh").exists()
    assert "vllm-rlpatch\" parity" in (ROOT / "scripts" / "parity.sh").read_text()
    assert (ROOT / "CHANGELOG.md").exists()
    # the first screen installs as written: the package is on no index yet
    first = readme[:start]
    assert "pip install ." in first and "pip install vllm-rlpatch" not in first


def test_readme_shape():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 200
    wide = [i for i, line in enumerate(lines, 1)
            if len(line) > 120 and not line.startswith("|") and "://" not in line]
    assert not wide, f"README lines wider than 120 characters: {wide}"
    order = ["## Install", "## The two commands", "## Quick start", "## Supported versions", "## Documentation"]
    at = [text.index(h) for h in order]
    assert at == sorted(at), "README sections out of order"
    quick = text[at[2]:at[3]]
    code = re.search(r"```python\n(.*?)```", quick, re.S).group(1)
    assert len(code.splitlines()) <= 25 and 'if __name__ == "__main__":' in code
    for name in ("push_weights(", "processed_logprobs(", "report."):
        assert name in code


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = _nav_pages()
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"pages in mkdocs.yml's nav that docs/ lacks: {missing}"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk <= set(nav), f"pages not in the nav: {sorted(on_disk - set(nav))}"


def _expanded(path: Path) -> str:
    """The page as the site shows it: snippet includes (--8<-- "FILE") expanded."""
    return re.sub(r'^--8<-- "([^"]+)"$', lambda m: (ROOT / m.group(1)).read_text(), path.read_text(), flags=re.M)


def test_no_stub_pages():
    for rel in _nav_pages():
        path = DOCS / rel
        if not path.is_file():
            continue  # the test above names it
        text = _expanded(path)
        assert len(text.splitlines()) >= 30, f"docs/{rel} is a stub (under 30 lines)"
        assert "TODO" not in text, f"docs/{rel} has a TODO"


def slug(heading: str) -> str:
    """The anchor of a heading, as mkdocs' toc extension and GitHub make it for these pages."""
    text = re.sub(r"[`*]", "", heading).strip()
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, re.M)}


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    for m in LINK.finditer(text):
        yield m.group(1) or m.group(2)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in _links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        if target.startswith("/"):
            bad.append(f"{target} (absolute: not plain Markdown)")
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading with that anchor)")
        if page.parent == DOCS or DOCS in page.parents:
            if file and DOCS not in dest.parents:
                bad.append(f"{target} (outside docs/: the site cannot follow it)")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


def test_slug_matches_mkdocs_for_the_headings_used():
    assert slug("Fleet updates") == "fleet-updates"
    assert slug("Targets and transports") == "targets-and-transports"
    assert slug("Tested versions") == "tested-versions"
