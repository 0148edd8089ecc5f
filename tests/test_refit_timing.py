"""Where an update's time goes, without an engine: the commit RPC's split from the engine core's and the
workers' clocks (kept only when the clocks compare), the report's timeline, and the update RPCs' answers packed
into one blob per rank when vLLM's insecure serialization is on (vLLM would tag and convert each leaf). The
same on real vLLM: tests/test_refit.py::test_the_report_says_where_the_time_went."""

import pickle

import pytest

from vllm_rlpatch.hooks import engine_core
from vllm_rlpatch.refit import coordinator as C

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick


def _answer(t0, *, enter=1.0, call=1.1, w_enter=1.2, w_exit=5.0, ret=5.1, exit_=5.3):
    return {"ok": True, "clock": {"enter": t0 + w_enter, "exit": t0 + w_exit},
            "marks": [["commit", t0 + 2.0], ["written", t0 + 4.9]],
            "engine_core": {"clock": {"enter": t0 + enter, "call": t0 + call, "return": t0 + ret, "exit": t0 + exit_}}}


def test_the_commit_rpc_split_adds_up_to_its_round_trip():
    t0 = 1000.0
    split = C.rpc_split(t0, t0 + 6.0, [_answer(t0)])
    want = {"to_core": 1.0, "core_before": 0.1, "to_worker": 0.1, "worker": 3.8, "from_worker": 0.1,
            "core_after": 0.2, "from_core": 0.7}
    assert split == pytest.approx(want) and sum(split.values()) == pytest.approx(6.0)


def test_clocks_that_do_not_compare_give_no_split():
    t0 = 1000.0
    other_host = _answer(t0 - 50.0)  # the engine's clock 50 s behind: spans before the call
    assert C.rpc_split(t0, t0 + 6.0, [other_host]) == {}
    assert C.rpc_split(t0, t0 + 6.0, [{"ok": True}]) == {}  # an answer without clocks (an older worker)
    assert C.rpc_split(t0, t0 + 6.0, [_answer(t0), {"ok": True}]) == {}  # one rank without


def test_the_timeline_merges_every_side_in_order():
    t0 = 1000.0
    res = [_answer(t0)]
    out = {"workers": res, "commit_split": C.rpc_split(t0 + 0.5, t0 + 6.0, res), "commit_clock": (t0 + 0.5, t0 + 6.0)}
    tl = C.timeline([("start", t0), ("sent", t0 + 0.4), ("report", t0 + 6.2)], out)
    names = [p for p, _ in tl]
    assert [t for _, t in tl] == sorted(t for _, t in tl)
    assert names[0] == "start" and names[-1] == "report"
    assert names.index("commit_rpc") < names.index("core.enter") < names.index("worker.enter") \
        < names.index("worker.commit") < names.index("worker.written") < names.index("core.exit") \
        < names.index("commit_answer")
    assert dict(tl)["worker.written"] == 4900.0  # ms after the first mark
    # no comparable clocks: the caller's own points only
    assert [p for p, _ in C.timeline([("start", t0), ("report", t0 + 1)], {"workers": res})] == ["start", "report"]


def test_answers_travel_packed_only_with_insecure_serialization(monkeypatch):
    answers = [{"ok": True, "stages": {"write": 0.011}, "marks": [("commit", 1.5)], "engine_core": {"clock": {}}},
               {"ok": False, "message": "rank 1"}]
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    assert engine_core.pack_answers(answers) is answers  # plain msgpack is fast: nothing packed
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    packed = engine_core.pack_answers(answers)
    assert [list(p) for p in packed] == [[engine_core.PACKED]] * 2
    assert all(isinstance(p[engine_core.PACKED], bytes) for p in packed)
    assert engine_core.unpack_answers(packed) == answers  # tuples stay tuples
    # anything else passes through unchanged (an engine without the plugin's packing, a fake, a scalar)
    assert engine_core.unpack_answers(answers) == answers
    assert engine_core.unpack_answers(None) is None
    assert pickle.loads(packed[1][engine_core.PACKED]) == answers[1]


def test_a_packed_answer_is_read_from_any_bytes_and_never_passed_on_unread(monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    blob = engine_core.pack_answers([{"ok": True, "version": 3}])[0][engine_core.PACKED]
    for form in (blob, bytearray(blob), memoryview(blob)):  # however a decoder hands the bytes over
        assert engine_core.unpack_answers([{engine_core.PACKED: form}]) == [{"ok": True, "version": 3}]
    with pytest.raises(TypeError, match="packed refit answer"):  # would read as a failed update otherwise
        engine_core.unpack_answers([{engine_core.PACKED: "not bytes"}])


def test_the_split_of_several_ranks_adds_up_too():
    t0 = 1000.0
    fast, slow = _answer(t0, w_enter=1.2, w_exit=4.0), _answer(t0, w_enter=1.3, w_exit=5.0)
    split = C.rpc_split(t0, t0 + 6.0, [fast, slow])
    assert split["to_worker"] == pytest.approx(0.1) and split["worker"] == pytest.approx(3.8)
    assert sum(split.values()) == pytest.approx(6.0)
