"""Upstream-ready diffs (upstream_patches/): complete, well-formed, and listed by the CLI.

That each diff applies to its pristine base is checked in tests/source_level/test_upstream_diffs.py (it
downloads upstream's wheels once); that a diff fixes the same behaviour as its runtime patch, on real vLLM with
the runtime patch off, is in tests/test_upstream_behaviour.py.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_rlpatch.tools import upstream
from vllm_rlpatch.patches import ALL_PATCHES, BY_NAME

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick

ROOT = Path(__file__).resolve().parents[1]
PATCHES = upstream.load_all()
SECTIONS = ("## Purpose", "## Root cause", "## Fix", "## Test Plan", "## Test Result", "## Upstream status")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", "upstream", *args],
                          capture_output=True, text=True, timeout=120)


def test_every_runtime_patch_has_a_diff_or_a_stated_reason():
    mirrored = {p.runtime_patch for p in PATCHES}
    for spec in ALL_PATCHES:
        assert spec.name in mirrored or spec.name in upstream.NO_DIFF, f"{spec.name}: no diff and no reason"
        assert not (spec.name in mirrored and spec.name in upstream.NO_DIFF), f"{spec.name}: both"
    assert set(upstream.NO_DIFF) <= set(BY_NAME), "a reason for a patch that does not exist"


@pytest.mark.parametrize("p", PATCHES, ids=[p.name for p in PATCHES])
def test_diff_directory_is_complete(p):
    assert p.runtime_patch in BY_NAME, p
    spec = BY_NAME[p.runtime_patch]
    if p.kind == "backport":
        # a backport targets versions the runtime patch still fixes; upstream's fixed_in matches the spec's
        assert spec.fixed_in == p.upstream_fixed_in, (spec.fixed_in, p.upstream_fixed_in)
        assert p.upstream_prs and all(re.fullmatch(r"vllm#\d+", pr) for pr in p.upstream_prs), p.upstream_prs
    else:
        assert spec.fixed_in is None, f"{p.name}: a fix for a bug the runtime patch says upstream fixed"
    pr = (p.directory / "PR.md").read_text()
    for s in SECTIONS:
        assert s in pr, f"{p.name}/PR.md lacks {s}"
    text = "".join(f.read_text() for f in p.patch_files)
    assert text.startswith("From ") and "\nSubject: [PATCH" in text and "\n---\n" in text, "not format-patch style"
    touched = p.files_touched()
    assert any(t.startswith("vllm/") for t in touched), touched
    tests_added = [t for t in touched if t.startswith("tests/")]
    assert tests_added, f"{p.name}: the PR adds no upstream test"
    for t in tests_added:  # the plain copy beside the diff is the file the diff creates
        copy = p.directory / Path(t).name
        assert copy.exists(), f"{p.name}: no plain copy of {t}"
        added = _added_file(text, t)
        assert added == copy.read_text(), f"{p.name}: {copy.name} differs from the file the diff adds"


def _added_file(patch_text: str, path: str) -> str:
    block = patch_text.split(f"diff --git a/{path} b/{path}\n", 1)[1]
    block = block.split("\ndiff --git ", 1)[0]
    assert "new file mode" in block.split("@@", 1)[0], f"{path} is not a new file in the diff"
    body = block.split("\n@@", 1)[1].split("\n", 1)[1]
    lines = []
    for line in body.split("\n"):
        if line.startswith("+"):
            lines.append(line[1:])
        elif line.startswith(("-- ", "--\n")) or line == "--":
            break  # format-patch signature
        elif line.startswith("\\"):
            continue
        else:
            break
    return "\n".join(lines) + "\n"


def test_cli_lists_every_diff_and_every_reason():
    r = _cli()
    assert r.returncode == 0, r.stderr
    for p in PATCHES:
        assert p.name in r.stdout and p.base in r.stdout
    for name in upstream.NO_DIFF:
        assert f"({name})" in r.stdout
    md = _cli("--markdown")
    assert md.returncode == 0 and md.stdout.startswith("| diff |")


def test_cli_show_and_errors():
    p = PATCHES[0]
    r = _cli("--show", p.name)
    assert r.returncode == 0 and "## Root cause" in r.stdout and p.files_touched()[0] in r.stdout
    bad = _cli("--show", "no_such_diff")
    assert bad.returncode == 2 and "no upstream diff named 'no_such_diff'" in bad.stderr and p.name in bad.stderr
    both = _cli("--show", p.name, "--check")
    assert both.returncode == 2 and "not allowed with" in both.stderr


def test_malformed_directories_are_refused(tmp_path):
    d = tmp_path / "x"
    d.mkdir()
    with pytest.raises(upstream.UpstreamError, match="no patch.toml"):
        upstream.load(d)
    (d / "patch.toml").write_text('name = "x"\nruntime_patch = "prefix_cache"\nbase = "0.34.0"\n'
                                  'branch = "main"\nkind = "backport"\nsummary = "s"\n')
    with pytest.raises(upstream.UpstreamError, match="names upstream_fixed_in"):
        upstream.load(d)
    (d / "patch.toml").write_text('name = "x"\nruntime_patch = "prefix_cache"\nbase = "0.34.0"\n'
                                  'branch = "main"\nkind = "fix"\nsummary = "s"\n')
    with pytest.raises(upstream.UpstreamError, match="no NNNN-"):
        upstream.load(d)
    (d / "0001-x.patch").write_text("From x\n")
    with pytest.raises(upstream.UpstreamError, match="no PR.md"):
        upstream.load(d)


def test_a_diff_that_does_not_apply_is_reported(tmp_path):
    """apply_to on a tree where the context is gone: a clear error naming the step and the file."""
    p = PATCHES[0]
    tree = tmp_path / "tree"
    for rel in p.files_touched():
        f = tree / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("vllm/"):
            f.write_text("# not vLLM's file\n")
    with pytest.raises(upstream.UpstreamError, match=r"git apply --check .*failed"):
        upstream.apply_to(p, tree)
