"""A fleet update (vllm_rlpatch.refit.push_weights with a list) on two real vLLM engines in one process
(tests/scripts/fleet_engines.py, one run shared by the tests): a good update, a refusal in one engine's
prepare, a failure after one engine's first write at `rollback` and at `validate-then-write`, versions that
agree, a good update and a refusal over `dist` (one broadcast group spanning both engines' workers), and an
engine killed before an update. The protocol's corners (a hung engine, the deadline) are in
tests/test_fleet_protocol.py."""

import pytest

from support.fleet import lps as _lps, run_fleet_script, tokens as _tokens, vs_reference as _vs_reference

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_fleet_script(tmp_path_factory, "fleet", "fleet_engines.py", timeout=900)


def test_a_good_update_lands_on_both_engines_at_one_version(run):
    s = run["steps"]
    r = s["push_B"]
    assert r["ok"], r
    rep = r["report"]
    assert rep["state"] == "committed" and rep["version"] == 1 and rep["versions"] == [1, 1]
    assert rep["transport"] == "shm" and rep["tensors"] > 0 and rep["bytes"] > 900_000
    assert [e["state"] for e in rep["engines"]] == ["committed", "committed"]
    assert all(e["errors"] == [] and e["seconds"] > 0 for e in rep["engines"])
    assert rep["slowest"] in ("engine0", "engine1") and rep["slowest_seconds"] >= max(
        e["seconds"] for e in rep["engines"]) - 1e-9
    assert {"pack", "prepare", "commit", "release"} <= set(rep["stages"]), rep["stages"]
    # CPU: the layerwise reload with a host backup (rollback) on each engine
    assert [e["guarantee"] for e in rep["engines"]] == ["rollback", "rollback"], rep["engines"]
    assert s["v_B"] == {"versions": [1, 1]}
    fa, fb = s["fp_B"]
    assert fa == fb  # bit-identical weights in both engines
    ga, gb = s["g_B"]
    assert _tokens(ga) == _tokens(gb) and _lps(ga) == _lps(gb)
    assert _tokens(ga) != _tokens(s["g0"][0])  # the weights did change
    m = _vs_reference(ga, run["weights"]["B"])  # what a fresh load of B gives (float32 transformers, bf16 tol)
    assert m["token_mult_prob_error"] <= 1.02, m


def test_after_an_update_the_engines_wait_idle_instead_of_spinning(run):
    # vLLM's shm-broadcast reader polls with sched_yield for 1 s after each read (shm_broadcast.py): after a
    # no-op RPC both workers spin; the update's last RPC dates their last read back (hooks.workerctx)
    ping, push = run["steps"]["cpu_after_ping"], run["steps"]["cpu_after_push"]
    assert ping["cpu_s"] >= 0.3 * ping["wait_s"], ping  # the spin this removes (the two cores, 2 workers)
    assert push["cpu_s"] <= 0.15 * push["wait_s"], push


def test_a_refusal_in_one_engines_prepare_changes_neither(run):
    s = run["steps"]
    assert s["arm_prepare"]["ok"], s["arm_prepare"]
    r = s["refused"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "unchanged"), r
    assert "engine1" in r["message"] and "prepare" in r["message"]
    assert [e["state"] for e in r["report"]["engines"]] == ["unchanged", "unchanged"]
    for e in s["eq_refused"]:
        assert e["equal"], e  # torch.equal with the snapshot taken after the good update
    for g in s["g_refused"]:
        assert _tokens(g) == _tokens(s["g_B"][0])  # both keep serving the same weights
    assert s["v_refused"] == {"versions": [1, 1]}


def test_a_failure_after_one_engines_first_write_rolls_both_back(run):
    s = run["steps"]
    r = s["fault_rb"]
    assert (r["ok"], r["state"]) == (False, "restored"), r
    assert "engine1" in r["message"] and "commit" in r["message"]
    assert [e["state"] for e in r["report"]["engines"]] == ["restored", "restored"]
    for e in s["eq_fault_rb"]:
        assert e["equal"], e  # both back on B bit-identically
    for g in s["g_fault_rb"]:
        assert _tokens(g) == _tokens(s["g_B"][0]) and _lps(g) == _lps(s["g_B"][0])
    # engine0 committed and rolled back (one more version), engine1 never wrote: raised to the same
    assert s["v_fault_rb"]["versions"][0] == s["v_fault_rb"]["versions"][1] == 3, s["v_fault_rb"]


