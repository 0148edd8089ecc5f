"""A fleet of Ray actors, each hosting a real vllm.LLM (tests/scripts/fleet_ray.py, local Ray cluster on loopback,
one run shared by the tests): push_weights([handle_a, handle_b]) runs each phase of the update as one Ray call
into each actor. A good update, a refusal in one actor's prepare, a failure after one actor's first write
(both roll back), and an actor killed as the commits go out. The fleet logic itself is the in-process one
(tests/test_fleet.py, every CI version); this runs on the newest CI version only (CI time)."""

import pytest

from support.env import skip_unless_newest
from support.fleet import lps as _lps, run_fleet_script, tokens as _tokens, vs_reference as _vs_reference

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run(tmp_path_factory, version):
    skip_unless_newest(version, "the Ray fleet test")
    pytest.importorskip("ray")
    return run_fleet_script(tmp_path_factory, "fleet_ray", "fleet_ray.py", timeout=600)


def test_a_good_update_lands_in_both_actors_at_one_version(run):
    s = run["steps"]
    r = s["push_B"]
    assert r["ok"], r
    rep = r["report"]
    assert rep["state"] == "committed" and rep["version"] == 1 and rep["versions"] == [1, 1], rep
    # one packing into shared memory (same node), mapped by both actors' workers
    assert rep["transport"] == "shm" and rep["bytes"] > 900_000 and rep["buckets"] >= 1
    assert [e["state"] for e in rep["engines"]] == ["committed", "committed"]
    assert all(e["name"].startswith(f"engine{i} (Ray actor Host ") for i, e in enumerate(rep["engines"])), rep
    assert {"pack", "prepare", "commit", "release"} <= set(rep["stages"]), rep["stages"]
    assert s["v_B"] == {"versions": [1, 1]}
    fa, fb = (x["fingerprint"] for x in s["fp_B"])
    assert fa == fb  # bit-identical weights in both actors
    ga, gb = s["g_B"]
    assert _tokens(ga) == _tokens(gb) and _lps(ga) == _lps(gb)
    assert _tokens(ga) != _tokens(s["g0"][0])  # the weights did change
    # the actors' front ends took the update: outputs carry the new version
    assert all(q["spans"] == [[0, len(q["token_ids"]), 1, 1]] for q in ga["requests"]), ga
    # what a fresh load of B gives (float32 transformers, bf16 tolerance)
    assert _vs_reference(ga, run["weights"]["B"])["token_mult_prob_error"] <= 1.02


def test_a_refusal_in_one_actors_prepare_changes_neither(run):
    s = run["steps"]
    assert s["arm_prepare"]["ok"], s["arm_prepare"]
    r = s["refused"]
    assert (r["ok"], r["kind"], r["state"]) == (False, "fault", "unchanged"), r
    assert "engine1 (Ray actor Host" in r["message"] and "prepare" in r["message"], r["message"]
    assert "\n" not in r["message"]
    assert [e["state"] for e in r["report"]["engines"]] == ["unchanged", "unchanged"]
    for e in s["eq_refused"]:
        assert e["equal"], e  # torch.equal with the snapshot taken after the good update
    for g in s["g_refused"]:
        assert _tokens(g) == _tokens(s["g_B"][0])
    assert s["v_refused"] == {"versions": [1, 1]}


def test_a_failure_after_one_actors_first_write_rolls_both_back_and_versions_agree(run):
    s = run["steps"]
    r = s["fault_rb"]
    assert (r["ok"], r["state"]) == (False, "restored"), r
    assert "engine1" in r["message"] and "commit" in r["message"]
    assert [e["state"] for e in r["report"]["engines"]] == ["restored", "restored"]
    for e in s["eq_fault_rb"]:
        assert e["equal"], e
    for g in s["g_fault_rb"]:
        assert _tokens(g) == _tokens(s["g_B"][0]) and _lps(g) == _lps(s["g_B"][0])
    # actor 0 committed and rolled back (one more version), actor 1 never wrote: raised to the same
    assert s["v_fault_rb"] == {"versions": [3, 3]}, s["v_fault_rb"]


def test_a_killed_actor_is_an_error_naming_it_and_the_survivor_rolls_back(run):
    s = run["steps"]
    r = s["killed"]
    assert (r["ok"], r["state"]) == (False, "unknown"), r
    assert "engine1 (Ray actor Host" in r["message"] and "dead" in r["message"], r["message"]
    assert r["seconds"] < 30.0, r["seconds"]  # within timeout_s, never a hang
    e0, e1 = r["report"]["engines"]
    assert e1["dead"] and e1["state"] == "unknown" and e1["errors"], e1
    assert e0["state"] == "restored" and not e0["dead"], e0
    assert s["survivor_eq"][0]["equal"], s["survivor_eq"]
    assert _tokens(s["survivor_gen"][0]) == _tokens(s["g_B"][0])
    assert s["v_survivor"] == {"versions": [5]}  # 3, committed (4), rolled back (5)
    assert "error" in s["v_with_dead"] and "dead" in s["v_with_dead"]["error"], s["v_with_dead"]
