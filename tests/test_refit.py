"""The refit API (vllm_rlpatch.refit.push_weights) and the refit_guard patch on real vLLM.

Each engine runs in tests/scripts/refit_engine.py (one process per configuration, shared by the tests of a
module): an update must give the same greedy tokens and logprobs as a fresh engine loaded from the same new
weights (exactly: a correct refit changes nothing else), agree with a float32 transformers reference within
bf16 tolerance, carry its weight version on every output, and every bad input must be refused with a clear
error while the old weights stay bit-identical (fingerprint) and the engine keeps serving. The unpatched
bugs are reproduced on stock vLLM (plugin disabled) in the same run.
"""

import json
import math

import pytest

from support import reference as R
from support.env import STOCK, model_path
from support.runs import run_script

pytestmark = pytest.mark.vllm

PROMPTS = ["the quick cat sees", "12 + 7 =", "count: 3 4 5", "the small model updates the"]
GREEDY = {"prompts": PROMPTS, "sampling": {"temperature": 0.0, "max_tokens": 16, "logprobs": 0}}
EXT = "helpers_ext.FrameworkExtension"
# The plugin's engines here keep vLLM's bf16 head so that "equal to a fresh stock engine" can be exact
# (the fp32 head is tested in test_rl_correctness.py / test_parity.py).
BF16_HEAD = {"VLLM_RLPATCH_FP32_LM_HEAD": "0"}
# every class of bad input a trainer can send (see tests/scripts/refit_engine.py for what each one does)
BAD = ["unknown", "missing", "shape", "dtype", "nan", "inf", "duplicate", "empty", "not_tensor", "half_layer",
       "sender_stops"]
EXPECT = {  # case -> (error kind, engine state afterwards)
    "unknown": ("validation", "unchanged"), "missing": ("validation", "unchanged"),
    "shape": ("validation", "unchanged"), "dtype": ("validation", "unchanged"),
    "nan": ("validation", "unchanged"), "inf": ("validation", "unchanged"),
    "duplicate": ("validation", "unchanged"), "empty": ("validation", "unchanged"),
    "not_tensor": ("validation", "unchanged"), "half_layer": ("commit", "unchanged"),
    "sender_stops": ("transport", "unchanged"), "old_version": ("validation", "unchanged"),
    "asleep": ("refused", "unchanged"), "tied_mismatch": ("validation", "unchanged"),
    "vllm_reload": ("refused", "unchanged"),
}
WORDS = {"unknown": "did you mean", "missing": "not in the update", "shape": "shape", "dtype": "allow_cast",
         "nan": "NaN", "inf": "infinite", "duplicate": "appears 2 times", "empty": "no tensors",
         "not_tensor": "not a torch.Tensor", "half_layer": "received only part of their elements",
         "sender_stops": "did not arrive", "old_version": "not greater than", "asleep": "asleep",
         "tied_mismatch": "ties them", "vllm_reload": "finish_weight_update"}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("w")
    out = {}
    for name in ("llama-tiny", "qwen2-tiny"):
        out[name] = {"A": model_path(name),
                     "B": R.perturbed_copy(model_path(name), str(d / f"{name}-B"), scale=1.0, seed=7),
                     "C": R.perturbed_copy(model_path(name), str(d / f"{name}-C"), scale=1.0, seed=8)}
    return out


def _run(tmp_path, engine, weights_dirs, ops, tied=False, **env):
    spec = {"engine": engine, "weights": weights_dirs, "tied": tied, "ops": ops}
    f = tmp_path / "spec.json"
    f.write_text(json.dumps(spec))
    r, log = run_script("refit_engine.py", str(f), cwd=tmp_path, **env)
    r["log"] = log
    return r["ops"] | {"_log": log}


def _gen(name):
    return {"op": "generate", "name": name, **GREEDY}


def _fp(name):
    return {"op": "fingerprint", "name": name}


def _snap(name):
    """A copy of every reachable tensor of the model, kept in the worker (helpers_ext.framework_snapshot)."""
    return {"op": "rpc", "name": name, "method": "framework_snapshot"}


