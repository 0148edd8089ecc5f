"""Every ``VLLM_RLPATCH_*`` environment variable, in one place.

Each variable has a parser that validates its value; an invalid value raises :class:`EnvError` naming
the variable and what it accepts. Per-patch toggles (``VLLM_RLPATCH_<NAME>=0|1``) are generated from the
patch specs (see :mod:`vllm_rlpatch.patches`), so the list below and ``vllm-rlpatch doctor`` cannot drift.

Values are read lazily (at call time), like vLLM's own ``envs.py``: tests and launchers may set them after
import. Ray actors and vLLM's worker processes inherit every ``VLLM_*`` variable, so these reach all
processes of an engine.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

PREFIX = "VLLM_RLPATCH_"

logger = logging.getLogger("vllm.rlpatch")


class EnvError(ValueError):
    """An invalid ``VLLM_RLPATCH_*`` value."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise EnvError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in choices:
            raise EnvError(f"{name}={raw!r} is not valid; use one of: {', '.join(choices)}")
        return v

    parse.choices = choices  # type: ignore[attr-defined]
    return parse


def _positive(kind: type, lo: float, hi: float) -> Callable[[str, str], Any]:
    def parse(name: str, raw: str) -> Any:
        try:
            v = kind(raw.strip())
        except ValueError:
            raise EnvError(f"{name}={raw!r} is not a {'number' if kind is float else 'whole number'}") from None
        if not lo <= v <= hi:
            raise EnvError(f"{name}={raw!r} is out of range; use {lo:g}..{hi:g}")
        return v

    return parse


def _directory(name: str, raw: str) -> str:
    if not raw.strip():
        raise EnvError(f"{name} is set but empty; give a directory path or unset it")
    return raw


@dataclass(frozen=True)
class EnvVar:
    name: str
    parser: Callable[[str, str], Any]
    default: Any
    doc: str

    def raw(self) -> str | None:
        """The variable as set (None when unset), unparsed: for reports."""
        return os.environ.get(self.name)

    def get(self) -> Any:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        return self.parser(self.name, raw)


# Global (not per-patch) variables. Per-patch toggles are added by `patch_toggle()`.
ENABLED = EnvVar(
    PREFIX + "ENABLED", parse_bool, True,
    "Kill switch. 0 = the plugin applies no patch in any process (each reports `disabled`).",
)
PROFILES = ("rl", "stock")
PROFILE = EnvVar(
    PREFIX + "PROFILE", _choice(*PROFILES), "rl",
    "`rl` (default): every patch as its toggle says. `stock`: vLLM's own behaviour, i.e. every patch off "
    "except the host-compatibility fixes (`host_fix` specs such as `cpu_amx_permission`, without which stock "
    "vLLM cannot run on some hosts); what the tests' and `parity`'s stock configurations use.",
)
STRICT = EnvVar(
    PREFIX + "STRICT", parse_bool, False,
    "1 = any patch that fails to apply raises (default: a failed default patch logs a WARNING; "
    "a patch enabled explicitly with VLLM_RLPATCH_<NAME>=1 always raises).",
)
LOG_LEVEL = EnvVar(
    PREFIX + "LOG_LEVEL", _choice("debug", "info", "warning", "error"), None,
    "Level of the `vllm.rlpatch` logger (default: inherit vLLM's). The per-process summary is INFO, "
    "per-patch details DEBUG.",
)
STATUS_DIR = EnvVar(
    PREFIX + "STATUS_DIR", _directory, None,
    "If set, every process that loads the plugin writes `<pid>.json` there: role, vLLM version and "
    "each patch's state (a side channel for launchers and tests).",
)

INFLIGHT_MODES = ("recompute", "abort", "keep", "refuse")
INFLIGHT = EnvVar(
    PREFIX + "INFLIGHT", _choice(*INFLIGHT_MODES), "recompute",
    "What happens to requests running when the weights change (needs `prefix_cache` on): `recompute` "
    "(default: they are preempted and their KV is rebuilt with the new weights, generation goes on), "
    "`abort` (they finish with finish_reason `abort`), `keep` (they go on with the KV of the old weights; "
    "their version spans report it), `refuse` (an update RPC vLLM knows is refused while requests run).",
)

PORT_LEASE_S = EnvVar(
    PREFIX + "PORT_LEASE_S", _positive(float, 0.1, 86400), 120.0,
    "Seconds a port chosen for a TCPStore stays leased (host-wide, other vllm-rlpatch processes skip it) "
    "while the process that will bind it starts (`tcpstore_port`).",
)
PORT_BAND = EnvVar(
    PREFIX + "PORT_BAND", _positive(int, 1, 65535), 512,
    "Ports tried from VLLM_PORT upwards before a MessageQueue or TCPStore gives up with an error naming "
    "the range (`mq_bind_retry`, `tcpstore_port`).",
)
PORT_LEASE_DIR = EnvVar(
    PREFIX + "PORT_LEASE_DIR", _directory, None,
    "Where port leases live (default /tmp/vllm-rlpatch-ports-<uid>); processes must share it to see each "
    "other's leases.",
)

