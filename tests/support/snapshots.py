"""Snapshot files under tests/snapshots/: a test compares what it measured with the stored text, and with
``RLPATCH_UPDATE_SNAPSHOTS=1`` writes it instead (then review ``git diff tests/snapshots``)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from support.env import TESTS

SNAPSHOTS = TESTS / "snapshots"
# Rewrites every snapshot (the public names, the CLI help, the start-up imports and their time).
UPDATE_COMMAND = ("RLPATCH_UPDATE_SNAPSHOTS=1 PYTHONPATH=src python -m pytest -q -p no:cacheprovider "
                  "tests/source_level/test_snapshots.py tests/source_level/test_startup_import.py")


def updating() -> bool:
    return os.environ.get("RLPATCH_UPDATE_SNAPSHOTS", "0") == "1"


def path(rel: str) -> Path:
    return SNAPSHOTS / rel


def read(rel: str) -> str | None:
    p = path(rel)
    return p.read_text() if p.exists() else None


def write(rel: str, text: str) -> None:
    p = path(rel)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def mismatch(rel: str, text: str, what: str) -> str | None:
    """Why TEXT does not match the snapshot REL (a diff), or None; when updating, store TEXT and return None."""
    if updating():
        write(rel, text)
        return None
    old = read(rel)
    if old is None:
        return f"no snapshot of {what} (tests/snapshots/{rel})"
    if old == text:
        return None
    diff = "".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True), f"snapshot {rel}", "now"))
    return f"{what} changed:\n{diff}"


def _fail(problems: list[str]) -> None:
    if problems:
        raise AssertionError("\n".join(problems) + f"\nIf that is intended, update the snapshots with:\n  "
                             f"{UPDATE_COMMAND}\nand review `git diff tests/snapshots`.")


def check_text(rel: str, text: str, what: str) -> None:
    """Compare TEXT with the snapshot REL (or store it, when updating); fail with a diff."""
    _fail([m for m in [mismatch(rel, text, what)] if m])


def check_folder(rel_dir: str, texts: dict[str, str], what: str) -> None:
    """Every TEXTS[name] against REL_DIR/name, all differences in one failure; a stored file with no name in
    TEXTS fails too (removed when updating)."""
    stored = {p.name for p in path(rel_dir).glob("*")} if path(rel_dir).is_dir() else set()
    gone = sorted(stored - set(texts))
    problems = []
    if updating():
        for name in gone:
            path(f"{rel_dir}/{name}").unlink()
    elif gone:
        problems.append(f"{what}: {', '.join(gone)} stored in tests/snapshots/{rel_dir} but gone now")
    for name, text in sorted(texts.items()):
        if m := mismatch(f"{rel_dir}/{name}", text, f"{what} ({name})"):
            problems.append(m)
    _fail(problems)
