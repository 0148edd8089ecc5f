# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""CPU workers request the AMX tile permission before any AMX kernel runs.

Without it, Linux kills the worker with SIGILL at its first AMX tile
instruction (e.g. in the CPU attention kernel, for bf16 and a block size that
is a multiple of 32), unless a oneDNN kernel happened to request it first.
"""

import platform
import subprocess
import sys
from unittest.mock import patch

import pytest
import torch

from vllm.platforms import current_platform

if not current_platform.is_cpu():
    pytest.skip("CPU-only test", allow_module_level=True)

import vllm.platforms.cpu as cpu_platform  # noqa: E402
from vllm.v1.worker.cpu_worker import CPUWorker  # noqa: E402

_CHECK_PERMISSION = """
import ctypes

from vllm.platforms.cpu import request_amx_tile_permission

request_amx_tile_permission()
mask = ctypes.c_ulong(0)
# arch_prctl(ARCH_GET_XCOMP_PERM, &mask) on x86_64
assert ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask)) == 0
print("XTILEDATA", bool(mask.value & (1 << 18)))
"""


@pytest.mark.parametrize("has_amx", [True, False])
def test_requests_permission_only_with_amx(has_amx):
    with (
        patch.object(torch.cpu, "_is_amx_tile_supported", return_value=has_amx),
        patch.object(torch.cpu, "_init_amx", return_value=True) as init_amx,
        patch.object(cpu_platform, "logger") as logger,
    ):
        cpu_platform.request_amx_tile_permission()

    assert init_amx.call_count == int(has_amx)
    logger.warning.assert_not_called()


def test_warns_when_permission_is_refused():
    with (
        patch.object(torch.cpu, "_is_amx_tile_supported", return_value=True),
        patch.object(torch.cpu, "_init_amx", return_value=False),
        patch.object(cpu_platform, "logger") as logger,
    ):
        cpu_platform.request_amx_tile_permission()

    logger.warning.assert_called_once()


def test_init_device_requests_permission_first():
    class Requested(Exception):
        pass

    worker = CPUWorker.__new__(CPUWorker)
    with (
        patch(
            "vllm.v1.worker.cpu_worker.request_amx_tile_permission",
            side_effect=Requested,
        ),
        pytest.raises(Requested),
    ):
        worker.init_device()


@pytest.mark.skipif(
    not (
        sys.platform == "linux"
        and platform.machine() == "x86_64"
        and torch.cpu._is_amx_tile_supported()
    ),
    reason="needs Linux on an x86_64 CPU with AMX",
)
def test_permission_is_granted_in_a_fresh_process():
    result = subprocess.run(
        [sys.executable, "-c", _CHECK_PERMISSION],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "XTILEDATA True" in result.stdout