SRC_CACHE = EnvVar(
    PREFIX + "SRC_CACHE", _directory, None,
    "Where `vllm-rlpatch upstream` keeps the pristine vLLM sources it applies its diffs to (default "
    "~/.cache/vllm-rlpatch/src).",
)


def _token(name: str, raw: str) -> str:
    if len(raw.strip()) < 16:
        raise EnvError(f"{name} is too short ({len(raw.strip())} characters); use at least 16 random characters")
    return raw.strip()


REFIT_SHM_DIR = EnvVar(
    PREFIX + "REFIT_SHM_DIR", _directory, None,
    "Where the `shm` refit transport puts its segments (default /dev/shm; trainer and engine must share it).",
)
HTTP_TOKEN = EnvVar(
    PREFIX + "HTTP_TOKEN", _token, None,
    "Bearer token of the refit routes on `vllm serve` (/rlpatch/v1/...). Unset: the server generates one and "
    "writes it to ~/.cache/vllm-rlpatch/http-token-<port> (mode 0600), where same-host clients find it.",
)
HTTP_REMOTE = EnvVar(
    PREFIX + "HTTP_REMOTE", parse_bool, False,
    "1 = the refit routes also accept clients that are not on loopback (the token is still required).",
)

_DECIMAL = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_BINARY = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# vLLM's own CLI convention (human_readable_int): lower-case k/m/g/t decimal, upper-case K/M/G/T binary
_VLLM_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SIZE_HELP = ("a byte count: 21474836480, 20GiB, 20.5GiB, 21.5GB, or vLLM's CLI form (20G = 20 GiB, 20g = 20e9); "
             "KiB/MiB/GiB/TiB are binary, KB/MB/GB/TB decimal")


def parse_size(raw: str, what: str = "value") -> int:
    """``"20GiB"`` -> 21474836480. Raises :class:`EnvError` naming ``what`` and the accepted forms."""
    import re

    text = str(raw).strip().replace("_", "").replace(" ", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", text)
    if not m:
        raise EnvError(f"{what}={raw!r} is not a size; use {SIZE_HELP}")
    number, unit = float(m.group(1)), m.group(2)
    if unit in _VLLM_SUFFIX:
        mult = _VLLM_SUFFIX[unit]
    elif unit.lower() in _DECIMAL:
        mult = _DECIMAL[unit.lower()]
    elif unit.lower() in _BINARY:
        mult = _BINARY[unit.lower()]
    else:
        raise EnvError(f"{what}={raw!r}: unknown unit {unit!r}; use {SIZE_HELP}")
    value = int(number * mult)
    if value <= 0:
        raise EnvError(f"{what}={raw!r} must be larger than 0")
    return value


def format_size(n: int | float) -> str:
    """21474836480 -> '20.00 GiB' (binary units, 2 decimals)."""
    n = float(n)
    for unit, mult in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= mult:
            return f"{n / mult:.2f} {unit}"
    return f"{int(n)} B"


def parse_token_count(raw: str, what: str = "value") -> int:
    """Tokens a rollout step keeps in the KV cache at once: ``262144``, ``256k``/``1.5M`` (decimal), or
    ``SEQSxLEN`` (concurrent sequences x prompt+generation length, e.g. ``256x4096``)."""
    import re

    text = str(raw).strip().replace("_", "").replace(" ", "").lower()
    m = re.fullmatch(r"(\d+)[x*](\d+)", text)
    if m:
        value = int(m.group(1)) * int(m.group(2))
    else:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([km]?)", text)
        if not m:
            raise EnvError(f"{what}={raw!r} is not a token count; use a number (262144, 256k, 1.5M) or "
                           "SEQSxLEN (256x4096: concurrent sequences x prompt+generation tokens)")
        value = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6}[m.group(2)])
    if value <= 0:
        raise EnvError(f"{what}={raw!r} must be larger than 0")
    return value