def _eq(name):
    """torch.equal of every reachable tensor with the last snapshot's copy."""
    return {"op": "rpc", "name": name, "method": "framework_equal_to_snapshot"}


def _arm(name, where):
    """The next refit fails at `where` (VLLM_RLPATCH_FAULT_INJECTION=1 in this engine)."""
    return {"op": "rpc", "name": name, "method": "rlpatch_refit_inject_fault", "args": [where]}


def _bad_ops(cases):
    ops = []
    for b in cases:
        ops += [{"op": "push", "name": f"bad_{b}", "bad": b}, _eq(f"eq_{b}")]
    return ops


def _equal(run, name):
    (r,) = run[name]["result"]
    return r["equal"], r


# ------------------------------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def main(tmp_path_factory, weights):
    """llama-tiny with the plugin and a framework's own worker extension (composed with ours)."""
    w = weights["llama-tiny"]
    ops = [_gen("g0"), _fp("fp0"), _snap("snap0"), *_bad_ops(BAD), _gen("g0_after_bad"),
           {"op": "sleep", "name": "sleep"}, {"op": "push", "name": "bad_asleep"}, _eq("eq_asleep"),
           {"op": "wake_up", "name": "wake"},
           # vLLM's own weight update left open (start_weight_update without finish): refused, nothing written
           {"op": "rpc", "name": "open_reload", "method": "framework_open_vllm_reload"},
           {"op": "push", "name": "bad_vllm_reload"},
           {"op": "rpc", "name": "abort_reload", "method": "framework_abort_vllm_reload"}, _eq("eq_vllm_reload"),
           _gen("g_after_vllm_reload"),
           # 16 KiB buckets: most tensors are larger and travel alone in a segment of their own size
           {"op": "push", "name": "push_B", "kw": {"bucket_bytes": 16 << 10}}, {"op": "version", "name": "v_B"},
           _gen("g_B"), _fp("fp_B"), _snap("snap_B"),
           {"op": "push", "name": "bad_old_version", "bad": "old_version"}, _eq("eq_old_version"),
           {"op": "push", "name": "direct_nan", "bad": "direct_nan"}, _eq("eq_direct_nan"),
           # a fault after the first write, with no backup (validate-then-write): mixed, requests refused
           _arm("arm_vtw", "after_first_write"),
           {"op": "push", "name": "vtw_fault", "weights": "C", "kw": {"guarantee": "validate-then-write"}},
           _gen("g_poisoned"),
           {"op": "push", "name": "push_C_direct", "weights": "C", "kw": {"mode": "direct", "version": 10}},
           {"op": "version", "name": "v_C"}, _gen("g_C"),
           {"op": "rpc", "name": "per_param", "method": "framework_load_per_param",
            "args": [w["B"] + "/model.safetensors"]},
           {"op": "version", "name": "v_per_param"}, _gen("g_per_param"),
           {"op": "rpc", "name": "two_calls", "method": "framework_reload_in_two_calls",
            "args": [w["C"] + "/model.safetensors"]}, _gen("g_two_calls"),
           {"op": "push", "name": "push_B_dist", "kw": {"transport": "dist", "bucket_bytes": 256 << 10}},
           _gen("g_B_dist"), {"op": "version", "name": "v_B_dist"},
           # faults on real vLLM: before the first write (a rank's prepare fails) and after it, with the
           # rollback backup forced (restored bit-identically)
           _snap("snap_12"), _arm("arm_prepare", "prepare"),
           {"op": "push", "name": "fault_prepare", "weights": "C"}, _eq("eq_fault_prepare"), _gen("g_fault_prepare"),
           _arm("arm_rb", "after_first_write"),
           {"op": "push", "name": "fault_rollback", "weights": "C", "kw": {"guarantee": "rollback"}},
           _eq("eq_fault_rollback"), _gen("g_fault_rollback"),
           # one update in three calls (q, k, v of a layer in different parts): one version bump
           {"op": "session", "name": "sess_C", "weights": "C", "parts": 3}, {"op": "version", "name": "v_sess"},
           _gen("g_sess"), _snap("snap_13"),
           {"op": "session", "name": "sess_abort_rb", "weights": "B", "parts": 3, "abort_after": 2},
           _eq("eq_sess_abort_rb"), _gen("g_sess_abort_rb"),
           {"op": "session", "name": "sess_abort_vtw", "weights": "B", "parts": 3, "abort_after": 2,
            "kw": {"guarantee": "validate-then-write"}}, _gen("g_sess_mixed"),
           {"op": "push", "name": "push_B_final"}, {"op": "version", "name": "v_B_final"}, _gen("g_B_final"),
           # teardown check of the shared engine: the state its last update left, for whoever reads it next
           _fp("fp_end"), {"op": "version", "name": "v_end"}]
    return _run(tmp_path_factory.mktemp("main"), {"model": model_path(), "worker_extension_cls": EXT},
                {"B": w["B"], "C": w["C"]}, ops, VLLM_RLPATCH_FAULT_INJECTION="1", **BF16_HEAD,
                # the refit answers travel packed (one blob per rank) with this on: every update of this engine
                # then crosses the packed path (the other engines of the suite, the plain one)
                VLLM_ALLOW_INSECURE_SERIALIZATION="1")


