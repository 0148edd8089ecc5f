"""An asynchronous RL loop over HTTP: streaming clients (completions and chat) on one `vllm serve` while a
trainer process pushes weights over the refit route (shm), with each in-flight mode in turn.

benchmarks/serve_rl_loop.py is the one implementation (server, clients, trainer, checks); this runs it at a
small size (4 clients, 2 pushes per mode, 24 tokens a request) and asserts its correctness parts: nothing lost
or failed but the aborts `abort` asks for, no token dropped or doubled, every token's version span matching a
float32 reference of that version's weights (a `keep` span on older KV against that mixture), a stream
cancelled as a push starts leaking no request. The timing figures are the benchmark's, never asserted."""

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import pytest

from support.env import skip_unless_newest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_rl_loop as L  # noqa: E402

pytestmark = pytest.mark.vllm

ARGS = argparse.Namespace(clients=4, updates=2, duration=10.0, max_tokens=24, rounds=1, modes=list(L.MODES))


@pytest.fixture(scope="module")
def loop(version):
    skip_unless_newest(version, "the HTTP RL loop under streaming load")
    with tempfile.TemporaryDirectory(prefix="serve_load-") as d:
        out = asyncio.run(L.run_all(ARGS, Path(d)))
    print(json.dumps(out))  # (shown with a failure)
    return out


def test_the_baseline_loses_nothing_and_its_tokens_match_the_starting_weights(loop):
    b = loop["baseline"]
    assert b["requests"] >= ARGS.clients and b["finished"] == b["requests"], b
    assert b["lost_or_failed"] == 0 and b["dropped_or_doubled"] == 0 and b["spans_not_covering"] == 0, b
    # (checked: the clients' tokens and those of the streams the canceller closed)
    assert b["tokens_checked"] >= b["tokens"] and b["wrong_version_tokens"] == 0, b
    assert list(b["span_kinds"]) == ["same"], b
    assert not b["queue_after"]["leaked"], b


@pytest.mark.parametrize("mode", L.MODES)
def test_updates_under_streaming_load(loop, mode):
    r = loop[mode]
    assert [p["ok"] for p in r["pushes"]] == [True] * ARGS.updates, r["pushes"]
    assert r["lost_or_failed"] == 0, r["failures"]
    assert r["dropped_or_doubled"] == 0 and r["spans_not_covering"] == 0, r
    assert r["tokens_checked"] >= r["tokens"] and r["wrong_version_tokens"] == 0, r
    # the check can fail: the same spans labelled with another version are mostly flagged
    assert r["wrong_label_check"]["tokens_flagged"] >= 0.5 * r["wrong_label_check"]["tokens"], r
    if mode == "abort":
        assert r["aborted_by_update"] <= r["aborted_reported_by_pushes"], r
    else:
        assert r["aborted_by_update"] == 0 and r["aborted_reported_by_pushes"] == 0, r
    if mode != "keep":
        assert "sampled_on_older_kv" not in r["span_kinds"], r["span_kinds"]


@pytest.mark.parametrize("mode", L.MODES)
def test_an_update_that_lands_mid_request_is_handled_as_its_mode_says(loop, mode):
    """recompute: the request goes on under the new version (KV rebuilt: spans v == kv, checked above);
    keep: its later tokens are sampled on older KV and match that mixture; abort: it ends with `abort`."""
    r = loop[mode]
    landed = {"recompute": sum(p.get("recomputed") or 0 for p in r["pushes"]),
              "keep": r["span_kinds"].get("sampled_on_older_kv", 0), "abort": r["aborted_by_update"]}[mode]
    if not landed:
        # Seen on a loaded 2-core host: the engine runs a short request to its end in well under 0.1 s while the
        # clients, starved of CPU, still read its stream (per push: streams open across it, none with a token
        # during it); the commit then finds nothing running ("0 running" in the server log): the scenario did
        # not happen, which says nothing about the plugin.
        pytest.skip(f"no {mode} push landed while a request ran: {r['pushes']}")
    assert r["requests_spanning_versions"] >= 1 or mode == "abort", r


@pytest.mark.parametrize("mode", L.MODES)
def test_a_stream_cancelled_during_an_update_leaks_no_request(loop, mode):
    r = loop[mode]
    assert r["cancelled_mid_stream_during_push"] >= 1, r
    assert not r["queue_after"]["leaked"] and r["queue_after"]["running"] == r["queue_after"]["waiting"] == 0, r
