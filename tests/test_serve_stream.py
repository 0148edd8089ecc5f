"""Streamed responses of `vllm serve`, without a server: the refit_http patch's chunk fields on real vLLM
RequestOutput objects (DELTA outputs, as a stream gets them), including outputs that vLLM's
RequestOutputCollector merged because the consumer fell behind (``RequestOutput.add``).

vLLM merges only its own fields: the engine-core hook joins the plugin's (``rlpatch_weight_versions`` and each
output channel's data) or a merged DELTA output's later tokens would have no support entry and no version span.
The tests with that hook off show the loss."""

import json
import math

import pytest

from vllm_rlpatch.patches import refit_http as H
from vllm_rlpatch.patches.sampling_support import SamplingSupport

pytestmark = [pytest.mark.vllm, pytest.mark.quick]  # quick: engine-free (ci/test.sh --quick)

ENGINE = {"vllm": "0.32.0", "runner": "v1", "device": "cpu"}


@pytest.fixture
def merge_fix():
    """The engine-core hook, which joins the fields of DELTA outputs vLLM merges (``RequestOutput.add``), with
    the sampling_support channel's merge; the plugin installs both in a process that runs vLLM."""
    from vllm_rlpatch.hooks import engine_core
    from vllm_rlpatch.patches import sampling_support

    engine_core.require("test_serve_stream")
    engine_core.add_channel(sampling_support.CHANNEL)
    try:
        yield
    finally:
        engine_core.remove_channel(sampling_support.CHANNEL.name)
        engine_core.release("test_serve_stream")


def _delta(index, tokens, end, versions, support=True):
    """A DELTA CompletionOutput as the engine-core hook and the sampling_support channel leave it: ``tokens`` new
    tokens ending at output position ``end``, spans over the whole output so far, support for its own tokens."""
    from vllm.outputs import CompletionOutput, RequestOutput

    c = CompletionOutput(index=index, text="t" * len(tokens), token_ids=list(tokens), cumulative_logprob=None,
                         logprobs=None)
    setattr(c, H.VERSIONS, [list(s) for s in versions if s[0] < end])
    getattr(c, H.VERSIONS)[-1][1] = end
    if support:
        setattr(c, H.SUPPORT, SamplingSupport([-t / 100 for t in tokens], [t % 7 + 1 for t in tokens], ENGINE))
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], prompt_logprobs=None, outputs=[c],
                         finished=False)


def _chunks(fields, outputs, role=True):
    """Feed ``outputs`` (lists of RequestOutputs that arrive between two reads of the stream) through the
    collector's merge, then the stream fields, as a chat stream would: one chunk per choice per read."""
    if role:
        yield json.loads(fields.chunk('data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n')[6:])
    for arrived in outputs:
        first = arrived[0]
        for later in arrived[1:]:
            first.add(later, aggregate=True)
        for c in first.outputs:
            fields.add(c.index, c)
        for c in first.outputs:
            data = json.dumps({"choices": [{"index": c.index, "delta": {"content": c.text},
                                            "token_ids": list(c.token_ids)}]})
            yield json.loads(fields.chunk(f"data: {data}\n\n")[6:])


VERSIONS = [[0, 3, 1, 1], [3, 5, 2, 1], [5, 9, 2, 2]]  # a refit after token 3 (keep), the KV recomputed at 5


def _stream_of(arrivals):
    """arrivals: per read, the token counts of the DELTA outputs that arrived; tokens are 10, 11, 12, ..."""
    pos, reads = 0, []
    for counts in arrivals:
        outs = []
        for n in counts:
            outs.append(_delta(0, list(range(10 + pos, 10 + pos + n)), pos + n, VERSIONS))
            pos += n
        reads.append(outs)
    return reads


@pytest.mark.parametrize("arrivals", [[[1]] * 9, [[2], [1, 1, 1], [1], [1, 2]], [[1, 1, 1, 1, 1, 1, 1, 1, 1]]],
                         ids=["one-per-read", "merged", "all-merged"])