@pytest.fixture(scope="module")
def stock(tmp_path_factory, weights):
    """Stock vLLM (plugin disabled) started on the new weights B: the fresh-engine reference, and the bugs."""
    w = weights["llama-tiny"]
    ops = [_gen("g_B"),
           {"op": "rpc", "name": "two_calls", "method": "framework_reload_in_two_calls",
            "args": [w["C"] + "/model.safetensors"]}, _gen("g_two_calls"),
           {"op": "rpc", "name": "per_param", "method": "framework_load_per_param",
            "args": [w["B"] + "/model.safetensors"]}, _gen("g_per_param")]
    return _run(tmp_path_factory.mktemp("stock"), {"model": w["B"], "worker_extension_cls": EXT}, {}, ops, **STOCK)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, weights):
    """The tied-embedding model: the trainer's state dict carries lm_head.weight (= embed_tokens.weight)."""
    w = weights["qwen2-tiny"]
    ops = [_gen("g0"), _snap("snap0"), {"op": "push", "name": "bad_tied_mismatch", "bad": "tied_mismatch"},
           _eq("eq_tied_mismatch"), {"op": "push", "name": "push_B"}, _gen("g_B"),
           {"op": "push", "name": "push_C", "weights": "C"}, _gen("g_C"), {"op": "version", "name": "v_C"},
           # a trainer's own sync, one tensor per RPC (OpenRLHF, SkyRL): B again, with a request between the k
           # and the q of layer 0's fused qkv
           {"op": "rpc_each", "name": "per_rpc", "method": "framework_load_one", "path": w["B"] + "/model.safetensors",
            "generate_after": "layers.0.self_attn.k_proj", "generate": _gen("between")},
           {"op": "version", "name": "v_per_rpc"}, _gen("g_per_rpc")]
    return _run(tmp_path_factory.mktemp("qwen"), {"model": model_path("qwen2-tiny"), "worker_extension_cls": EXT},
                {"B": w["B"], "C": w["C"]}, ops, tied=True, **BF16_HEAD)


@pytest.fixture(scope="module")
def stock_qwen(tmp_path_factory, weights):
    w = weights["qwen2-tiny"]
    ops = [{"op": "rpc", "name": "repacked", "method": "framework_repacked"}, _gen("g_B"),
           {"op": "reload", "name": "reload_C", "path": w["C"]}, _gen("g_C")]
    return _run(tmp_path_factory.mktemp("stock_qwen"), {"model": w["B"], "worker_extension_cls": EXT}, {}, ops,
                **STOCK)


# ------------------------------------------------------------------------------------------ helpers
def _reqs(run, name):
    r = run[name]
    assert "requests" in r, r
    return r["requests"]


