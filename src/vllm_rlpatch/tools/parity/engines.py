"""The engine side of ``vllm-rlpatch parity``: each configuration's engine in its own process
(:mod:`vllm_rlpatch.tools._parity_engine`, its patches chosen by environment before vLLM is imported), its
progress events turned into progress steps, its result read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_rlpatch.tools import usermodel
from vllm_rlpatch.tools.parity.configs import DERIVED, ParityError, config_env


def default_engine_args(model: str, user: dict[str, Any] | None = None) -> dict[str, Any]:
    """Our engine defaults sized to ``model`` (max_model_len = min(1024, its positions); on CPU no chunked
    prefill), then ``user``'s arguments. See :func:`vllm_rlpatch.tools.usermodel.engine_args`."""
    import torch

    return usermodel.engine_args(model, user, cpu=not torch.cuda.is_available())


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_RLPATCH_")}


class Progress:
    """Progress steps on stderr: a tqdm bar, or ``[parity i/N]`` lines without tqdm; nothing when not
    ``enabled``."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        self.done = 0
        self.total = total
        self.enabled = enabled
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc="parity", unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, desc: str, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix_str(desc, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            print(f"[parity {self.done}/{self.total}] {desc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_config(name: str, spec: dict, workdir: Path, progress: Progress, timeout: float) -> dict:
    spec = dict(spec, config=name, out=str(workdir / f"{name}.result.json"),
                refit_method="reload_weights" if name == "stock" else "push_weights",
                support=name in DERIVED.values())  # its requests ask for the engine's support information
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    env = _clean_env()
    env.update(config_env(name))
    steps_per_run = 3
    expected = 1 + steps_per_run * len(spec["prompts"])
    seen = 0
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_rlpatch.tools._parity_engine", str(spec_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if line.startswith("@@parity "):
                ev = json.loads(line[9:])
                st = ev.get("stage")
                if st in ("ready", "generated", "refit"):
                    seen += 1
                    label = {"ready": "engine up", "refit": "weights updated"}.get(st, ev.get("phase", st))
                    progress.step(f"{name}: {label}")
            if time.monotonic() > deadline:
                proc.kill()
                break
        rc = proc.wait()
    if seen < expected:
        progress.step(f"{name}: failed", expected - seen)
    res_path = Path(spec["out"])
    if not res_path.exists():
        tail = log_path.read_text()[-4000:]
        raise ParityError(f"configuration {name}: the engine process exited with {rc} and wrote no result "
                          f"(log: {log_path})\n{tail}")
    res = json.loads(res_path.read_text())
    res["log"] = str(log_path)
    res["env"] = config_env(name)
    if not res.get("ok"):
        tail = log_path.read_text()[-3000:]
        raise ParityError(f"configuration {name} failed: {res.get('error')}\n{res.get('traceback', '')}\n"
                          f"log tail ({log_path}):\n{tail}")
    return res
