# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""With `reset_prefix_cache_on_weight_update`, no request reuses KV computed
with the weights before an update.

The unit tests exercise EngineCore.collective_rpc with mocked executor and
scheduler boundaries; the end-to-end test checks the prefix-cache hits of a
tiny model built in the test before and after `reload_weights`.
"""

from types import SimpleNamespace
from unittest.mock import Mock

import pytest
import torch

from vllm.v1.engine.core import WEIGHT_UPDATE_RPCS, EngineCore


def _engine_core(
    reset_on_update: bool = True, connector_reset_ok: bool = True
) -> tuple[EngineCore, list[str]]:
    engine = EngineCore.__new__(EngineCore)
    engine.vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(
            reset_prefix_cache_on_weight_update=reset_on_update
        )
    )
    calls: list[str] = []
    engine.model_executor = Mock()
    engine.model_executor.collective_rpc.side_effect = lambda *args: (
        calls.append("rpc") or [None]
    )
    engine.scheduler = Mock()
    engine.scheduler.reset_prefix_cache.side_effect = lambda *args: (
        calls.append("reset") or connector_reset_ok
    )
    return engine, calls


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("method", sorted(WEIGHT_UPDATE_RPCS))
def test_weight_update_resets_prefix_cache(method):
    engine, calls = _engine_core()

    assert engine.collective_rpc(method, kwargs={"a": 1}) == [None]

    engine.model_executor.collective_rpc.assert_called_once_with(
        method, None, (), {"a": 1}
    )
    # Running requests are preempted and the connector's cache is reset too.
    engine.scheduler.reset_prefix_cache.assert_called_once_with(True, True)
    assert calls == ["rpc", "reset"]


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize("method", sorted(WEIGHT_UPDATE_RPCS))
def test_prefix_cache_kept_by_default(method):
    engine, calls = _engine_core(reset_on_update=False)

    engine.collective_rpc(method)

    engine.scheduler.reset_prefix_cache.assert_not_called()
    assert calls == ["rpc"]


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
@pytest.mark.parametrize(
    "method",
    [
        "start_weight_update",
        "update_weights",
        "get_model",
        "compute_weight_checksums",
        lambda worker: None,
    ],
)
def test_other_rpcs_keep_prefix_cache(method):
    engine, calls = _engine_core()

    engine.collective_rpc(method)

    engine.scheduler.reset_prefix_cache.assert_not_called()
    assert calls == ["rpc"]


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_failed_weight_update_raises_without_reset():
    engine, _ = _engine_core()
    engine.model_executor.collective_rpc.side_effect = RuntimeError("load failed")

    with pytest.raises(RuntimeError, match="load failed"):
        engine.collective_rpc("reload_weights")

    engine.scheduler.reset_prefix_cache.assert_not_called()


@pytest.mark.cpu_test
@pytest.mark.skip_global_cleanup
def test_weight_update_fails_if_connector_cache_is_not_reset():
    engine, calls = _engine_core(connector_reset_ok=False)

    with pytest.raises(RuntimeError, match="KV connector cache"):
        engine.collective_rpc("finish_weight_update")

    assert calls == ["rpc", "reset"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("reset_on_update", [True, False])
def test_reload_weights_and_prefix_cache_hits(tiny_llama, reset_on_update):
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=tiny_llama,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=True,
        reset_prefix_cache_on_weight_update=reset_on_update,
        block_size=32,  # a multiple of 32 also suits the CPU backend
        max_model_len=256,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 * 1024 * 1024,
    )
    # Four full blocks: every block but the last one can be served from cache.
    prompt = {"prompt_token_ids": list(range(1, 129))}
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    assert llm.generate(prompt, params)[0].num_cached_tokens == 0
    assert llm.generate(prompt, params)[0].num_cached_tokens > 0

    llm.collective_rpc("reload_weights")

    cached = llm.generate(prompt, params)[0].num_cached_tokens
    if reset_on_update:
        assert cached == 0
    else:
        # vLLM's default: the prompt is served from KV of the old weights.
        assert cached > 0
    del llm