def _same(a, b, tol=0.0):
    """Same tokens, and every logprob within tol (0: bit-identical)."""
    ra, rb = a, b
    assert [q["token_ids"] for q in ra] == [q["token_ids"] for q in rb]
    worst = max(abs(x - y) for qa, qb in zip(ra, rb) for x, y in zip(qa["logprobs"], qb["logprobs"]))
    assert worst <= tol, worst
    return worst


def _vs_reference(reqs, weights_dir):
    model = R.load(weights_dir)
    got, ref = [], []
    for q in reqs:
        got += q["logprobs"]
        ref += R.token_logprobs(model, q["prompt_token_ids"], q["token_ids"])
    return R.mismatch(got, ref)


def _versions(reqs):
    return {tuple(s[2:]) for q in reqs for s in q["spans"]}


# ------------------------------------------------------------------------------------------ tests
def test_a_pushed_update_equals_a_fresh_engine_on_the_new_weights(main, stock, weights):
    assert main["push_B"]["ok"], main["push_B"]
    rep = main["push_B"]["report"]
    assert rep["state"] == "committed" and rep["version"] == 1 and rep["transport"] == "shm"
    assert rep["bytes"] > 900_000 and rep["tensors"] == 21 and rep["gbps"] > 0
    assert rep["buckets"] >= 15  # tensors larger than the 16 KiB bucket went alone, none refused
    # CPU: vLLM repacks the weights, so the update goes through its layerwise reload, with a host backup
    assert rep["path"] == "layerwise" and rep["guarantee"] == "rollback", rep
    assert rep["backup"]["kind"] == "host" and rep["backup"]["bytes"] >= 0
    # the trainer digested the shared-memory pages while packing them (checksum + finite in one pass); the
    # worker trusts those very pages instead of reading them again
    assert {"metadata", "sender_digest", "finite", "backup_host", "strict_reload"} <= set(rep["checks"]), rep["checks"]
    assert "transport_fingerprint" not in rep["checks"]
    assert rep["peak_extra_host_bytes"] > 0 and rep["stages"]["worker_write"] > 0
    assert _same(_reqs(main, "g_B"), _reqs(stock, "g_B")) == 0.0  # a correct refit gives exactly 0
    m = _vs_reference(_reqs(main, "g_B"), weights["llama-tiny"]["B"])
    assert m["token_mult_prob_error"] <= 1.02, m
    assert main["v_B"]["version"] == 1 and _versions(_reqs(main, "g_B")) == {(1, 1)}
    assert _versions(_reqs(main, "g0")) == {(0, 0)}


def test_the_shared_engine_ends_in_the_state_its_last_update_left(main):
    """Many tests read this one engine's run. At its end (after faults, rollbacks, sessions, direct and
    per-parameter loads) it holds B again, bit for bit what the first push of B left (fingerprint of every
    parameter and buffer), at the version the last push set."""
    assert main["v_end"]["version"] == main["v_B_final"]["version"] == 14
    end = [w["fingerprint"] for w in main["fp_end"]["workers"]]
    assert end == [w["fingerprint"] for w in main["fp_B"]["workers"]]
    assert end != [w["fingerprint"] for w in main["fp0"]["workers"]]


def test_every_bad_input_is_refused_and_the_old_weights_stay(main):
    assert main["snap0"]["result"][0]["tensors"] > 0
    for case in BAD + ["asleep", "vllm_reload"]:
        r = main[f"bad_{case}"]
        assert not r["ok"], (case, r)
        kind, state = EXPECT[case]
        assert (r["kind"], r["state"]) == (kind, state), (case, r)
        assert WORDS[case] in r["message"], (case, r["message"])
        eq, detail = _equal(main, f"eq_{case}")
        assert eq, (case, detail)  # torch.equal: bit-identical old weights
    # ... and the engine kept serving exactly as before
    assert _same(_reqs(main, "g0_after_bad"), _reqs(main, "g0")) == 0.0
    assert main["abort_reload"]["result"][0]["ok"]  # vLLM's reload put back: the engine serves as before
    assert _same(_reqs(main, "g_after_vllm_reload"), _reqs(main, "g0")) == 0.0
    # a version that does not increase, after an update
    r = main["bad_old_version"]
    assert (r["kind"], r["state"]) == EXPECT["old_version"] and WORDS["old_version"] in r["message"]
    assert _equal(main, "eq_old_version")[0]


