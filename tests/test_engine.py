"""Real vllm.LLM engines on CPU: the plugin runs in every vLLM process, changes logprobs_mode unless the
user set it, fires weight-update events, composes worker extensions; the kill switch restores stock.

Each scenario is one engine in a subprocess (its full multi-process log is the evidence)."""

import math
import os

import pytest

from support.env import NEWEST_CI, amx_host, amx_sigill_here, model_path
from support.runs import run_engine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """vllm.LLM(model) with CPU sizing only (dtype, small KV cache, eager), default start method."""
    return run_engine(tmp_path_factory.mktemp("default"), {
        "engine": {"model": model_path()}, "logprobs_probe": True, "reload": True,
        "rpc": ["rlpatch_ping", "rlpatch_weight_version"], "rpc_after_reload": ["rlpatch_weight_version"]})


@pytest.fixture(scope="module")
def disabled_run(tmp_path_factory):
    # On an AMX host stock vLLM 0.32 cannot generate at all (SIGILL; see test_cpu_amx.py): start it only.
    return run_engine(tmp_path_factory.mktemp("disabled"), {
        "engine": {"model": model_path()}, "logprobs_probe": not amx_sigill_here(), "rpc": ["rlpatch_ping"]},
        VLLM_RLPATCH_ENABLED="0")


def expected_applied(version: str) -> set[str]:
    from packaging.version import Version

    v = Version(version.split("+")[0])
    out = {"weight_events", "worker_extension", "rl_defaults", "fp32_lm_head", "sampling_support", "kv_cache_pin",
           "prefix_cache", "refit_guard", "refit_http"}
    if v < Version("0.27"):
        out.add("wake_order_guard")
    if v < Version("0.22"):
        out.add("async_preempt_discard")
    if v < Version("0.28"):
        out.add("mq_bind_retry")
    if v < Version("0.29"):
        out.add("tcpstore_port")
    if amx_host():  # gated by its probe on every version (test_cpu_amx.py)
        out.add("cpu_amx_permission")
    return out


def _assert_processed(probe):
    # top_k=3 with 8 logprobs requested: in the processed distribution 5 of 8 are -inf at every position
    # (more survive only on exact bf16 ties) and, where some are -inf, the finite ones carry all the mass.
    assert probe["neg_inf"] >= probe["positions"] * 3, probe
    assert probe["mass_positions"] >= probe["positions"] * 0.8, probe
    assert probe["min_mass"] > 0.999 and probe["max_mass"] < 1.001, probe


def _assert_raw(probe):
    assert probe["neg_inf"] == 0, probe
    assert probe["max_mass"] < 0.9999, probe


def test_summary_from_every_vllm_process(default_run, version):
    default_run.check()
    s = default_run.summaries()
    pids = {x["pid"] for x in s}
    roles = {x["role"] for x in s}
    assert len(pids) >= 2, default_run.log[-4000:]
    assert {"frontend", "engine_core", "worker"} <= roles, roles
    for x in s:
        assert x["vllm"] == version and x["failed"] == ""
        assert set(x["applied"].split(",")) == expected_applied(version), x
    files = default_run.status_files()
    assert {str(f["pid"]) for f in files} >= pids  # side channel agrees with the log


def test_plain_llm_with_no_arguments_loads_the_plugin_everywhere(tmp_path, version):
    """What a user writes: vllm.LLM(model). One argument stays: stock vLLM refuses to start unless
    gpu_memory_utilization (0.92) of *host* memory is free on CPU, which a machine already running the
    test suite cannot promise. No generate: vLLM's default torch.compile on a 2-core CPU can outlast its
    RPC timeout; the sized engine above samples. torch.compile (what a user gets) is on for the newest CI
    version; elsewhere the engine is eager (`enforce_eager=True`, with dynamo off vLLM's default compilation
    config refuses to start), which does not change what is checked here: the plugin is in every process and
    the defaults are applied before the model runner compiles anything (CI time: compiling costs ~70 s)."""
    compile_on = version.split("+")[0] == NEWEST_CI
    bare = {"gpu_memory_utilization": 0.5, **({} if compile_on else {"enforce_eager": True})}
    run = run_engine(tmp_path, {"bare": True, "engine": {"model": model_path()}, "rpc": ["rlpatch_ping"],
                                "bare_kwargs": bare},
                     TORCHDYNAMO_DISABLE="0" if compile_on else "1")
    r = run.check()
    assert r["logprobs_mode"] == "processed_logprobs"
    s = run.summaries()
    assert len({x["pid"] for x in s}) >= 2 and {"frontend", "engine_core", "worker"} <= {x["role"] for x in s}
    assert r["rpc:rlpatch_ping"][0]["vllm"] == version


