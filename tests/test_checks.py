"""The fused checksum + finite check (vllm_rlpatch.refit.checks) against a plain-Python definition."""

import random

import pytest
import torch

from vllm_rlpatch.refit import checks as C


def _reference(data: bytes) -> tuple[int, int]:
    """The definition: int32 little-endian words (a 1-3 byte tail zero-padded), s = sum mod 2**32,
    p = sum over 16 KiB blocks of (block index + 1) x block sum, mod 2**32."""
    words = [int.from_bytes(data[i:i + 4].ljust(4, b"\0"), "little", signed=True) for i in range(0, len(data), 4)]
    s = sum(words) & 0xFFFFFFFF
    p = sum((i // C.BLOCK_WORDS + 1) * w for i, w in enumerate(words)) & 0xFFFFFFFF
    return s, p


@pytest.mark.parametrize("nbytes", [1, 6, 4 * C.BLOCK_WORDS, 4 * C.BLOCK_WORDS * 3 + 10])
def test_digest_is_the_definition(nbytes):
    rnd = random.Random(nbytes)
    data = bytes(rnd.getrandbits(8) for _ in range(nbytes))
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    d = C.digest_torch(t)
    assert (d.s, d.p) == _reference(data) and d.nbytes == nbytes and d.nonfinite == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64])
def test_pack_and_digest_copies_and_digests_in_one_pass(dtype):
    t = (torch.randn(3000, 701) * 3).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, (3000, 701))
    buf = torch.zeros(t.numel() * t.element_size() + 128, dtype=torch.uint8)
    (d,) = C.pack_and_digest([(t, buf[64:])])
    assert torch.equal(buf[64:64 + d.nbytes], t.reshape(-1).view(torch.uint8))
    assert d == C.digest_torch(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_values_are_counted(dtype, bad):
    t = torch.randn(50_000).to(dtype)
    t[[7, 40_000]] = bad
    assert C.digest_torch(t).nonfinite == 2
    buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
    assert C.pack_and_digest([(t, buf)])[0].nonfinite == 2


def test_moved_blocks_change_the_checksum_not_only_the_sum():
    t = torch.randn(C.BLOCK_WORDS * 4).to(torch.bfloat16)
    swapped = t.view(-1, C.BLOCK_WORDS * 2).flip(0).reshape(-1).clone()
    a, b = C.digest_torch(t), C.digest_torch(swapped)
    assert a.s == b.s and a.p != b.p and a.key != b.key


def test_the_same_bytes_viewed_as_another_dtype_have_the_same_key():
    t = torch.randn(1234).to(torch.bfloat16)
    assert C.digest_torch(t).key == C.digest_torch(t.view(torch.int16)).key == C.digest_torch(t.view(torch.uint8)).key


def test_the_triton_kernels_copy_check_and_digest_by_the_definition():
    """The digest kernel and the fused copy-and-check kernel (the GPU's write + post-write check of a
    validated update), run by Triton's interpreter on this CPU: windows inside a larger tensor copied, the
    read-back digests equal the sources', a wrong or block-swapped expectation reported."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(root / "tests/scripts/triton_interp.py")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["copied"] and out["copy_bad"] == [] and out["detects"] == [2] and out["digest_kernel_equal"]


@pytest.fixture
def two_threads(monkeypatch):
    """Torch at 2 intra-op threads on a process that may use 2 of the machine's CPUs (restored after)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(C.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(C.os, "cpu_count", lambda: 2)
    yield monkeypatch
    torch.set_num_threads(old)


@pytest.mark.parametrize("busy, cpus, want", [(0, 2, 2), (1, 2, 1), (5, 2, 1), (None, 2, 2), (1, 128, 2), (64, 128, 1)])
def test_a_check_pass_takes_the_cpus_other_processes_leave(two_threads, busy, cpus, want):
    two_threads.setattr(C, "_runnable_elsewhere", lambda: busy)
    two_threads.setattr(C.os, "cpu_count", lambda: cpus)
    assert C.pass_threads() == want
    with C.bounded_threads():
        assert torch.get_num_threads() == want
    assert torch.get_num_threads() == 2


def test_the_threads_are_restored_when_the_pass_fails(two_threads):
    two_threads.setattr(C, "_runnable_elsewhere", lambda: 1)
    with pytest.raises(ValueError), C.bounded_threads():
        assert torch.get_num_threads() == 1
        raise ValueError("a failing pass")
    assert torch.get_num_threads() == 2


def test_bounded_passes_give_the_same_digests(two_threads):
    ts = [torch.randn(3000, 701).to(torch.bfloat16), torch.randn(5000), torch.randint(-9, 9, (777,))]
    free = [C.digest_torch(t) for t in ts]
    two_threads.setattr(C, "_runnable_elsewhere", lambda: 1)
    seen = []
    two_threads.setattr(C, "digest_torch", lambda t: seen.append(torch.get_num_threads()) or free[len(seen) - 1])
    assert C.digests(ts) == free and seen == [1, 1, 1]
    buf = torch.empty(sum(t.numel() * t.element_size() for t in ts), dtype=torch.uint8)
    offs = [0]
    for t in ts:
        offs.append(offs[-1] + t.numel() * t.element_size())
    assert C.pack_and_digest([(t, buf[a:b]) for t, a, b in zip(ts, offs, offs[1:])]) == free
    assert torch.get_num_threads() == 2


def test_another_process_that_spins_is_seen_as_runnable():
    import subprocess
    import sys
    import time

    if C._runnable_elsewhere() is None:
        pytest.skip("no /proc here")
    spin = subprocess.Popen([sys.executable, "-c", "import sys; print(flush=True); exec('while True: pass')"],
                            stdout=subprocess.PIPE)
    try:
        spin.stdout.readline()
        time.sleep(0.05)
        assert C._runnable_elsewhere() >= 1
    finally:
        spin.kill()
        spin.wait()