KV_CACHE_BYTES = EnvVar(
    PREFIX + "KV_CACHE_BYTES", lambda name, raw: parse_size(raw, name), None,
    "KV-cache pin: applied as `kv_cache_memory_bytes` to every engine that did not set it (`kv_cache_pin`); "
    "`vllm-rlpatch kv-pin` measures the value that survives sleep -> trainer -> wake. Accepts " + SIZE_HELP + ".",
)
BACKUP_HOST_BYTES = EnvVar(
    PREFIX + "BACKUP_HOST_BYTES", lambda name, raw: parse_size(raw, name), None,
    "Most host memory a refit's backup (the `rollback` guarantee) may use, pinned next to a CUDA model "
    "(default: half the host's available memory). A backup that does not fit is refused before anything is "
    "written (`validate-then-write` or `mode=\"direct\"` are offered), never spilled to pageable memory.",
)
FAULT_INJECTION = EnvVar(
    PREFIX + "FAULT_INJECTION", parse_bool, False,
    "Testing only: 1 lets a refit request inject a fault (`_inject_fault`) into the worker transaction "
    "(before the first write, after the first write, or on one rank), to test what each guarantee level leaves. "
    "Ignored (the request is refused) when unset.",
)
ROLLOUT_TOKENS = EnvVar(
    PREFIX + "ROLLOUT_TOKENS", lambda name, raw: parse_token_count(raw, name), None,
    "Tokens the rollout keeps in the KV cache at once (`262144`, `256k`, or `256x4096` = concurrent sequences x "
    "prompt+generation length): an engine whose KV cache holds fewer WARNs at start-up and `doctor` flags it "
    "(requests would queue or be preempted: the silent throughput drop of a too-small pin).",
)

GLOBAL_VARS: tuple[EnvVar, ...] = (ENABLED, PROFILE, STRICT, LOG_LEVEL, STATUS_DIR, INFLIGHT, PORT_LEASE_S, PORT_BAND,
                                   PORT_LEASE_DIR, SRC_CACHE, REFIT_SHM_DIR, HTTP_TOKEN, HTTP_REMOTE, KV_CACHE_BYTES,
                                   BACKUP_HOST_BYTES, FAULT_INJECTION, ROLLOUT_TOKENS)


def patch_toggle(patch_name: str, default: bool) -> EnvVar:
    return EnvVar(
        PREFIX + patch_name.upper(), parse_bool, default,
        f"1/0 turns the `{patch_name}` patch on/off (default {'on' if default else 'off'}).",
    )


def mode_toggle(patch_name: str, choices: tuple[str, ...], default: str, off: str, doc: str,
                aliases: dict[str, str] | None = None) -> EnvVar:
    """A patch toggle that takes a mode instead of 1/0; ``off`` is the mode that disables the patch.
    ``aliases`` maps extra spellings (e.g. ``0``/``1``) to modes."""
    aliases = dict(aliases or {})
    base = _choice(*choices, *aliases)

    def parse(name: str, raw: str) -> str:
        v = base(name, raw)
        return aliases.get(v, v)

    parse.choices = choices  # type: ignore[attr-defined]
    parse.off = off  # type: ignore[attr-defined]
    return EnvVar(PREFIX + patch_name.upper(), parse, default, doc)


def is_off(var: EnvVar, value: Any) -> bool:
    """Is ``value`` (what ``var.get()`` returned) the patch-disabling value of this toggle?"""
    off = getattr(var.parser, "off", None)
    return (value == off) if off is not None else not value


def toggle_is_set(var: EnvVar) -> bool:
    return var.name in os.environ


_PATCH_TOGGLES: list[EnvVar] = []


def declare_patch_toggles(toggles: list[EnvVar]) -> None:
    """The per-patch toggles (``VLLM_RLPATCH_<NAME>``), handed over by the registry with the patch list."""
    _PATCH_TOGGLES[:] = toggles


def all_vars() -> list[EnvVar]:
    return [*GLOBAL_VARS, *_PATCH_TOGGLES]


def known_names() -> list[str]:
    return [v.name for v in all_vars()]


_WARNED: set[str] = set()  # unknown names this process has logged


def warn_unknown() -> list[str]:
    """A message for each set ``VLLM_RLPATCH_*`` name that no variable has (with the closest known name),
    each logged as a WARNING once per process, however many readers of the environment ask. Complete only
    once the patch toggles are declared (the composition root does both)."""
    known = known_names()
    warnings: list[str] = []
    for name in sorted(os.environ):
        if not name.startswith(PREFIX) or name in known:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        msg = f"unknown environment variable {name} (ignored){hint}"
        warnings.append(msg)
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning("vllm-rlpatch: %s", msg)
    return warnings


def validate_environment() -> list[str]:
    """Parse every set ``VLLM_RLPATCH_*`` variable.

    Raises :class:`EnvError` on the first invalid value. Returns the unknown names' messages
    (:func:`warn_unknown`, which logs each once per process).
    """
    warnings = warn_unknown()
    known = {v.name: v for v in all_vars()}
    for name in sorted(os.environ):
        if name in known:
            known[name].get()  # raises EnvError on a bad value
    return warnings


def describe() -> list[dict[str, Any]]:
    """The documented variables with their current raw values (for `doctor`)."""
    return [
        {"name": v.name, "default": v.default, "doc": v.doc,
         "value": ("<set>" if os.environ.get(v.name) and v is HTTP_TOKEN else os.environ.get(v.name))}
        for v in all_vars()
    ]