def test_half_loaded_layer_writes_nothing(main):
    r = main["bad_half_layer"]
    assert "qkv_proj" in r["message"] and "received only part" in r["message"], r
    assert r["report"]["guarantee"] == "rollback"  # a backup was ready; nothing needed restoring


def test_nan_is_refused_by_the_sender_before_any_rpc_even_in_direct_mode(main):
    r = main["direct_nan"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "validation", "unchanged"), r
    assert "NaN or infinite" in r["message"]
    assert not r["report"]["workers"]  # refused in the trainer's process: no worker saw it
    assert _equal(main, "eq_direct_nan")[0]


def test_a_fault_after_the_first_write_without_backup_leaves_mixed_until_a_good_update(main, weights):
    """validate-then-write: no backup, so a failure after the first write leaves a mix of old and new weights;
    the engine refuses requests until a complete update lands."""
    r = main["vtw_fault"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "mixed"), r
    assert r["report"]["guarantee"] == "validate-then-write" and r["report"]["backup"] is None
    assert "mixed-weights" in r["message"]
    assert "request refused" in main["g_poisoned"]["error"]
    good = main["push_C_direct"]
    assert good["ok"] and good["report"]["mode"] == "direct" and good["report"]["version"] == 10
    assert good["report"]["guarantee"] == "none"
    assert main["v_C"]["version"] == 10 and _versions(_reqs(main, "g_C")) == {(10, 10)}
    assert _vs_reference(_reqs(main, "g_C"), weights["llama-tiny"]["C"])["token_mult_prob_error"] <= 1.02


def test_faults_before_the_first_write_and_with_a_forced_backup(main):
    r = main["fault_prepare"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "unchanged"), r
    assert _equal(main, "eq_fault_prepare")[0]
    assert _same(_reqs(main, "g_fault_prepare"), _reqs(main, "g_B_dist")) == 0.0  # still serving, same weights
    r = main["fault_rollback"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "restored"), r
    assert r["report"]["guarantee"] == "rollback" and r["report"]["backup"]["kind"] == "host"
    assert "restore_compared" in r["report"]["checks"]
    eq, detail = _equal(main, "eq_fault_rollback")
    assert eq, detail  # restored bit-identically (torch.equal with the copy taken before)
    assert _same(_reqs(main, "g_fault_rollback"), _reqs(main, "g_B_dist")) == 0.0


def test_a_session_of_three_parts_is_one_update(main):
    r = main["sess_C"]
    assert r["ok"] and len(r["parts"]) == 3, r
    assert all(p["state"] == "writing" and p["version"] is None for p in r["parts"])
    assert r["report"]["state"] == "committed" and r["report"]["version"] == 13
    assert main["v_sess"]["version"] == 13  # one bump for three calls
    assert _same(_reqs(main, "g_sess"), _reqs(main, "g_C")) == 0.0  # the same weights C as the direct push
    assert _versions(_reqs(main, "g_sess")) == {(13, 13)}


def test_an_aborted_session_is_undone_or_mixed_as_its_guarantee_says(main, stock):
    r = main["sess_abort_rb"]
    assert r["aborted"] and len(r["parts"]) == 2 and r["report"]["state"] == "restored", r
    assert r["report"]["guarantee"] == "rollback"
    eq, detail = _equal(main, "eq_sess_abort_rb")
    assert eq, detail
    assert _same(_reqs(main, "g_sess_abort_rb"), _reqs(main, "g_sess")) == 0.0
    r = main["sess_abort_vtw"]
    assert r["aborted"] and r["report"]["state"] == "mixed" and r["report"]["guarantee"] == "validate-then-write", r
    assert "request refused" in main["g_sess_mixed"]["error"]
    assert main["push_B_final"]["ok"] and main["v_B_final"]["version"] == 14
    assert _same(_reqs(main, "g_B_final"), _reqs(stock, "g_B")) == 0.0


