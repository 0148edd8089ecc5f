"""The trainer side of a ``cuda_ipc`` update reuses what it found about the very same tensor objects last time
(vllm_rlpatch.refit.caches.Sent: checked metadata, IPC handles, the template's hash) and nothing else: another
object, a new address, shape or stride, another schema or other options make it check and hash again, and the
cache never keeps a tensor alive. No GPU here: the handles are stood in for by their tensors' addresses (the
real ones need CUDA; benchmarks/gpu/refit_full_gpu.py runs them on the H200)."""

import gc
import weakref

import pytest
import torch

from vllm_rlpatch.refit import api, caches, ipc_sender
from vllm_rlpatch.refit import protocol as P
from vllm_rlpatch.refit.target import Target

pytestmark = pytest.mark.quick  # engine-free: part of ci/test.sh --quick

SCHEMA = P.Schema({"w": ([4, 2], "float32"), "b": ([2], "float32")}, {}, "test", "float32")


class Engine(Target):
    kind = "llm"

    def __init__(self):
        self.front = self  # hashable, weak-referenceable


@pytest.fixture
def calls(monkeypatch):
    seen = {"handles": 0, "validate": 0}

    def handles(tensors):
        seen["handles"] += 1
        return [f"{t.data_ptr()}:{tuple(t.shape)}".encode() for _, t in tensors]

    validate = P.validate_metadata

    def counting_validate(*a, **k):
        seen["validate"] += 1
        return validate(*a, **k)

    monkeypatch.setattr(ipc_sender, "ipc_handles", handles)
    monkeypatch.setattr(P, "validate_metadata", counting_validate)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    caches.CACHE.clear()
    yield seen
    caches.CACHE.clear()


def send(tgt, tensors, schema=SCHEMA, verify=False, **kw):
    opts = api.Options(transport="cuda_ipc", mode="direct", verify=verify, **kw)
    out = api.Outgoing(tgt, tensors, opts, schema)
    out.send(n_workers=1)
    return out


def test_the_same_tensor_objects_reuse_their_checked_metadata_and_handles(calls):
    tgt = Engine()
    w, b = torch.zeros(4, 2), torch.ones(2)
    first = send(tgt, [("w", w), ("b", b)])
    assert first.refused is None and calls == {"handles": 1, "validate": 1}
    w.add_(1.0)  # an in-place update: the same object, the same memory
    again = send(tgt, [("w", w), ("b", b)])
    assert again.refused is None and calls == {"handles": 1, "validate": 1}
    assert again.req["transport"] == first.req["transport"]


def test_a_cache_hit_still_digests_this_updates_bytes(calls):
    tgt = Engine()
    w, b = torch.zeros(4, 2), torch.ones(2)
    first = send(tgt, [("w", w), ("b", b)], verify=True)
    w.add_(1.0)
    again = send(tgt, [("w", w), ("b", b)], verify=True)
    assert calls == {"handles": 1, "validate": 1}
    fp1, fp2 = [m.fingerprint for m in first.metas], [m.fingerprint for m in again.metas]
    assert None not in fp1 + fp2
    assert fp2[0] != fp1[0] and fp2[1] == fp1[1]  # w changed in place, b did not
    assert again.metas is not first.metas and again.metas[0] is not first.metas[0]
    w[0, 0] = float("nan")
    bad = send(tgt, [("w", w), ("b", b)], verify=True)
    assert bad.refused is not None and "NaN" in bad.refused["message"]


@pytest.mark.parametrize("change", ["new object", "new storage", "new shape", "new stride", "schema", "partial",
                                    "names"])
def test_anything_else_checks_and_hashes_again(calls, change):
    tgt = Engine()
    w, b = torch.zeros(4, 2), torch.ones(2)
    send(tgt, [("w", w), ("b", b)])
    schema, kw, names = SCHEMA, {}, ("w", "b")
    if change == "new object":
        w = w.clone()
    elif change == "new storage":
        w.set_(torch.zeros(4, 2))
    elif change == "new shape":
        w.resize_(2, 4)
    elif change == "new stride":
        w.as_strided_((4, 2), (1, 4))
    elif change == "schema":
        schema = P.Schema.from_dict(SCHEMA.as_dict())
    elif change == "partial":
        kw = {"partial": True}
    elif change == "names":  # the same tensors in another order
        names = ("b", "w")
        w, b = b, w
    out = send(tgt, [(names[0], w), (names[1], b)], schema, **kw)
    if change == "new shape":  # the schema wants [4, 2]: refused before any handle is made
        assert out.refused is not None and "shape" in out.refused["message"]
        assert calls == {"handles": 1, "validate": 2}
    else:
        assert calls == {"handles": 2, "validate": 2}
        assert out.refused is None


def test_a_refused_update_is_not_remembered(calls):
    tgt = Engine()
    w, b = torch.zeros(3), torch.ones(2)
    for _ in range(2):
        assert send(tgt, [("w", w), ("b", b)]).refused is not None
    assert calls["validate"] == 2


def test_the_cache_keeps_no_tensor_alive(calls):
    tgt = Engine()
    w, b = torch.zeros(4, 2), torch.ones(2)
    send(tgt, [("w", w), ("b", b)])
    ref = weakref.ref(w)
    del w
    gc.collect()
    assert ref() is None
    send(tgt, [("w", torch.zeros(4, 2)), ("b", b)])
    assert calls == {"handles": 2, "validate": 2}


def test_each_target_has_its_own_entry(calls):
    w, b = torch.zeros(4, 2), torch.ones(2)
    a, c = Engine(), Engine()
    send(a, [("w", w), ("b", b)])
    send(c, [("w", w), ("b", b)])
    send(a, [("w", w), ("b", b)])
    send(c, [("w", w), ("b", b)])
    assert calls == {"handles": 2, "validate": 2}
