"""Each upstream diff changes the same behaviour as its runtime patch, on the real vLLM of this environment.

For every diff whose bases include this environment's vLLM version: an overlay of the installed `vllm`
package with the diff applied (vllm_rlpatch.tools.upstream.overlay; the installed package is never modified) goes
first on PYTHONPATH, and
- the upstream test the PR adds fails on the installed (unfixed) vLLM and passes on the overlay, with the
  runtime patch switched off (the prefix-cache PR's end-to-end test shows the stale hits on the same engine);
- the runtime patch's own reproduction (the same stress harness as tests/test_port_races.py, or the same
  engine check) passes on the overlay with the runtime patch switched off.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from support import portrace
from support.env import clean_env, vllm_version
from vllm_rlpatch.tools import upstream

V = vllm_version().split("+")[0]
HERE = {p.name: p for p in upstream.load_all() if V in p.bases()}
pytestmark = pytest.mark.skipif(not HERE, reason=f"no upstream diff names vLLM {V} as a base")


def _installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def overlays(tmp_path_factory):
    made = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = upstream.overlay(HERE[name], _installed_vllm(), tmp_path_factory.mktemp(f"overlay-{name}"))
        return made[name]

    return get


def _pytest(test_file: Path, pythonpath: str | None, runtime_patch: str, timeout: float = 600):
    env = clean_env(**{f"VLLM_RLPATCH_{runtime_patch.upper()}": "0"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-m", "pytest", str(test_file), "-p", "no:cacheprovider", "-q",
                        "--rootdir", str(test_file.parent), "--timeout=300"],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=str(test_file.parent))
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("name", sorted(HERE), ids=sorted(HERE))
def test_upstream_test_fails_unfixed_and_passes_with_the_diff(name, overlays, tmp_path):
    p = HERE[name]
    for rel in (t for t in p.files_touched() if t.startswith("tests/")):
        plain = tmp_path / Path(rel).name
        plain.write_text((p.directory / Path(rel).name).read_text())
        rc, log = _pytest(plain, None, p.runtime_patch)
        if rc == 0 and " skipped" in log and " passed" not in log and " failed" not in log:
            # every test of the file skips on this host (the Triton top-p kernel's test needs a GPU): what the
            # diff fixes is shown by its CPU reproduction (Triton's interpreter) in the patch's own test
            pytest.skip(f"{rel}: every test skips here (it needs a GPU); on vLLM {V} CPU nothing to compare")
        # a failing test, or (a PR that adds an option or API) a test module that cannot import it
        assert rc in (1, 2) and (" failed" in log or " error" in log), \
            f"{rel} does not fail on unfixed vLLM {V}:\n{log[-4000:]}"
        ov = overlays(name)
        rc, log = _pytest(ov / rel, str(ov), p.runtime_patch)
        assert rc == 0 and " passed" in log, f"{rel} fails on vLLM {V} with the diff:\n{log[-4000:]}"


@pytest.mark.skipif("mq_bind_retry" not in HERE, reason="the MessageQueue diff is not for this vLLM")
@pytest.mark.skipif(Version(V) < Version("0.25"), reason="the stress runs on the newest base with the same MessageQueue code "
                    "(0.25.x; see test_port_races.MQ_STRESS); the PR test above runs here")
def test_mq_diff_fixes_the_stress_reproduction(overlays, monkeypatch):
    """tests/test_port_races.py::test_mq_stress_unpatched_fails, with the diff instead of the runtime patch."""
    ov = overlays("mq_bind_retry")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ov), os.environ.get("PYTHONPATH")) if p))
    r = portrace.mq_trial(procs=8, count=2, delay=1.0, patched=False)
    assert r["failed"] == 0 and r["delivered"] == r["created"] == 16 and r["corrupted"] == 0, r
    band = range(r["vllm_port"], r["vllm_port"] + 1000)
    assert r["ports_seen"] and all(p in band for p in r["ports_seen"]), r  # the backport honours VLLM_PORT


@pytest.mark.skipif("tcpstore_port" not in HERE, reason="the TCPStore diff is not for this vLLM")
def test_tcpstore_diff_fixes_the_stress_reproduction(overlays, monkeypatch):
    """tests/test_port_races.py::test_tcpstore_concurrent_inits_unpatched_collide, with the diff instead of
    the runtime patch: the rank-0 actor's store binds port 0 before its address is published."""
    ov = overlays("tcpstore_port")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ov), os.environ.get("PYTHONPATH")) if p))
    r = portrace.tcpstore_trial(procs=4, threads=8, hold=2.0, patched=False, vllm_port=portrace.free_band(64))
    assert r["how"] == ["create_dist_init_method()"], r
    assert r["inits"] == 32 and r["store_bind_failures"] == 0 and r["distinct_ports"] == 32, r


def test_overlay_leaves_the_installed_package_untouched(overlays):
    name = sorted(HERE)[0]
    p = HERE[name]
    ov = overlays(name)
    for rel in (t for t in p.files_touched() if t.startswith("vllm/")):
        installed = _installed_vllm().parent / rel
        patched = ov / rel
        assert installed.exists() and patched.exists()
        assert installed.read_bytes() != patched.read_bytes(), rel
        assert not os.path.samefile(installed, patched), rel
    for pf in p.patch_files:  # the installed package still takes the diff: it was not modified
        r = subprocess.run(["git", "apply", "--check", str(pf)], cwd=str(_installed_vllm().parent),
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
