# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Weight updates are refused while the model weights are asleep.

Level 1 sleep offloads the weights and wake-up restores the offloaded copy,
level 2 discards them: an update written in between is lost or faults. These
tests exercise EngineCore.collective_rpc with the executor's real sleep/wake
bookkeeping and a mocked worker boundary.
"""

from unittest.mock import Mock

import pytest

from vllm.v1.engine.core import WEIGHT_WRITING_RPCS, EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor

pytestmark = [pytest.mark.cpu_test, pytest.mark.skip_global_cleanup]


def _engine_core() -> EngineCore:
    executor = UniProcExecutor.__new__(UniProcExecutor)
    executor.sleeping_tags = set()
    executor.collective_rpc = Mock(return_value=[None])
    engine = EngineCore.__new__(EngineCore)
    engine.model_executor = executor
    engine.scheduler = Mock()
    return engine


def _worker_rpcs(engine: EngineCore) -> list:
    calls = engine.model_executor.collective_rpc.call_args_list
    return [call.args[0] for call in calls]


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("method", sorted(WEIGHT_WRITING_RPCS))
def test_weight_update_refused_while_weights_asleep(level, method):
    engine = _engine_core()
    engine.model_executor.sleep(level)

    with pytest.raises(RuntimeError, match="asleep"):
        engine.collective_rpc(method)

    assert _worker_rpcs(engine) == ["sleep"]


def test_update_after_waking_weights_only():
    # The documented level 2 flow: wake the weights, update, wake the KV cache.
    engine = _engine_core()
    engine.model_executor.sleep(2)
    engine.model_executor.wake_up(["weights"])

    engine.collective_rpc("reload_weights")
    engine.model_executor.wake_up(["kv_cache"])

    assert _worker_rpcs(engine) == ["sleep", "wake_up", "reload_weights", "wake_up"]
    assert not engine.model_executor.is_sleeping


@pytest.mark.parametrize(
    "method", ["get_model", "compute_weight_checksums", lambda worker: None]
)
def test_other_rpcs_allowed_while_asleep(method):
    engine = _engine_core()
    engine.model_executor.sleep(1)

    engine.collective_rpc(method)

    assert _worker_rpcs(engine) == ["sleep", method]


def test_weight_update_allowed_when_awake():
    engine = _engine_core()

    engine.collective_rpc("update_weights", kwargs={"update_info": {}})

    engine.model_executor.collective_rpc.assert_called_once_with(
        "update_weights", None, (), {"update_info": {}}
    )
