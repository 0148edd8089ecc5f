"""The refit's Triton kernels run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, set by the caller before
Triton is imported): the digest kernel and the fused copy-and-check kernel against the torch definition.

The interpreter adds int32 values in wider integers and refuses a sum that leaves the int32 range (the GPU wraps
it, which is the checksum's arithmetic), so the data are small integers: the tests cover the kernels' indexing
(pointer tables, work lists, partial blocks, windows inside a larger tensor), the copy and the read-back, not
the wrap-around, which the GPU run compares with the CPU definition. Prints one JSON line."""

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
from vllm_rlpatch.refit import checks  # noqa: E402


def small(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)


def main() -> None:
    out: dict = {}
    W = checks.BLOCK_WORDS
    sizes = [3, W, W * checks.GROUP + 5, W * 5 + 1]  # one word, one block, a partial group, several groups
    srcs = [small(n, i) for i, n in enumerate(sizes)]
    # destinations: windows inside one larger tensor (like q, k, v inside a fused qkv parameter) + a plain tensor
    big = torch.full((sizes[0] + sizes[1] + sizes[2] + 7,), -1, dtype=torch.int32)
    dst = [big[0:sizes[0]], big[sizes[0]:sizes[0] + sizes[1]], big[sizes[0] + sizes[1]:sizes[0] + sizes[1] + sizes[2]],
           torch.full((sizes[3],), -1, dtype=torch.int32)]
    want = [checks.digest_torch(s).key for s in srcs]
    plan = checks.CopyCheckPlan(dst, srcs)
    out["copy_bad"] = plan.run_and_compare(want)
    out["copied"] = all(torch.equal(d, s) for d, s in zip(dst, srcs))
    out["untouched_tail"] = bool((big[-7:] == -1).all())
    wrong = list(want)
    wrong[2] = checks.digest_torch(srcs[2] + 1).key
    out["detects"] = plan.run_and_compare(wrong)
    moved = list(want)  # the same words in another block order: the position-weighted sum differs
    perm = torch.cat([srcs[3][W:2 * W], srcs[3][:W], srcs[3][2 * W:]])
    moved[3] = checks.digest_torch(perm).key
    out["detects_moved"] = plan.run_and_compare(moved) == [3] and not torch.equal(perm, srcs[3])
    out["warm"] = checks._copy_kernel_warm(torch.device("cpu"))  # the compile-first guard on scratch memory
    dplan = checks.DigestPlan(srcs)
    out["digest_kernel_equal"] = [d.key for d in dplan.digests()] == want
    print(json.dumps(out))
    ok = (out["copy_bad"] == [] and out["copied"] and out["untouched_tail"] and out["detects"] == [2]
          and out["detects_moved"] and out["digest_kernel_equal"] and out["warm"])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