def test_trainer_style_per_parameter_load_weights_works(main, stock, version):
    """A framework's worker method calling model.load_weights once per tensor (q, k, v in separate calls):
    stock vLLM CPU crashes once weights were post-processed (0.25, 0.32); with the plugin it is one
    update, equal to a fresh engine, counted once."""
    (res,) = main["per_param"]["result"]
    assert res["ok"] and res["calls"] == 21, res
    assert main["v_per_param"]["version"] == 11  # one update for the whole RPC (21 calls), not 21
    assert _same(_reqs(main, "g_per_param"), _reqs(stock, "g_B")) == 0.0
    assert _versions(_reqs(main, "g_per_param")) == {(11, 11)}
    (stock_res,) = stock["per_param"]["result"]
    if stock_res["repacked"]:  # vLLM 0.25/0.32 on a CPU with AVX-512 repack the projections at load
        # the bug, reproduced: it fails part-way, after writing the tensors before the failing one
        assert not stock_res["ok"] and stock_res["calls"] < 21, stock_res
        assert ("weight_loader" in stock_res["error"]) or ("torch.Size([0])" in stock_res["error"]), stock_res


def test_a_fused_layer_split_across_reload_calls(main, stock, weights):
    """reload_weights twice, q_proj of layer 0 in the first call and its k/v in the second: stock vLLM
    processes the qkv layer each time with the missing part from uninitialised memory (garbage weights,
    silently); with the plugin the first call raises, the layer keeps its old weights and the engine refuses
    to generate (the rest of the model is already new) until a complete update lands. The calls run with
    torch's NaN fill of uninitialised memory, so stock's garbage is NaN by construction (not, by the
    allocator's luck, the freed buffer that held the right bytes)."""
    s = stock["two_calls"]["result"][0]
    assert all(c["ok"] for c in s["calls"]), s  # stock: no error at all ...
    assert s["layer0_qkv_nonfinite_outputs"] > 0, s  # ... and a layer computed from uninitialised memory
    m = _vs_reference(_reqs(stock, "g_two_calls"), weights["llama-tiny"]["C"])
    assert not m["token_mult_prob_error"] <= 1.3, m  # weights that are not C (NaN: the comparison is False)
    p = main["two_calls"]
    assert "error" in p and "mixed-weights" in p["error"] and "qkv_proj" in p["error"], p
    assert "request refused" in main["g_two_calls"]["error"]
    assert main["push_B_dist"]["ok"], main["push_B_dist"]  # a complete update repairs it
    assert _same(_reqs(main, "g_B_dist"), _reqs(stock, "g_B")) == 0.0
    assert main["v_B_dist"]["version"] == 12


def test_dist_transport_and_report(main):
    rep = main["push_B_dist"]["report"]
    assert rep["transport"] == "dist" and rep["state"] == "committed"
    assert rep["stages"]["send"] > 0 and rep["stages"]["worker_receive"] > 0
    r = main["bad_sender_stops"]
    assert "bucket" in r["message"], r  # which bucket did not arrive


def test_the_report_says_where_the_time_went(main):
    """``RefitReport.timeline`` and the ``commit_rpc_*`` stages: the caller's, the engine core's and the worker's
    points on one clock (one host), in the order they happen, and a split of the commit RPC that adds up."""
    rep = main["push_C_direct"]["report"]
    names, ms = [p for p, _ in rep["timeline"]], [t for _, t in rep["timeline"]]
    assert ms == sorted(ms) and names[0] == "start" and names[-1] == "report", rep["timeline"]
    path = ("commit_rpc", "core.enter", "core.call", "worker.enter", "worker.prepared", "worker.commit",
            "worker.written", "worker.exit", "core.return", "core.exit", "commit_answer")
    assert all(p in names for p in path), names
    assert [names.index(p) for p in path] == sorted(names.index(p) for p in path), names
    st = rep["stages"]
    parts = [st[f"commit_rpc_{k}"] for k in ("to_core", "core_before", "to_worker", "worker", "from_worker",
                                              "core_after", "from_core")]
    assert min(parts) >= 0 and abs(sum(parts) - st["commit_rpc"]) <= 0.02 * st["commit_rpc"] + 1e-4, st