def test_each_chunk_carries_its_own_tokens_fields_and_they_concatenate_to_the_whole(merge_fix, arrivals):
    chunks = list(_chunks(H._StreamFields(), _stream_of(arrivals)))
    assert H.VERSIONS not in chunks[0]["choices"][0] and H.SUPPORT not in chunks[0]["choices"][0]  # role chunk
    spans, lm, cnt, engines, tokens = [], [], [], [], []
    for chunk in chunks[1:]:
        ch = chunk["choices"][0]
        n = len(ch["token_ids"])
        own = ch[H.VERSIONS]
        assert own[0][0] == 0 and own[-1][1] == n and all(a[1] == b[0] for a, b in zip(own, own[1:])), ch
        assert len(ch[H.SUPPORT]["log_mass_kept"]) == len(ch[H.SUPPORT]["kept_count"]) == n
        for s, e, v, kv in own:
            if spans and spans[-1][1] == s + len(tokens) and spans[-1][2:] == [v, kv]:
                spans[-1][1] = e + len(tokens)
            else:
                spans.append([s + len(tokens), e + len(tokens), v, kv])
        tokens += ch["token_ids"]
        lm += ch[H.SUPPORT]["log_mass_kept"]
        cnt += ch[H.SUPPORT]["kept_count"]
        engines += [ch[H.SUPPORT]["engine"]] if "engine" in ch[H.SUPPORT] else []
    assert tokens == list(range(10, 19))
    assert spans == VERSIONS
    assert lm == [-t / 100 for t in tokens] and cnt == [t % 7 + 1 for t in tokens]
    assert engines == [ENGINE]  # once per choice


def test_tokens_without_support_are_null_and_a_request_that_did_not_ask_gets_none():
    f = H._StreamFields()
    outs = [_delta(0, [10], 1, VERSIONS), _delta(0, [11], 2, VERSIONS, support=False)]
    chunks = list(_chunks(f, [[o] for o in outs], role=False))
    assert [c["choices"][0][H.SUPPORT]["log_mass_kept"] for c in chunks] == [[-0.1], [None]]
    assert chunks[1]["choices"][0][H.SUPPORT]["kept_count"] == [-1]
    plain = list(_chunks(H._StreamFields(), [[_delta(0, [10], 1, VERSIONS, support=False)]], role=False))
    assert H.SUPPORT not in plain[0]["choices"][0] and plain[0]["choices"][0][H.VERSIONS] == [[0, 1, 1, 1]]


def test_a_full_responses_support_is_what_processed_logprobs_takes():
    """NaN (no information) becomes null; processed_logprobs reads it as NaN and falls back to its twin."""
    import torch

    from vllm_rlpatch.trainer import processed_logprobs

    c = _delta(0, [3, 5], 2, VERSIONS).outputs[0]
    setattr(c, H.SUPPORT, SamplingSupport([-0.25, math.nan], [2, -1], ENGINE))
    sup = json.loads(json.dumps(H._support(c)))
    assert sup == {"log_mass_kept": [-0.25, None], "kept_count": [2, -1], "engine": ENGINE}
    logits = torch.randn(1, 2, 16)
    lp, det = processed_logprobs(logits, torch.tensor([[3, 5]]), {"temperature": 1.0, "top_k": 4},
                                 engine_info=[sup], return_details=True)
    assert det["engine_info_used"].tolist() == [[True, False]] and bool(torch.isfinite(lp).all())
    assert abs(float(lp[0, 0]) - (float(logits[0, 0].log_softmax(-1)[3]) + 0.25)) < 1e-5


def test_without_the_hook_a_merged_output_loses_its_later_tokens_fields():
    """vLLM as installed: three DELTA outputs merged before a read keep the first one's fields only."""
    chunks = list(_chunks(H._StreamFields(), _stream_of([[1, 1, 1]]), role=False))
    ch = chunks[0]["choices"][0]
    assert ch["token_ids"] == [10, 11, 12]
    right = ([[0, 3, 1, 1]], [-0.1, -0.11, -0.12])
    assert (ch.get(H.VERSIONS), (ch.get(H.SUPPORT) or {}).get("log_mass_kept")) != right