def test_logprobs_are_processed_by_default(default_run):
    r = default_run.check()
    assert r["logprobs_mode"] == "processed_logprobs"
    _assert_processed(r["probe"])


def test_worker_extension_is_live_in_the_worker(default_run):
    r = default_run.check()
    (ping,) = r["rpc:rlpatch_ping"]
    assert ping["role"] == "worker" and ping["pid"] != r["pid"] and "rl_defaults" in ping["applied"]


def test_weight_update_event_counts_each_reload_once_per_side(default_run):
    r = default_run.check()
    assert r["rpc:rlpatch_weight_version"] == [0]
    assert r["frontend_weight_version"] == 2  # two collective_rpc("reload_weights")
    assert r["after:rlpatch_weight_version"] == [2]  # reload_weights -> model.load_weights nested: once
    assert default_run.log.count("via reload_weights") == 2
    assert default_run.log.count("via collective_rpc:reload_weights") == 2


def test_kill_switch_gives_stock_vllm_everywhere(disabled_run):
    r = disabled_run.check()
    assert r["logprobs_mode"] == "raw_logprobs" and r["worker_extension_cls"] == ""
    if "probe" in r:
        _assert_raw(r["probe"])
    assert "error" in r["rpc:rlpatch_ping"]
    s = disabled_run.summaries()
    assert len({x["pid"] for x in s}) >= 2
    assert all(x["applied"] == "" for x in s)
    for f in disabled_run.status_files():
        assert {p["state"] for p in f["patches"]} == {"disabled"}


@pytest.fixture(scope="module")
def explicit_fork_run(tmp_path_factory):
    """One engine for two independent checks (CI time): the user's explicit raw_logprobs and worker extension
    are kept, and the status is reported under the fork start method (workers forked, not spawned)."""
    return run_engine(tmp_path_factory.mktemp("explicit-fork"), {
        "engine": {"model": model_path("qwen2-tiny"), "logprobs_mode": "raw_logprobs",
                   "worker_extension_cls": "helpers_ext.FrameworkExtension"},
        "logprobs_probe": True,
        "rpc": ["framework_hello", "rlpatch_ping", "framework_load_weights", "rlpatch_weight_version"],
        "rpc_args": {"framework_load_weights": [model_path("qwen2-tiny") + "/model.safetensors"]}},
        VLLM_WORKER_MULTIPROC_METHOD="fork")


def test_explicit_raw_and_user_extension_are_respected(explicit_fork_run):
    run = explicit_fork_run
    r = run.check()
    assert r["logprobs_mode"] == "raw_logprobs"
    _assert_raw(r["probe"])
    assert r["worker_extension_cls"] == "vllm_rlpatch.refit.worker_ext.with:helpers_ext:FrameworkExtension"
    assert r["rpc:framework_hello"][0]["has_rlpatch"] is True
    assert r["rpc:rlpatch_ping"][0]["role"] in ("worker", "forked:engine_core")
    assert "was set explicitly and is kept" in run.log
    # A trainer-style direct model.load_weights in the worker: the event fires only if the load succeeded
    # (vLLM 0.32 CPU rejects it: its parameters were repacked for the CPU kernels after loading).
    (lw,) = r["rpc:framework_load_weights"]
    assert r["rpc:rlpatch_weight_version"] == [1 if lw["ok"] else 0], lw


def test_status_reported_under_fork_start_method(explicit_fork_run):
    run = explicit_fork_run
    r = run.check()
    s = run.summaries()
    assert len({x["pid"] for x in s}) >= 2, run.log[-4000:]
    ping = r["rpc:rlpatch_ping"][0]
    assert ping["pid"] != r["pid"]
    assert any(x["pid"] == str(ping["pid"]) for x in s), "the worker's pid must have reported a status"


def test_async_llm_gets_the_defaults_and_counts_async_updates(tmp_path):
    import json
    import subprocess
    import sys

    from support.env import SCRIPTS, clean_env

    p = subprocess.run([sys.executable, str(SCRIPTS / "run_async_engine.py"), model_path()], capture_output=True,
                       text=True, timeout=600, env=clean_env(), cwd=str(tmp_path))
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-5000:]
    r = json.loads(lines[-1][7:])
    assert r["logprobs_mode"] == "processed_logprobs"
    assert r["neg_inf"] >= r["positions"] * 3
    assert r["frontend_weight_version"] == 1 and r["worker_weight_version"] == [1]
