# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The Triton top-k/top-p kernel keeps the nominal top-p set when that set is
every finite token (rows a min-p or a grammar mask leaves with a few tokens)."""

import pytest
import torch

from vllm.platforms import current_platform
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
from vllm.v1.sample.ops.topk_topp_triton import apply_top_k_top_p_triton

pytestmark = pytest.mark.skipif(
    not current_platform.is_cuda_alike(), reason="Triton top-k/top-p runs on GPU"
)


def _rows(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ps = [], []
    for n_finite in (2, 3, 4, 5):
        for start in (5, vocab // 2, vocab - 8):
            x = torch.full((vocab,), float("-inf"))
            vals = torch.linspace(2.0, 2.0 - 0.35 * (n_finite - 1), n_finite)
            x[start : start + n_finite] = vals
            probs = torch.softmax(vals, 0)
            rows.append(x)
            # above the mass of all tokens but the smallest: every token is needed
            ps.append(float(1.0 - probs[-1] / 2))
    return torch.stack(rows), torch.tensor(ps)


@pytest.mark.parametrize("vocab", [1000, 131072])
@pytest.mark.parametrize("batch", [1, 80])  # 80: past the split-row pipeline's batch limit
@pytest.mark.parametrize("with_k", [False, True])
def test_top_p_keeps_every_needed_token(vocab: int, batch: int, with_k: bool):
    x, p = _rows(vocab)
    reps = (batch + x.shape[0] - 1) // x.shape[0]
    x, p = x.repeat(reps, 1)[:batch], p.repeat(reps)[:batch]
    k = torch.full((batch,), 20, dtype=torch.int32) if with_k else None
    want = torch.isfinite(
        apply_top_k_top_p_pytorch(x.clone(), None if k is None else k.long(), p)
    )
    got = apply_top_k_top_p_triton(
        x.clone().cuda(), None if k is None else k.cuda(), p.cuda()
    )
    assert torch.equal(torch.isfinite(got).cpu(), want)
