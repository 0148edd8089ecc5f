"""A stranger's model through every command-line tool, with default arguments.

The model (tests/reference.py:byte_model) has 512 positions and a byte-level tokenizer, so the embedded
prompts (~850 tokens) do not fit its context and our default max_model_len (1024) exceeds it. Every tool must
size the engine to the model, fit its prompts and say so, and never crash on seeded sampling (chunked prefill
splitting a prompt kills vLLM's CPU runner on seeded requests). Bad input ends in one line and exit 2,
before any engine starts.

These tests exercise our CLIs, not a vLLM behaviour, so they run on the newest CI version only (CI time)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import reference as R
from support.env import clean_env, skip_unless_newest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _newest_only(version):
    skip_unless_newest(version, "the command-line tools on a user's model")


def _cli(*args, cwd=None, timeout=900, **env):
    return subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=clean_env(**env), cwd=cwd)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return R.byte_model(str(tmp_path_factory.mktemp("user") / "byte-512"))


def _one_line_exit_2(p, *words, after_vllm_logs=False):
    """Exit 2 and one line of ours on stderr (the only line, unless vLLM was imported first: then its own log
    lines come before ours, and ours is the last)."""
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    assert err and "Traceback" not in p.stderr, p.stderr[-3000:]
    ours = [ln for ln in err if ln.startswith("vllm-rlpatch ")]
    assert len(ours) == 1 and ours[0] == err[-1], p.stderr[-3000:]
    assert after_vllm_logs or len(err) == 1, p.stderr[-3000:]
    for w in words:
        assert w in err[-1], (w, err[-1])
    return err[-1]


def test_parity_sizes_the_engine_and_fits_the_prompts(byte_model, tmp_path):
    # two of the five configurations: the sizing and the fitting are the same for every one (CI time)
    p = _cli("parity", "--model", byte_model, "--configs", "stock,all", "--json", tmp_path / "r.json", cwd=tmp_path)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["engine_args"]["max_model_len"] == 512  # min(our 1024, the model's 512)
    assert rep["engine_args"]["enable_chunked_prefill"] is False
    assert "prompts fitted to the context" in p.stdout and "prompts fitted" in rep["prompt_note"]
    for name, cfg in rep["configs"].items():
        for run in cfg["runs"]:
            for phase in ("before_refit", "after_refit"):
                for s in run[phase]["samples"]:
                    assert len(s["prompt_token_ids"]) + len(s["token_ids"]) <= 512, name
                    assert len(s["token_ids"]) == 48


def test_rollout_dump_and_diff_with_seeds(byte_model, tmp_path):
    """Seeded sampling on the CPU with prompts near the context length: what crashed vLLM's CPU runner when
    chunked prefill split a prompt (`CPU Generator does not use offset`)."""
    p = _cli("rollout-dump", "--model", byte_model, "--seeds", "1,2,3,4", "--out", tmp_path / "d{seed}.jsonl")
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "d1.jsonl").read_text().splitlines()]
    assert rows and all(len(r["prompt_token_ids"]) + r["length"] <= 512 for r in rows)
    assert rows[0]["engine"]["max_model_len"] == 512
    d = _cli("rollout-diff", tmp_path / "d1.jsonl", tmp_path / "d2.jsonl", "--", tmp_path / "d3.jsonl",
             tmp_path / "d4.jsonl", "--json", tmp_path / "diff.json", timeout=300)
    assert d.returncode == 0, d.stderr[-3000:]
    assert "statistics differ beyond the run-to-run spread" in d.stdout


def test_rollout_prompts_are_fitted_with_the_models_tokenizer(byte_model, tmp_path):
    """No engine: the fitting itself. The embedded prompts get fewer sentences, a user's prompts are cut to
    their last tokens, and the note says how many (what rollout-dump prints)."""
    from transformers import AutoTokenizer

    from vllm_rlpatch.tools import rollout

    tok = AutoTokenizer.from_pretrained(byte_model)
    fitted, note = rollout._fit(byte_model, None, 4, 128, 64)
    n_tokens = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(tok(p)["input_ids"]) for p in fitted]
    assert note and "prompts fitted" in note and "instead of 6" in note and max(n_tokens) <= 64, (note, n_tokens)
    long = ["x" * 100, "short", "y" * 70]
    fitted, note = rollout._fit(byte_model, long, None, 128, 64)
    assert note.startswith("2 of 3 prompts") and "cut to their last 64 tokens" in note
    assert fitted[1] == "short" and fitted[0]["prompt_token_ids"] == tok("x" * 100)["input_ids"][-64:]


def test_the_reported_crash_case_runs(tmp_path):
    """As reported: the embedded model (1024 positions) with the user's max_model_len 512 and a large batch
    budget: seeded samples of prompts near 512 tokens, which chunked prefill would split."""
    p = _cli("rollout-dump", "--engine-args", '{"max_model_len": 512, "max_num_batched_tokens": 8192}',
             "--prompts", _long_prompts(tmp_path), "--n", "2", "--seeds", "1,2", "--out", tmp_path / "r{seed}.jsonl")
    assert p.returncode == 0, p.stderr[-6000:]
    rows = [json.loads(x) for x in (tmp_path / "r1.jsonl").read_text().splitlines()]
    assert rows[0]["engine"]["max_model_len"] == 512 and len(rows) == 8
    assert max(len(r["prompt_token_ids"]) for r in rows) > 300  # long prompts, several per step


def _long_prompts(tmp_path):
    from vllm_rlpatch.tools.parity import make_prompts

    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(make_prompts(4, 0, 3, sentences=40)) + "\n")
    return f


def test_the_crash_it_avoids_is_real_on_stock_vllm(byte_model, tmp_path):
    """The same seeded requests with vLLM's own chunked prefill (our sizing undone through --engine-args is
    refused, so this drives vLLM directly): stock vLLM 0.32 CPU dies with the generator-offset error."""
    code = (
        "import vllm, sys\n"
        f"llm = vllm.LLM({byte_model!r}, dtype='bfloat16', max_model_len=512, kv_cache_memory_bytes=256<<20,"
        " enforce_eager=True, gpu_memory_utilization=0.5, enable_chunked_prefill=True, max_num_batched_tokens=256)\n"
        "p = vllm.SamplingParams(temperature=0.7, max_tokens=8, seed=1)\n"
        "try:\n"
        "    llm.generate(['x' * 400, 'y' * 400], [p, p], use_tqdm=False)\n"
        "    print('NO CRASH')\n"
        "except Exception as e:\n"
        "    print('CRASH', type(e).__name__)\n"
    )
    p = subprocess.run([sys.executable, "-c", "if __name__ == '__main__':\n" +
                        "\n".join("    " + ln for ln in code.splitlines())],
                       capture_output=True, text=True, timeout=600, env=clean_env(VLLM_RLPATCH_PROFILE="stock"))
    log = p.stdout + p.stderr
    assert "CRASH" in p.stdout and "CPU Generator does not use offset" in log, log[-4000:]


def test_doctor_and_demo_on_the_model(byte_model, tmp_path):
    d = _cli("doctor", "--model", byte_model)
    assert d.returncode == 0, d.stderr[-3000:]
    assert d.stdout.startswith("vllm-rlpatch "), d.stdout[:500]  # vLLM's INFO lines went to stderr
    assert "engine settings for" in d.stdout
    m = _cli("demo", "--model", byte_model, cwd=tmp_path)
    assert m.returncode == 0, (m.stdout + m.stderr)[-5000:]
    assert "weight version after one reload" in m.stdout


def test_a_hub_id_resolves_offline_from_the_local_cache(byte_model, tmp_path):
    """org/name found in HF_HUB_CACHE (the hub's cache layout: refs/main -> snapshots/<commit>), no network."""
    hub = tmp_path / "hub"
    snap = hub / "models--acme--byte-512" / "snapshots" / "0123abcd"
    shutil.copytree(byte_model, snap)
    (hub / "models--acme--byte-512" / "refs").mkdir()
    (hub / "models--acme--byte-512" / "refs" / "main").write_text("0123abcd")
    d = _cli("doctor", "--json", "--model", "acme/byte-512", HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1")
    assert d.returncode == 0, d.stderr[-3000:]
    assert json.loads(d.stdout)["engine"]["model"] == str(snap)
    miss = _cli("doctor", "--model", "acme/not-here", HF_HUB_CACHE=str(hub))
    _one_line_exit_2(miss, "acme/not-here", "local Hugging Face cache", "--allow-download")


@pytest.mark.parametrize("args, words", [
    (["doctor", "--model", "/nonexistent"], ["/nonexistent", "no such directory"]),
    (["doctor", "--model", "llama-tinyy"], ["did you mean 'llama-tiny'"]),
    (["rollout-dump", "--model", "/nonexistent", "--out", "x.jsonl"], ["no such directory"]),
    (["parity", "--model", "/nonexistent"], ["no such directory"]),
    (["demo", "--model", "qwen-tiny"], ["did you mean 'qwen2-tiny'"]),
    (["kv-pin", "--model", "/nonexistent"], ["no such directory"]),
    (["parity", "--model", "BYTE", "--engine-args", '{"max_model_len": 4096}'], ["larger than the model's 512"]),
    (["rollout-dump", "--model", "BYTE", "--engine-args", '{"enable_chunked_prefill": true}', "--out", "x.jsonl"],
     ["enable_chunked_prefill", "CPU"]),
    (["parity", "--model", "BYTE", "--max-tokens", "600"], ["leaves no room for a prompt"]),
])
def test_bad_input_is_one_line_and_exit_2_before_any_engine(args, words, byte_model, tmp_path):
    p = _cli(*[byte_model if a == "BYTE" else a for a in args], cwd=tmp_path, timeout=300, HF_HUB_OFFLINE="1")
    _one_line_exit_2(p, *words)
    assert "EngineCore" not in p.stderr  # no engine was started


def test_a_configuration_vllm_rejects_is_one_line_of_ours(byte_model):
    """vLLM's own config validation (pydantic) rejects it: its traceback becomes our last line, exit 2."""
    p = _cli("doctor", "--model", byte_model, "--max-model-len", "4096", timeout=300)
    _one_line_exit_2(p, "vLLM rejects this engine configuration", after_vllm_logs=True)
    assert "EngineCore" not in p.stderr  # no engine was started