def test_the_same_failure_without_backups_leaves_the_fleet_mixed_until_a_good_update(run):
    s = run["steps"]
    r = s["fault_vtw"]
    assert (r["ok"], r["state"]) == (False, "mixed"), r
    assert [e["state"] for e in r["report"]["engines"]] == ["mixed", "mixed"]
    assert [e["guarantee"] for e in r["report"]["engines"]] == ["validate-then-write"] * 2
    for g in s["g_mixed"]:
        assert "request refused" in g.get("error", ""), g
    r = s["push_C"]
    assert r["ok"] and r["report"]["state"] == "committed", r
    v = r["report"]["version"]
    assert s["v_C"] == {"versions": [v, v]}
    fa, fb = s["fp_C"]
    assert fa == fb
    ga, gb = s["g_C"]
    assert _tokens(ga) == _tokens(gb)
    assert _vs_reference(ga, run["weights"]["C"])["token_mult_prob_error"] <= 1.02


def test_dist_one_broadcast_to_both_engines_lands_the_update_on_both(run):
    """transport='dist' to the fleet: one gloo group (trainer rank 0, engine0's worker rank 1, engine1's rank 2),
    the buckets broadcast once; both engines then hold exactly what a fresh load of B gives."""
    s = run["steps"]
    r = s["dist_B"]
    assert r["ok"], r
    rep = r["report"]
    v = s["v_C"]["versions"][0] + 1
    assert rep["state"] == "committed" and rep["transport"] == "dist" and rep["versions"] == [v, v], rep
    assert rep["buckets"] >= 1 and {"fingerprint", "send", "prepare", "commit"} <= set(rep["stages"]), rep["stages"]
    assert all(e["stages"].get("worker_receive", 0) > 0 for e in rep["engines"]), rep["engines"]
    assert s["v_dist_B"] == {"versions": [v, v]}
    fa, fb = s["fp_dist_B"]
    assert fa == fb == s["fp_B"][0]  # bit-identical to B pushed over shm (itself checked against a fresh load)
    ga, gb = s["g_dist_B"]
    assert _tokens(ga) == _tokens(gb) == _tokens(s["g_B"][0]) and _lps(ga) == _lps(gb)
    assert _vs_reference(ga, run["weights"]["B"])["token_mult_prob_error"] <= 1.02
    r = s["dist_C"]
    assert r["ok"] and s["v_dist_C"] == {"versions": [v + 1, v + 1]}, (r, s["v_dist_C"])
    assert s["fp_dist_C"][0] == s["fp_dist_C"][1] == s["fp_C"][0]


def test_dist_a_refusal_in_one_engines_prepare_changes_neither_and_does_not_wait_for_the_group(run):
    """engine1's worker refuses before it joined the broadcast group: it still drains the broadcast, so
    engine0's worker receives every bucket and the fleet aborts both at once, not after the group's 45 s."""
    s = run["steps"]
    assert s["arm_dist_prepare"]["ok"], s["arm_dist_prepare"]
    r = s["dist_refused"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "unchanged"), r
    assert "engine1" in r["message"] and "prepare" in r["message"] and "\n" not in r["message"]
    assert r["seconds"] < 30.0, r["seconds"]
    assert [e["state"] for e in r["report"]["engines"]] == ["unchanged", "unchanged"]
    assert r["report"]["engines"][0]["stages"].get("worker_receive", 0) > 0  # engine0 got the whole update
    for e in s["eq_dist_refused"]:
        assert e["equal"], e  # torch.equal with the snapshot taken after the dist update of B
    for g in s["g_dist_refused"]:
        assert _tokens(g) == _tokens(s["g_dist_B"][0])
    v = s["v_dist_B"]["versions"][0]
    assert s["v_dist_refused"] == {"versions": [v, v]}


def test_an_engine_killed_mid_update_is_an_error_naming_it_and_the_survivor_rolls_back(run):
    """engine1's worker is killed (SIGKILL) after every engine prepared, as the commits go out: engine0 has
    committed and is rolled back from its backup; engine1's state is unknown (dead), and so is the fleet's."""
    s = run["steps"]
    if "killed" not in s:
        pytest.skip("the engine's worker runs in this process (no engine-core process to kill)")
    r = s["killed"]
    assert (r["ok"], r["state"]) == (False, "unknown"), r
    assert "engine1" in r["message"], r
    assert r["seconds"] < 30.0 + 10.0, r["seconds"]  # within timeout_s, never a hang
    e0, e1 = r["report"]["engines"]
    assert e1["dead"] and e1["state"] == "unknown" and e1["errors"], e1
    assert e0["state"] == "restored" and not e0["dead"], e0
    assert e0["version"] == s["v_dist_C"]["versions"][0] + 2  # committed, then rolled back
    assert s["survivor_eq"]["equal"], s["survivor_eq"]
    assert _tokens(s["survivor_gen"]) == _tokens(s["g_C"][0])
