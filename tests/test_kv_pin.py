"""KV-cache pin: `vllm-rlpatch kv-pin` sizing (simulated allocator), the `kv_cache_pin` patch on real vLLM
CPU (which honours kv_cache_memory_bytes), doctor's report, bad input, and the level-2 wake-order guard.

Sleep mode is CUDA-only: the real sleep -> trainer reserve -> wake cycle runs in benchmarks/gpu/kv_pin.py
(results in benchmarks/results/kv_pin-*.json)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from support.env import clean_env, model_path
from support.kvpin_sim import GiB, SimDevice, SimOOM
from support.runs import run_engine

from vllm_rlpatch import envs
from vllm_rlpatch.tools import kvpin


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _cli(argv, dev, capsys):
    rc = kvpin.main(argv, backend=dev)
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------------------------------------
# Sizing logic against the simulated allocator
def test_unpinned_engine_fails_to_wake_next_to_the_trainer_and_the_pin_wakes(capsys, tmp_path):
    """The seed's failure on the simulation: an engine sized by gpu_memory_utilization at start-up cannot map
    its KV cache again while the trainer holds its reserve; kv-pin's value can, and is the largest that can."""
    dev = SimDevice()
    eng = dev.start(None)
    eng.generate(8)
    eng.sleep(1)
    reserve = dev.hold(60 * GiB)
    with pytest.raises(SimOOM, match="cumem_allocator.cpp"):
        eng.wake_up()
    dev.release(reserve)
    eng.shutdown()

    rc, out, err = _cli(["--model", "m", "--trainer-reserve-gib", "60", "--json", str(tmp_path / "r.json")], dev, capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    c = dev.cfg
    non_kv = c["context"] + c["weights"] + c["runtime"] + c["activations"]
    room = dev.total - 1 * GiB - non_kv - 60 * GiB - 2 * GiB
    assert r["pin"] == room // kvpin.ALIGN * kvpin.ALIGN and r["budget"]["engine_without_kv"] == non_kv
    assert [a["ok"] for a in r["attempts"]] == [True] and r["attempts"][0]["outputs_identical"] is True
    assert r["kv_tokens"] == r["attempts"][0]["kv_tokens"] > 0
    assert f"VLLM_RLPATCH_KV_CACHE_BYTES={r['pin']}" in out and "-> wake_up ok" in out
    assert "[kv-pin" in err  # progress lines
    # the largest, up to the margin: 3 GiB more (past the 2 GiB margin) does not wake
    bigger = dev.start(r["pin"] + 3 * GiB)
    bigger.generate(8)
    bigger.sleep(1)
    h = dev.hold(60 * GiB)
    with pytest.raises(SimOOM):
        bigger.wake_up()
    dev.release(h)
    bigger.shutdown()
    assert dev.used() == 1 * GiB  # nothing leaked by the command


def test_result_is_cached_per_reserve_and_refresh_measures_again(capsys):
    dev = SimDevice()
    rc, out1, _ = _cli(["--model", "m", "--trainer-reserve-gib", "40"], dev, capsys)
    n = len(dev.starts)
    assert rc == 0 and n == 2  # measure + verify
    rc, out2, err2 = _cli(["--model", "m", "--trainer-reserve-gib", "40", "--quiet"], dev, capsys)
    assert rc == 0 and len(dev.starts) == n and "(cached result)" in out2 and err2 == ""
    assert out1.splitlines()[0] + " (cached result)" == out2.splitlines()[0]
    _cli(["--model", "m", "--trainer-reserve-gib", "41", "--quiet"], dev, capsys)  # another reserve: measured
    assert len(dev.starts) == n + 2
    _cli(["--model", "m", "--trainer-reserve-gib", "40", "--quiet", "--refresh"], dev, capsys)
    assert len(dev.starts) == n + 4


def test_a_failed_wake_steps_down_once(capsys, tmp_path):
    """Something allocates at wake-up that measurement cannot see (2.5 GiB: more than the margin, less than a 10 % step)."""
    dev = SimDevice(wake_transient=int(2.5 * GiB))
    rc, out, err = _cli(["--model", "m", "--trainer-reserve-gib", "60", "--json", str(tmp_path / "r.json")],
                        dev, capsys)
    assert rc == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    first, second = r["attempts"]
    assert not first["ok"] and "cumem_allocator.cpp" in first["error"] and second["ok"]
    assert r["pin"] == second["pin"] == kvpin.step_down(first["pin"], 2 * GiB) < first["pin"]
    assert "stepped down once" in out and "wake-up FAILED" in err
    assert dev.used() == 1 * GiB


def test_no_pin_that_wakes_is_an_error_with_both_attempts(capsys, tmp_path):
    dev = SimDevice(wake_transient=40 * GiB)
    rc, out, err = _cli(["--model", "m", "--trainer-reserve-gib", "60", "--json", str(tmp_path / "r.json")],
                        dev, capsys)
    assert rc == 1 and out == ""
    assert "no verified pin" in err and "raise --margin-gib or --trainer-reserve-gib" in err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["pin"] is None and [a["ok"] for a in r["attempts"]] == [False, False]
    assert not list((tmp_path / "cache").rglob("*.json"))  # a failure is not cached


def test_no_room_for_any_kv_cache(capsys):
    dev = SimDevice()
    rc, out, err = _cli(["--model", "m", "--trainer-reserve-gib", "120"], dev, capsys)
    assert rc == 1 and "no room for a KV cache" in err and "trainer reserve 120.00 GiB" in err
    assert len(dev.starts) == 1  # measured, nothing verified


def test_rollout_tokens_larger_than_the_pin_warns(capsys, tmp_path):
    dev = SimDevice(per_token=1 << 20)  # 1 MiB per token: ~60k tokens in the pin
    rc, out, _ = _cli(["--model", "m", "--trainer-reserve-gib", "60", "--max-concurrent-seqs", "256",
                       "--seq-len", "4096", "--json", str(tmp_path / "r.json")], dev, capsys)
    r = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and r["rollout_tokens"] == 256 * 4096 and r["kv_tokens"] < 256 * 4096
    assert "WARNING: the KV cache holds" in out and "VLLM_RLPATCH_ROLLOUT_TOKENS=1048576" in out
    rc, out, _ = _cli(["--model", "m", "--trainer-reserve-gib", "60", "--rollout-tokens", "1000"], dev, capsys)
    assert rc == 0 and "(cached result)" in out and "WARNING" not in out  # checked against the cached capacity


@pytest.mark.parametrize("argv, message", [
    (["--trainer-reserve-gib", "lots"], "--trainer-reserve-gib must be a number of GiB"),
    (["--margin-gib", "-1"], "--margin-gib must be >= 0"),
    (["--max-concurrent-seqs", "8"], "--max-concurrent-seqs and --seq-len go together"),
    (["--rollout-tokens", "many"], "is not a token count"),
    (["--rollout-tokens", "5", "--max-concurrent-seqs", "8", "--seq-len", "9"], "not both"),
    (["--level", "3"], "invalid choice"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        kvpin.main(["--model", "m", *argv], backend=SimDevice())
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_cli_without_a_gpu_or_with_a_missing_model_says_so():
    p = subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", "kv-pin", "--model", "/nonexistent/model"],
                       capture_output=True, text=True, env=clean_env(), timeout=120)
    assert p.returncode == 2 and "--model /nonexistent/model: no such directory" in p.stderr, p.stderr
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        pytest.skip("no torch in this environment")
    if has_cuda:
        pytest.skip("this machine has a GPU")
    p = subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", "kv-pin", "--model", model_path()],
                       capture_output=True, text=True, env=clean_env(), timeout=300)
    assert p.returncode == 2 and "kv-pin needs a CUDA GPU" in p.stderr, p.stderr[-2000:]


# ---------------------------------------------------------------------------------------------------------
# Sizes
@pytest.mark.parametrize("raw, value", [("21474836480", 20 * GiB), ("20GiB", 20 * GiB), ("20 GiB", 20 * GiB),
                                        ("20.5GiB", int(20.5 * GiB)), ("20G", 20 * GiB), ("20g", 20 * 10**9),
                                        ("21.5GB", 21_500_000_000), ("512MiB", 512 << 20)])
def test_sizes(raw, value):
    assert envs.parse_size(raw) == value


@pytest.mark.parametrize("raw", ["", "abc", "0", "-1", "20PiB", "GiB", "1e9"])
def test_bad_sizes(raw):
    with pytest.raises(envs.EnvError):
        envs.parse_size(raw, "VLLM_RLPATCH_KV_CACHE_BYTES")


# ---------------------------------------------------------------------------------------------------------
# The kv_cache_pin patch on real vLLM (CPU honours kv_cache_memory_bytes)
BARE = {"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True, "gpu_memory_utilization": 0.5}
VLLM_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


def _vllm_tokens(log):
    m = VLLM_TOKENS.findall(log)
    assert m, log[-4000:]
    return int(m[-1].replace(",", ""))


@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    spec = {"engine": {"model": model_path()}, "bare": True, "bare_kwargs": BARE}
    return run_engine(tmp_path_factory.mktemp("pinned"), spec, VLLM_RLPATCH_KV_CACHE_BYTES="48MiB",
                      VLLM_RLPATCH_ROLLOUT_TOKENS="4096x256")


@pytest.mark.vllm
def test_env_pin_is_applied_and_its_capacity_logged(pinned):
    assert pinned.proc.returncode == 0, pinned.log[-4000:]
    tokens = _vllm_tokens(pinned.log)
    m = re.search(r"vllm-rlpatch: KV cache holds ([\d,]+) tokens \((\d+) blocks x (\d+), ([^;]+); ([^)]+)\)", pinned.log)
    assert m, pinned.log[-4000:]
    assert int(m.group(1).replace(",", "")) == tokens  # vLLM's own start-up figure
    assert m.group(4) == "48.00 MiB" and m.group(5) == "pinned by VLLM_RLPATCH_KV_CACHE_BYTES=48.00 MiB"
    assert "kv_cache_memory_bytes=50331648 (plugin, kv_cache_pin" in pinned.log


@pytest.mark.vllm
def test_a_pin_smaller_than_the_rollout_warns(pinned):
    assert re.search(r"WARNING.*vllm-rlpatch: the KV cache holds [\d,]+ tokens but the rollout keeps 1,048,576 "
                     r"in flight \(VLLM_RLPATCH_ROLLOUT_TOKENS\)", pinned.log), pinned.log[-4000:]


@pytest.mark.vllm
def test_without_the_patch_the_variable_does_nothing(tmp_path, pinned):
    spec = {"engine": {"model": model_path()}, "bare": True, "bare_kwargs": BARE}
    # (vLLM CPU's VLLM_CPU_KVCACHE_SPACE overrides any pin: here it only bounds the unpinned engine to 1 GiB)
    off = run_engine(tmp_path, spec, VLLM_RLPATCH_KV_CACHE_BYTES="48MiB", VLLM_RLPATCH_KV_CACHE_PIN="0",
                     VLLM_RLPATCH_ROLLOUT_TOKENS="4096x256", VLLM_CPU_KVCACHE_SPACE="1")
    assert off.proc.returncode == 0, off.log[-4000:]
    assert _vllm_tokens(off.log) > 10 * _vllm_tokens(pinned.log)  # vLLM's own sizing (1 GiB here), not 48 MiB
    assert "vllm-rlpatch: KV cache holds" not in off.log and "rollout keeps" not in off.log


def _doctor(*args, **env):
    p = subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", "doctor", "--json", "--model", model_path(), *args],
                       capture_output=True, text=True, env=clean_env(**env), timeout=300)
    return p


@pytest.mark.vllm
def test_doctor_estimates_the_capacity_and_flags_a_small_pin(pinned):
    p = _doctor(VLLM_RLPATCH_KV_CACHE_BYTES="48MiB", VLLM_RLPATCH_ROLLOUT_TOKENS="4096x256")
    assert p.returncode == 0, p.stderr[-3000:]
    eng = json.loads(p.stdout)["engine"]
    rows = {r["setting"]: r for r in eng["settings"]}
    assert rows["kv_cache_memory_bytes"]["value"] == 50331648 and rows["kv_cache_memory_bytes"]["by"] == "kv_cache_pin"
    assert rows["KV capacity (estimate)"]["value"] == f"{_vllm_tokens(pinned.log):,} tokens"
    assert rows["rollout tokens"]["value"] == "1,048,576" and "TOO SMALL" in rows["rollout tokens"]["reason"]
    assert "rollout keeps 1,048,576" in eng["warnings"][0]


@pytest.mark.vllm
def test_an_explicit_engine_argument_wins_over_the_variable():
    p = _doctor("--kv-cache-memory-bytes", "32M", VLLM_RLPATCH_KV_CACHE_BYTES="48MiB")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["setting"]: r for r in json.loads(p.stdout)["engine"]["settings"]}
    assert rows["kv_cache_memory_bytes"]["value"] == 32 << 20 and rows["kv_cache_memory_bytes"]["source"] == "user"
    assert "VLLM_RLPATCH_KV_CACHE_BYTES is not applied to this engine" in p.stderr


@pytest.mark.vllm
def test_a_bad_variable_is_a_clear_error():
    p = _doctor(VLLM_RLPATCH_KV_CACHE_BYTES="twenty gigs")
    assert p.returncode == 2 and "VLLM_RLPATCH_KV_CACHE_BYTES='twenty gigs' is not a size" in p.stderr


# ---------------------------------------------------------------------------------------------------------
# wake_order_guard: on the real Worker class (a bare instance: the check runs before anything touches a GPU)
GUARD = r"""
import json, torch
from vllm_rlpatch import plugin, registry
plugin.register_as("test")
st = {s.name: s.state for s in registry.status()}["wake_order_guard"]
from vllm.v1.worker.gpu_worker import Worker
from vllm_rlpatch.patches.wake_order_guard import WakeOrderError
calls = []
w = object.__new__(Worker)
class Backend:
    def resume(self, tags): calls.append(tags)
w._get_sleep_mode_backend = lambda: Backend()   # 0.25 (0.20 calls the CuMemAllocator: not reached when refused)
w._sleep_saved_buffers = {"rope.cos_sin_cache": torch.zeros(2)}
out = {"state": st}
try:
    Worker.wake_up(w, tags=["kv_cache"])
    out["kv_first"] = "not refused"
except WakeOrderError as e:
    out["kv_first"] = str(e)
except Exception as e:
    out["kv_first"] = "vllm: " + type(e).__name__
out["mapped_before_refusal"] = list(calls)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.vllm
@pytest.mark.parametrize("guard", ["1", "0"], ids=["guarded", "unguarded"])
def test_wake_order_guard_refuses_kv_cache_before_weights(version, guard):
    """Sleep mode needs CUDA, so this is the real Worker.wake_up on a bare instance; the GPU run
    (benchmarks/results/kv_pin-vllm0.25.1-h200.json) shows what unguarded vLLM does next: CUDA invalid argument."""
    from packaging.version import Version

    p = subprocess.run([sys.executable, "-c", GUARD], capture_output=True, text=True, timeout=300,
                       env=clean_env(VLLM_RLPATCH_WAKE_ORDER_GUARD=guard))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads([l for l in p.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    if Version(version) >= Version("0.27"):
        assert r["state"] == ("not_needed" if guard == "1" else "disabled")
        return
    if guard == "0":  # vLLM goes on: maps the KV pool and restores the saved buffers into the model
        assert r["state"] == "disabled" and "refused" not in r["kv_first"], r
        return
    assert r["state"] == "applied"
    assert "wake_up(tags=['kv_cache']) refused" in r["kv_first"] and "wake_up(tags=['weights'])" in r["kv_first"]
    assert r["mapped_before_refusal"] == []
