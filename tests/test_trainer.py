"""vllm_rlpatch.trainer.fp32_lm_head on a real transformers model (the embedded llama-tiny in bf16)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import model_path


@pytest.fixture()
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path("qwen2-tiny"), dtype=torch.bfloat16).eval()


def _hidden_and_logits(m, ids):
    out = m(ids, output_hidden_states=True)
    return out.hidden_states[-1], out.logits


def test_the_head_projects_in_fp32_and_nothing_else_changes(model):
    from vllm_rlpatch.trainer import fp32_lm_head, is_fp32_lm_head, restore_lm_head

    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    w = model.lm_head.weight
    assert model.config.tie_word_embeddings and w is model.get_input_embeddings().weight
    with torch.no_grad():
        h, bf16_logits = _hidden_and_logits(model, ids)
    assert bf16_logits.dtype == torch.bfloat16
    assert fp32_lm_head(model) is model and is_fp32_lm_head(model)
    fp32_lm_head(model)  # idempotent
    with torch.no_grad():
        h2, logits = _hidden_and_logits(model, ids)
    assert torch.equal(h, h2)  # the body is untouched
    assert logits.dtype == torch.float32
    assert torch.equal(logits, F.linear(h.float(), w.float()))
    assert (logits - bf16_logits.float()).abs().max() > 1e-3  # bf16 rounding is what it removes
    assert w.dtype == torch.bfloat16 and model.lm_head.weight is w  # parameters untouched (tied too)
    restore_lm_head(model)
    assert not is_fp32_lm_head(model)
    with torch.no_grad():
        assert _hidden_and_logits(model, ids)[1].dtype == torch.bfloat16


def test_gradients_flow_to_the_bf16_weight(model):
    from vllm_rlpatch.trainer import fp32_lm_head

    fp32_lm_head(model).train()
    ids = torch.tensor([[3, 17, 42, 99]])
    loss = model(ids, labels=ids).loss
    loss.backward()
    g = model.lm_head.weight.grad
    assert g is not None and g.dtype == torch.bfloat16 and torch.isfinite(g.float()).all() and g.abs().sum() > 0


def test_a_head_that_is_not_a_plain_linear_is_refused():
    from vllm_rlpatch.trainer import fp32_lm_head

    class Quantized(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    class M(torch.nn.Module):
        def __init__(self, head):
            super().__init__()
            self.lm_head = head

    with pytest.raises(TypeError, match="not a plain torch.nn.Linear"):
        fp32_lm_head(M(Quantized(4, 8)))
    with pytest.raises(TypeError, match="no output projection"):
        fp32_lm_head(torch.nn.Sequential())
    lin = torch.nn.Linear(4, 8, bias=True).to(torch.bfloat16)
    fp32_lm_head(M(lin))
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    assert torch.equal(lin(x), F.linear(x.float(), lin.weight.float(), lin.bias.float()))