def test_asleep_engine_refuses_updates(main):
    assert "wake_up(tags=['weights'])" in main["bad_asleep"]["message"]


def test_composed_extension_counts_each_update_once(main):
    log = main["_log"]
    for v in (1, 10, 11, 12):
        assert log.count(f"-> weight version {v} (") == 1, v
    assert log.count("new requests salted with weight version 11") == 1


def test_tied_embedding_model(qwen, stock_qwen, weights, version):
    w = weights["qwen2-tiny"]
    r = qwen["bad_tied_mismatch"]
    assert (r["kind"], r["state"]) == EXPECT["tied_mismatch"] and WORDS["tied_mismatch"] in r["message"], r
    assert _equal(qwen, "eq_tied_mismatch")[0]
    assert qwen["push_B"]["ok"], qwen["push_B"]
    assert _same(_reqs(qwen, "g_B"), _reqs(stock_qwen, "g_B")) == 0.0
    assert _vs_reference(_reqs(qwen, "g_C"), w["C"])["token_mult_prob_error"] <= 1.02
    stock_c = _vs_reference(_reqs(stock_qwen, "g_C"), w["C"])["token_mult_prob_error"]
    (repacked,) = stock_qwen["repacked"]["result"]
    if version.startswith("0.32.") and repacked:
        # stock vLLM 0.32 CPU (weights repacked at load): reload_weights does not re-process the tied head, which
        # keeps computing with the old (repacked) embedding; the plugin re-processes it (see the push above)
        assert stock_c > 1.1, stock_c
        assert "re-processed tied layer(s) lm_head" in qwen["_log"]
    else:
        assert stock_c <= 1.02, stock_c


def test_one_tensor_per_rpc_completes_fused_layers_across_rpcs(qwen):
    """A trainer's own sync sending one tensor per RPC (OpenRLHF's ``WorkerWrap.update_weight``, SkyRL): the
    q, k and v of a fused ``qkv_proj`` (and gate/up) arrive in separate RPCs. Each part waits for the rest
    instead of the layer being closed half-loaded at the end of its RPC (which kept its old weights,
    silently); meanwhile the engine refuses to generate; afterwards it equals the same weights pushed whole,
    bit for bit."""
    r = qwen["per_rpc"]
    assert r["errors"] == [] and r["calls"] == r["names"] > 10, r
    between = r["between"]  # k of layer 0 arrived, q and v not yet: aborted, nothing generated
    assert "requests" in between, between
    assert all(q["finish_reason"] == "abort" and q["token_ids"] == [] for q in between["requests"]), between
    assert "generation waits for the rest" in qwen["_log"]
    assert _same(_reqs(qwen, "g_per_rpc"), _reqs(qwen, "g_B")) == 0.0
    assert qwen["v_per_rpc"]["version"] > qwen["v_C"]["version"]
    v = qwen["v_per_rpc"]["version"]
    assert _versions(_reqs(qwen, "g_per_rpc")) == {(v, v)}


# ------------------------------------------------------------------------------------------ Ray, LoRA
@pytest.fixture(scope="module")
def ray_run(tmp_path_factory, weights):
    """qwen2-tiny (tied) with LoRA enabled, hosted in a Ray actor of a local Ray cluster on loopback."""
    spec = {"engine": {"model": model_path("qwen2-tiny"), "enable_lora": True, "max_lora_rank": 8},
            "weights": weights["qwen2-tiny"]["B"], "tied": True, "prompts": PROMPTS}
    d = tmp_path_factory.mktemp("ray")
    f = d / "spec.json"
    f.write_text(json.dumps(spec))
    r, log = run_script("ray_refit.py", str(f), cwd=d, **BF16_HEAD)
    r["_log"] = log
    return r


