"""Snapshots of the public surface (tests/snapshots/; tests/support/surface.py reads it in a fresh interpreter):
the public names of ``vllm_rlpatch`` and ``vllm_rlpatch.refit``, and the help of ``vllm-rlpatch`` and of each
subcommand (``COLUMNS=100``). A public name never disappears: a renamed one keeps a deprecated alias under the
old name. A new name, or changed help, fails until the snapshots are updated (support.snapshots.UPDATE_COMMAND),
so every change of the surface shows up in review."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import snapshots
from support.env import clean_env
from support.surface import MODULES

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def surface() -> dict:
    p = subprocess.run([sys.executable, "-m", "support.surface"], capture_output=True, text=True, timeout=300,
                       env=clean_env(COLUMNS="100", LINES="50"))
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("module", MODULES)
def test_public_names_are_kept(surface, module):
    now = surface["names"][module]
    rel = f"public_names/{module}.txt"
    if snapshots.updating():
        snapshots.write(rel, "".join(f"{n}\n" for n in now))
        return
    stored = snapshots.read(rel)
    assert stored is not None, f"no snapshot of {module}'s public names; create it with:\n  {snapshots.UPDATE_COMMAND}"
    before = stored.split()
    gone = [n for n in before if n not in now]
    new = [n for n in now if n not in before]
    assert not gone, (f"{module}: public name(s) {gone} disappeared. A renamed public name keeps a deprecated "
                      f"alias under its old name (and in __all__)" + (f"; new: {new}" if new else ""))
    assert not new, (f"{module}: new public name(s) {new}. If intended, update the snapshots with:\n  "
                     f"{snapshots.UPDATE_COMMAND}")


def test_cli_help(surface):
    texts = {}
    for name, h in surface["cli"].items():
        texts[f"{name}.txt"] = f"$ {' '.join(h['argv'])}  (exit {h['exit']})\n{h['text']}"
    snapshots.check_folder("cli", texts, "the CLI help")
