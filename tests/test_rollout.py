"""rollout-dump / rollout-diff / bounds on real vLLM (small n: 6 prompts x 2 samples x 24 tokens).

Two engines per vLLM version: A = the plugin's defaults, seeds 1, 2, 3 and seed 1 again (determinism); B = a
planted difference (ignore_eos, 12 tokens: every sample truncated), seeds 1 and 4. The cross-version evidence
and the calibration (false-positive rate, power) are benchmarks/rollout_ab.py's, not CI's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.env import clean_env, model_path, skip_unless_newest

pytestmark = pytest.mark.vllm
SMALL = ["--embedded", "--num-prompts", "6", "--n", "2", "--temperature", "0.7", "--top-p", "0.9"]


def _cli(*args, timeout=600, **env):
    return subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=clean_env(**env))


@pytest.fixture(scope="module")
def dumps(tmp_path_factory, version):
    # a command-line tool whose logic does not depend on the vLLM version (benchmarks/rollout_ab.py has the
    # cross-version evidence)
    skip_unless_newest(version, "rollout-dump/rollout-diff on real engines")
    d = tmp_path_factory.mktemp("dumps")
    p = _cli("rollout-dump", *SMALL, "--max-tokens", "24", "--seeds", "1,2,3,1", "--out", d / "a-{run}-{seed}.jsonl")
    assert p.returncode == 0, p.stderr[-4000:]
    q = _cli("rollout-dump", *SMALL, "--max-tokens", "12", "--ignore-eos", "--seeds", "1,4", "--out",
             d / "b-{seed}.jsonl")
    assert q.returncode == 0, q.stderr[-4000:]
    return d, p.stderr


def _rows(path):
    return [json.loads(l) for l in path.read_text().splitlines()]


def test_dump_has_one_line_per_sample_with_everything(dumps, version):
    d, log = dumps
    rows = _rows(d / "a-0-1.jsonl")
    assert len(rows) == 12 and "seed 1: 6 prompts x 2" in log
    r = rows[0]
    for k in ("prompt_id", "prompt_token_ids", "token_ids", "logprobs", "finish_reason", "length", "eos", "vllm",
              "rlpatch", "engine", "sampling"):
        assert k in r, k
    assert r["vllm"] == version and "rl_defaults" in r["rlpatch"]["applied"]
    assert r["engine"]["logprobs_mode"].endswith("processed_logprobs")
    assert all(x["length"] == len(x["token_ids"]) == len(x["logprobs"]) for x in rows)
    assert {x["finish_reason"] for x in rows} <= {"stop", "length"}
    assert all(x["eos"] for x in rows if x["finish_reason"] == "stop")


def test_same_seed_same_samples_other_seed_other_samples(dumps):
    d, _ = dumps
    a, again, other = _rows(d / "a-0-1.jsonl"), _rows(d / "a-3-1.jsonl"), _rows(d / "a-1-2.jsonl")
    assert [x["token_ids"] for x in a] == [x["token_ids"] for x in again]
    assert [x["token_ids"] for x in a] != [x["token_ids"] for x in other]


def test_diff_flags_the_planted_difference_and_nothing_between_identical_sides(dumps, tmp_path):
    d, _ = dumps
    a = [d / f"a-{i}-{s}.jsonl" for i, s in ((0, 1), (1, 2), (2, 3))]
    b = [d / "b-1.jsonl", d / "b-4.jsonl"]
    p = _cli("rollout-diff", *a, "--", *b, "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png",
             "--bootstrap", 300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    st = r["stats"]
    assert st["truncation_rate"]["flag"] and st["truncation_rate"]["b"] == 1.0
    assert st["length_p90"]["b"] == 12  # (ignore_eos: EOS tokens may still be emitted, and are counted)
    assert "DIFFERENT" in p.stdout and "truncation_rate" in p.stdout.splitlines()[-1]
    assert any("different parameters" in w for w in r["warnings"])
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    p = _cli("rollout-diff", *a, "--", *a, "--json", tmp_path / "same.json", "--bootstrap", 200)
    same = json.loads((tmp_path / "same.json").read_text())["stats"]
    assert p.returncode == 0 and not any(v["flag"] for v in same.values())
    assert all(v["diff"] == 0 for v in same.values())


def test_reference_adds_token_mult_prob_error(dumps):
    d, _ = dumps
    a = [d / f"a-{i}-{s}.jsonl" for i, s in ((0, 1), (1, 2), (2, 3))]
    p = _cli("bounds", *a, "--metric", "token_mult_prob_error", "--reference", model_path(), "--margin", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    lo, hi = [float(x) for x in p.stdout.split("observed ")[1].split(" ")[0].split("..")]
    assert 1.0 <= lo <= hi < 1.05  # processed logprobs + fp32 head against the fp32 reference
    assert "rule    [min - 1.0 x range, max + 1.0 x range] over 3 measured runs" in p.stdout


def test_bounds_state_n_range_rule_and_warn_on_weak_evidence(dumps, tmp_path):
    d, _ = dumps
    a = [d / f"a-{i}-{s}.jsonl" for i, s in ((0, 1), (1, 2), (2, 3))]
    p = _cli("bounds", *a, "--metric", "length_mean", "--json", tmp_path / "b.json")
    assert p.returncode == 0, p.stderr
    b = json.loads((tmp_path / "b.json").read_text())
    assert b["n"] == 3 and b["seeds"] == [1, 2, 3] and b["floor"] <= b["min"] <= b["max"] <= b["ceiling"]
    assert b["floor"] == pytest.approx(b["min"] - 0.5 * (b["max"] - b["min"])) and not b["warnings"]
    p = _cli("bounds", d / "b-1.jsonl", d / "b-4.jsonl", "--metric", "truncation_rate")
    assert p.returncode == 0 and "n=2: fewer than 3 runs" in p.stdout and "zero spread" in p.stdout
    p = _cli("bounds", d / "a-0-1.jsonl", d / "a-3-1.jsonl", "--metric", "logprob_mean")
    assert "repeated seeds [1, 1]" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["rollout-diff", "A", "--", "B"], "A: no such file"),
    (["rollout-diff", "E1", "--", "E2"], "need >= 2 runs per side"),
    (["rollout-diff", "A1", "A2", "B1", "B2"], "separate the two sides with --"),
    (["rollout-diff", "A1", "A2", "--", "B1", "B2"], "A1: no such file"),
    (["bounds", "A1", "A2", "--metric", "speed"], "unknown metric 'speed'"),
    (["bounds", "A1", "--metric", "length_mean"], "A1: no such file"),
    (["bounds", "E1", "--metric", "length_mean"], "need >= 2 runs"),
    (["rollout-dump", "--seeds", "1,2", "--out", "x.jsonl"], "--out must contain {seed}"),
    (["rollout-dump", "--seeds", "1,1", "--out", "x-{seed}.jsonl"], "add {run}"),
    (["rollout-dump", "--prompts", "/nonexistent", "--out", "x.jsonl"], "no such file"),
    (["rollout-dump", "--engine-args", "[1]", "--out", "x.jsonl"], "is not a JSON object"),
])
def test_bad_input_is_exit_2_with_the_reason(args, message, tmp_path):
    for f in ("E1", "E2"):  # files that exist (their content is never read: the count is checked first)
        (tmp_path / f).write_text("")
    p = subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", *args], capture_output=True, text=True,
                       timeout=300, env=clean_env(), cwd=tmp_path)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]


def test_a_file_that_is_not_a_dump(tmp_path):
    for i in (1, 2):
        (tmp_path / f"x{i}.jsonl").write_text("hello\n")
    p = subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", "rollout-diff", "x1.jsonl", "x2.jsonl", "--",
                        "x1.jsonl", "x2.jsonl"], capture_output=True, text=True, timeout=300, env=clean_env(),
                       cwd=tmp_path)
    assert p.returncode == 2 and "not a JSON line (is this a rollout-dump file?)" in p.stderr