def test_engine_in_a_ray_actor_updated_through_its_handle(ray_run, stock_qwen):
    r = ray_run
    assert r["push"]["ok"] and r["push"]["transport"] == "shm" and r["version"] == 1, r["push"]
    assert all(q["spans"] == [[0, len(q["token_ids"]), 1, 1]] for q in r["g_new"])
    # a LoRA engine (base weights updated through vLLM's LoRA wrappers) on the tied-embedding model: same
    # tokens as a fresh engine on the new weights; LoRA layers compute with a slightly different kernel path
    assert _same(r["g_new"], _reqs(stock_qwen, "g_B"), tol=1e-3) <= 1e-3
    bad = r["bad"]
    assert (bad["ok"], bad["kind"], bad["state"]) == (False, "validation", "unchanged") and "norm" in bad["message"]
    assert r["version_after_bad"] == 1


def test_a_missing_plugin_in_the_actor_is_a_loud_error(ray_run):
    m = ray_run["missing_plugin"]
    assert (m["ok"], m["kind"]) == (False, "refused"), m
    assert "not importable in the Ray actor's environment" in m["message"]


# ------------------------------------------------------------------------------------------ MoE
@pytest.fixture(scope="module")
def moe(tmp_path_factory, version):
    """A Mixtral-shaped MoE model (4 experts, top-2; random weights, sharpened head) built here. The engine starts
    on C (its fresh load is the reference), takes vLLM's own reload_weights of B (refit_guard off: unguarded, the
    bug) and then the plugin's push of C back (the fix: strict reload)."""
    d = tmp_path_factory.mktemp("moe")
    a = R.tiny_moe(str(d / "moe-A"), model_path())
    b = R.perturbed_copy(a, str(d / "moe-B"), scale=1.0, seed=7)
    c = R.perturbed_copy(a, str(d / "moe-C"), scale=1.0, seed=8)
    ops = [_gen("g_fresh_C"), {"op": "reload", "name": "reload_B", "path": b}, _gen("g_reload_B"),
           {"op": "push", "name": "push_C", "weights": "C"}, _gen("g_C"),
           {"op": "push", "name": "fused_names", "weights": "C", "bad": "hf_fused_experts"}]
    try:
        return _run(d, {"model": c}, {"C": c}, ops, VLLM_RLPATCH_REFIT_GUARD="0") | {"_B": b, "_C": c}
    except AssertionError as e:
        if version.startswith("0.20.") and "Current vLLM config is not set" in str(e):
            # stock vLLM 0.20.2 fails the same way on such a host (its CPU MoE path builds a CustomOp in the
            # profile run, outside the config context): nothing of the plugin's to test there
            pytest.skip("vLLM 0.20.2 CPU cannot start this MoE model on this host (no AVX-512): 'Current vLLM "
                        "config is not set' in its profile run, stock vLLM too")
        raise


def test_moe_refit(moe, version):
    """Behaviour, whichever expert kernels the host picks (AMX or not): after the push the engine computes what
    its fresh load of the same weights computed: the same tokens, logprobs equal to float rounding (1e-5; the
    re-run expert prepack can order a sum differently: 6e-7 seen on 0.32.0, the stock bug is > 0.1)."""
    assert moe["push_C"]["ok"], moe["push_C"]
    assert _same(_reqs(moe, "g_C"), _reqs(moe, "g_fresh_C"), tol=1e-5) <= 1e-5
    m = _vs_reference(_reqs(moe, "g_C"), moe["_C"])
    assert m["token_mult_prob_error"] <= 1.02, m
    assert _versions(_reqs(moe, "g_C")) == {(2, 2)}
    stock = _vs_reference(_reqs(moe, "g_reload_B"), moe["_B"])["token_mult_prob_error"]
    if version.startswith("0.32."):
        # vLLM 0.32 CPU re-processes a reloaded MoE layer without re-running the experts' prepack
        # (UnquantizedFusedMoEMethod._setup_kernel skips it on updates): the kernel reads unpacked weights
        assert stock > 1.1, stock
    else:
        assert stock <= 1.02, stock
    # transformers >= 5 packs a Mixtral's experts into one tensor in memory (mlp.experts.gate_up_proj);
    # the engine loads per-expert checkpoint names: refused with a clear error, nothing written
    r = moe["fused_names"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "validation", "unchanged"), r
    assert "not a tensor of the engine's model" in r["message"]
