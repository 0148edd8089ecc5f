# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A layerwise reload must not process a layer which received only part of its
weights (the rest would be zeros): the layer keeps its previous weights and
`finalize_layerwise_reload` raises."""

import pytest
import torch

from vllm.model_executor.layers.linear import QKVParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import (
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.reload.layerwise import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
    record_metadata_for_reloading,
)
from vllm.model_executor.model_loader.reload.utils import get_layer_size
from vllm.model_executor.utils import set_weight_attrs

pytestmark = pytest.mark.cpu_test


def _fused_weight_loader(param, loaded_weight, shard_id: int):
    rows = loaded_weight.shape[0]
    param.data[shard_id * rows : (shard_id + 1) * rows].copy_(loaded_weight)


def _padded_weight_loader(param, loaded_weight):
    rows = loaded_weight.shape[0]
    param.data[:rows].copy_(loaded_weight)
    param.data[rows:].fill_(0)


class _FusedLayer(torch.nn.Module):
    """Two checkpoint tensors loaded into one parameter, like a fused qkv."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 3), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": _fused_weight_loader})


class _PaddedLayer(torch.nn.Module):
    """Two padding rows which the loader zero-fills and declares."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4, 3), requires_grad=False)
        set_weight_attrs(
            self.weight,
            {"weight_loader": _padded_weight_loader, "weight_loader_numel": 6},
        )


class _PlainLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)


def test_partially_loaded_layer_keeps_previous_weights():
    fused, plain = _FusedLayer(), _PlainLayer()
    model = torch.nn.Sequential(fused, plain)
    record_metadata_for_reloading(model)
    previous = fused.weight.detach().clone()
    data_ptr = fused.weight.data_ptr()

    initialize_layerwise_reload(model)
    # Only the first of the two fused tensors arrives.
    fused.weight.weight_loader(fused.weight, torch.full((2, 3), 5.0), 0)
    plain.weight.weight_loader(plain.weight, torch.full((2, 2), 7.0))

    with pytest.raises(RuntimeError, match=r"0 \(6 elements missing\)"):
        finalize_layerwise_reload(model, model_config=None)

    # Not processed with zeros for the missing half: the previous weights stay.
    assert not fused.weight.is_meta
    assert fused.weight.data_ptr() == data_ptr
    assert torch.equal(fused.weight, previous)
    # Complete layers are updated.
    assert torch.equal(plain.weight, torch.full((2, 2), 7.0))


def test_fused_layer_loaded_in_parts_is_complete():
    fused = _FusedLayer()
    model = torch.nn.Sequential(fused)
    record_metadata_for_reloading(model)

    initialize_layerwise_reload(model)
    fused.weight.weight_loader(fused.weight, torch.full((2, 3), 5.0), 0)
    fused.weight.weight_loader(fused.weight, torch.full((2, 3), 6.0), 1)
    finalize_layerwise_reload(model, model_config=None)

    expected = torch.cat([torch.full((2, 3), 5.0), torch.full((2, 3), 6.0)])
    assert torch.equal(fused.weight, expected)


def test_declared_padding_is_not_missing():
    padded = _PaddedLayer()
    model = torch.nn.Sequential(padded)
    record_metadata_for_reloading(model)

    initialize_layerwise_reload(model)
    padded.weight.weight_loader(padded.weight, torch.full((2, 3), 5.0))
    finalize_layerwise_reload(model, model_config=None)

    expected = torch.cat([torch.full((2, 3), 5.0), torch.zeros(2, 3)])
    assert torch.equal(padded.weight, expected)


def test_qkv_without_k_and_v_is_not_processed(dist_init, default_vllm_config):
    qkv = QKVParallelLinear(
        hidden_size=2, head_size=3, total_num_heads=4, total_num_kv_heads=2, bias=False
    )
    model = torch.nn.Sequential(qkv)
    qkv.weight.data.fill_(1.0)
    record_metadata_for_reloading(model)
    previous = qkv.weight.detach().clone()

    initialize_layerwise_reload(model)
    qkv.weight.weight_loader(qkv.weight, torch.full((12, 2), 5.0), "q")

    with pytest.raises(RuntimeError, match="Incomplete weight reload"):
        finalize_layerwise_reload(model, model_config=None)

    assert torch.equal(qkv.weight, previous)


def test_vocab_padding_is_declared(dist_init, default_vllm_config):
    # 100 rows are padded to 128; the padding rows are never loaded.
    embedding = VocabParallelEmbedding(num_embeddings=100, embedding_dim=8)
    assert embedding.weight.shape[0] > 100

    assert get_layer_size(embedding) == 100 * 8
