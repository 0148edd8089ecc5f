"""Every upstream-ready diff applies to the pristine Python tree of each vLLM release it names (base and
also_applies_to): `git apply --check`, apply, `git apply --reverse --check`, and every changed .py compiles.
The trees come from upstream's own released `vllm` wheels (downloaded once, cached outside the repo)."""

import pytest

from vllm_rlpatch.tools import upstream

CASES = [(p, v) for p in upstream.load_all() for v in p.bases()]


@pytest.mark.parametrize("p,version", CASES, ids=[f"{p.name}@{v}" for p, v in CASES])
def test_diff_applies_to_pristine_source(p, version):
    r = upstream.check(p, version)
    assert any(s.startswith("apply ") for s in r["steps"]) and any(s.startswith("reverse-check") for s in r["steps"])
    assert r["compiled"], r


def test_pristine_tree_is_upstreams_wheel():
    """The base tree is the released `vllm` wheel's (its _version.py names the version)."""
    for v in sorted({p.base for p in upstream.load_all()}):
        tree = upstream.pristine_tree(v)
        assert v in (tree / "vllm" / "_version.py").read_text()
