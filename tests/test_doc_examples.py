"""Every Python example of README.md and docs/ runs (tests/doc_examples.py says how they are collected and
marked). The collection checks are engine-free (quick); running the examples starts engines, all pages in one
process sharing one engine (plus the ones the README's and getting-started's scripts start themselves), on
the newest CI version only: the examples show the API, whose per-version behaviour the other tests cover."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import doc_examples
from support.env import skip_unless_newest

ROOT = Path(__file__).resolve().parents[1]
PAGES = {str(p.relative_to(ROOT)): doc_examples.collect(p) for p in doc_examples.pages()}
RUNNABLE = sorted(page for page, exs in PAGES.items() if any(e.skip is None for e in exs))


@pytest.mark.quick
def test_every_python_block_is_collected():
    for page, examples in PAGES.items():
        fences = len(doc_examples.ANY_PYTHON_FENCE.findall((ROOT / page).read_text()))
        assert fences == len(examples), f"{page}: {fences} python fences, {len(examples)} collected examples"


@pytest.mark.quick
def test_skips_declare_a_reason():
    for page, examples in PAGES.items():
        for e in examples:
            assert e.skip is None or len(e.skip) >= 10, f"{page}:{e.line}: a skip needs its reason"


@pytest.mark.quick
def test_the_readme_quick_start_is_run():
    (quick,) = [e for e in PAGES["README.md"] if 'if __name__ == "__main__":' in e.code]
    assert quick.skip is None and not quick.setup  # runnable as written, nothing hidden before it


@pytest.mark.quick
def test_a_failing_example_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('<!-- example: setup\nx = 1\n-->\n```python\ny = x\n```\n\n'
                    '<!-- example: skip not runnable here, for the test -->\n```python\nraise SystemExit(3)\n```\n\n'
                    '```python\nassert y == 2, "planted"\n```\n')
    examples = doc_examples.collect(page, root=tmp_path)
    assert [(e.setup, e.skip) for e in examples] == [("x = 1\n", None), ("", "not runnable here, for the test"),
                                                     ("", None)]
    res = doc_examples.run_examples(examples)
    assert [r["status"] for r in res] == ["passed", "skipped", "failed"] and "planted" in res[2]["error"]


@pytest.fixture(scope="module")
def results(version, tmp_path_factory):
    skip_unless_newest(version, "the documentation's examples")
    out = tmp_path_factory.mktemp("doc-examples") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "doc_examples.py"), str(out), *RUNNABLE],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        pytest.fail(f"the example runner died (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.mark.parametrize("page", RUNNABLE)
def test_examples_run(results, page):
    mine = [r for r in results if r["page"] == page]
    assert len(mine) == len(PAGES[page])
    failed = [f"{r['page']}:{r['line']}\n{r['error']}" for r in mine if r["status"] == "failed"]
    assert not failed, "\n".join(failed)
    for r in mine:
        print(f"{r['page']}:{r['line']} {r['status']} {r['seconds']} s {r['reason'] or ''}")
