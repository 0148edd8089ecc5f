"""``vllm-rlpatch doctor``: what is installed, what the plugin did, and what an engine would get.

Without ``--model`` it reports versions, the entry point, the start-up hook, the environment variables
and every patch's state and reason (after applying them in this process exactly as vLLM would). With
``--model PATH [engine args...]`` it also builds that engine's ``VllmConfig`` through vLLM's own CLI
parser and ``create_engine_config`` (no engine is started, no weights are loaded) and lists the
RL-relevant settings with their provenance: ``user``, ``plugin`` or ``stock``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from typing import Any, NoReturn

from packaging.version import Version

from vllm_rlpatch import __version__, envs, plugin, registry
from vllm_rlpatch.hooks import config as config_hook
from vllm_rlpatch.hooks import explicit
from vllm_rlpatch.hooks import inflight as hooks_inflight
from vllm_rlpatch.patches import kv_cache_pin, prefix_cache
from vllm_rlpatch.tools import options, usermodel
from vllm_rlpatch.tools.usermodel import INSTALL_VLLM, ToolError
from vllm_rlpatch.trainer import engine_rules
from vllm_rlpatch.versions import NEWEST_TESTED, TESTED_VERSIONS, vllm_info

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "rlpatch"

# (label, path in VllmConfig, EngineArgs field)
RL_SETTINGS = (
    ("logprobs_mode", "model_config.logprobs_mode", "logprobs_mode"),
    ("generation_config", "model_config.generation_config", "generation_config"),
    ("enable_prefix_caching", "cache_config.enable_prefix_caching", "enable_prefix_caching"),
    ("async_scheduling", "scheduler_config.async_scheduling", "async_scheduling"),
    ("kv_cache_memory_bytes", "cache_config.kv_cache_memory_bytes", "kv_cache_memory_bytes"),
    ("worker_extension_cls", "parallel_config.worker_extension_cls", "worker_extension_cls"),
    ("dtype", "model_config.dtype", "dtype"),
)


def _entry_point() -> dict[str, Any]:
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    filt = os.environ.get("VLLM_PLUGINS")
    names = None if filt is None else filt.split(",")
    loads = bool(eps) and (names is None or ENTRY_POINT_NAME in names)
    why = ("registered" if eps else "NOT registered (is vllm-rlpatch installed in this environment?)")
    if eps and not loads:
        why = f"registered but filtered out by VLLM_PLUGINS={filt!r} (add {ENTRY_POINT_NAME!r})"
    return {"registered": bool(eps), "value": eps[0].value if eps else None, "vllm_loads_it": loads,
            "detail": why}


def _torch() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def _vllm_platform() -> str | None:
    try:
        from vllm.platforms import current_platform

        return f"{type(current_platform).__name__} ({getattr(current_platform, 'device_name', '?')})"
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool, type(None))):
        return v
    return str(v)


def engine_parser():
    """vLLM's own parser of engine arguments, whose usage error is a :class:`ToolError` of one line: the command
    says it, instead of vLLM's usage block (some 250 lines) before it."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM 0.20
        from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef]

    class EngineArgsParser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise ToolError(f"vLLM engine arguments: {message}{options.option_hint(self, message)}")

    return EngineArgsParser(prog="vllm-rlpatch doctor --model PATH")


def engine_settings(model: str, engine_argv: list[str]) -> dict[str, Any]:
    """Build the engine config for ``model`` + CLI-style engine args; return settings with provenance."""
    from vllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(engine_parser())
    ns = parser.parse_args(["--model", model, *engine_argv])
    engine_args = EngineArgs.from_cli_args(ns)
    try:
        vllm_config = engine_args.create_engine_config()
    except Exception as e:  # vLLM's validation (pydantic) of the model + arguments: its first line says why
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise ToolError(f"vLLM rejects this engine configuration: {type(e).__name__}: {first}") from None
    decided = config_hook.settings_for(engine_args)
    rows = []
    for label, path, field in RL_SETTINGS:
        eff = _get_path(vllm_config, path)
        s = decided.get(field)
        if s is not None:
            row = {"setting": label, "value": _jsonable(eff), "source": s.source, "by": s.owner,
                   "stock": _jsonable(s.stock), "reason": s.reason, "detection": s.detection}
        else:
            is_user, how = explicit.is_explicit(engine_args, field) if hasattr(engine_args, field) else (False, "")
            row = {"setting": label, "value": _jsonable(eff), "source": "user" if is_user else "stock",
                   "by": None, "stock": None, "reason": "not touched by the plugin", "detection": how}
        rows.append(row)
    head = decided.get("head_dtype")
    if head is not None:  # vLLM < 0.32 has no head_dtype for generation: the plugin's value is the effective one
        rows.append({"setting": "lm_head dtype", "value": _jsonable(head.value), "source": head.source,
                     "by": head.owner, "stock": "model", "reason": head.reason, "detection": head.detection})
    rows.extend(_engine_core_policies(vllm_config))
    kv_rows, kv_warning = _kv_rows(vllm_config)
    rows.extend(kv_rows)
    out = {"model": model, "engine_args": engine_argv, "settings": rows}
    if kv_warning:
        out["warnings"] = [kv_warning]
    return out


def _kv_rows(vllm_config: Any) -> tuple[list[dict[str, Any]], str | None]:
    """KV capacity of a pinned engine (estimated from the model shape; the engine core logs the exact
    figure at start-up) and the declared rollout (VLLM_RLPATCH_ROLLOUT_TOKENS) against it."""
    pinned = _get_path(vllm_config, "cache_config.kv_cache_memory_bytes")
    rollout = envs.ROLLOUT_TOKENS.get()
    rows, warning = [], None
    est = kv_cache_pin.estimate_tokens(vllm_config, int(pinned)) if pinned else None
    if pinned:
        rows.append({"setting": "KV capacity (estimate)", "value": f"{est:,} tokens" if est is not None else "?",
                     "source": "plugin", "by": kv_cache_pin.NAME, "stock": None,
                     "reason": f"{envs.format_size(pinned)} / (K+V of every layer per token); exact figure in "
                               "the engine's start-up log", "detection": "model shape"})
    else:
        rows.append({"setting": "KV capacity", "value": "set at start-up", "source": "stock", "by": kv_cache_pin.NAME,
                     "stock": None, "reason": "not pinned: vLLM sizes the KV cache from gpu_memory_utilization when "
                     "the engine starts; next to a trainer that sleeps/wakes, pin it (`vllm-rlpatch kv-pin`)",
                     "detection": "kv_cache_memory_bytes unset"})
    if rollout is not None:
        warning = kv_cache_pin.check_rollout(est, rollout) if est is not None else None
        rows.append({"setting": "rollout tokens", "value": f"{rollout:,}", "source": "user", "by": kv_cache_pin.NAME,
                     "stock": None, "detection": "VLLM_RLPATCH_ROLLOUT_TOKENS",
                     "reason": ("TOO SMALL a KV cache: " + warning) if warning else
                     (f"fits the pinned KV cache ({est:,} tokens)" if est is not None else
                      "checked at engine start-up (the KV cache is not pinned)")})
    return rows, warning


def _engine_core_policies(vllm_config: Any) -> list[dict[str, Any]]:
    """What the engine core will do at a weight update (decided there from the environment and the config)."""
    st = {s.name: s for s in registry.status()}
    pc = st.get("prefix_cache")
    on = pc is not None and pc.state == "applied"
    caching = bool(_get_path(vllm_config, "cache_config.enable_prefix_caching"))
    mode = prefix_cache.effective_mode(prefix_cache.mode(), caching) if on else "stock"
    src = "user" if envs.toggle_is_set(prefix_cache.TOGGLE) else ("plugin" if on else "stock")
    reasons = {"salt": "requests salted with the weight version: no KV of older weights is ever reused",
               "reset": "prefix cache reset at every weight update (refused resets retried, salted meanwhile)",
               "off": "no prefix caching: nothing is reused", "stock": "vLLM's behaviour: KV of older weights "
               "can be reused after an update" + ("" if on else f" (prefix_cache {pc.state if pc else '?'})")}
    inflight = hooks_inflight.default(honour_env=True) if on else "keep (vLLM, unreported)"
    return [
        {"setting": "prefix_cache (at updates)", "value": mode, "source": src, "by": "prefix_cache",
         "stock": "stock", "reason": reasons[mode], "detection": "VLLM_RLPATCH_PREFIX_CACHE"},
        {"setting": "in-flight at updates", "value": inflight,
         "source": "user" if envs.toggle_is_set(envs.INFLIGHT) else ("plugin" if on else "stock"),
         "by": "prefix_cache", "stock": "keep", "reason": "requests running when the weights change",
         "detection": "VLLM_RLPATCH_INFLIGHT"},
    ]


TRAINER_NOTE = ("trainer side: compute the reference logprobs with the same sampling transform (temperature, "
                "top-k/top-p) the rollouts used - processed_logprobs are that distribution's")


def _head_note(statuses: list[Any]) -> str:
    st = {s.name: s.state for s in statuses}.get("fp32_lm_head")
    if st == "applied":
        return ("fp32_lm_head is on: the engine's logits are float32, so compute the trainer's in float32 too "
                "(vllm_rlpatch.trainer.fp32_lm_head(model)); fp32 on one side only can make the mismatch worse")
    return (f"fp32_lm_head is {st}: the engine's logits are in the model dtype; keep the trainer's head in the "
            "model dtype too, or turn the patch on and use vllm_rlpatch.trainer.fp32_lm_head(model)")


def _support_note(statuses: list[Any]) -> str:
    """Which rules the trainer twin follows for an engine of this host, and how to ask for the engine's support
    information."""
    st = {s.name: s.state for s in statuses}.get("sampling_support")
    try:
        from vllm.platforms import current_platform

        device = str(getattr(current_platform, "device_type", "") or "cpu")
    except Exception:
        device = "cpu"
    info = vllm_info()
    runner = "v1"
    if device == "cuda" and info.release >= Version("0.29") and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0":
        runner = "mrv2"
    rules = engine_rules({"vllm": info.raw_version, "runner": runner, "device": device})
    ask = ("requests that pass SamplingParams(extra_args={'rlpatch_support': True}) get "
           "CompletionOutput.rlpatch_support (per token: log mass and size of the kept set)"
           if st == "applied" and runner == "v1" else
           f"no per-token support information from this engine (sampling_support {st}, runner {runner})")
    return (f"trainer side: vllm_rlpatch.trainer.processed_logprobs follows this engine's processing "
            f"({rules.key}: {'verified' if rules.verified else 'not verified here'}); {ask}")


def collect(model: str | None = None, engine_argv: list[str] | None = None) -> dict[str, Any]:
    env_warnings = envs.validate_environment()
    info = vllm_info()
    if info.installed:
        plugin.register_as("doctor")  # apply exactly as vLLM would in its processes
    report: dict[str, Any] = {
        "vllm_rlpatch": __version__,
        "vllm": {"version": info.raw_version, "distribution": info.distribution, "installed": info.installed,
                 "newest_tested": str(NEWEST_TESTED), "tested": list(TESTED_VERSIONS),
                 "untested": info.untested if info.installed else None},
        "torch": _torch(),
        "python": sys.version.split()[0],
        "platform": {"os": platform.platform(), "machine": platform.machine(),
                     "vllm_platform": _vllm_platform() if info.installed else None},
        "entry_point": _entry_point(),
        "startup_hook": {"explicit_args_capture": explicit.active() if info.installed else None,
                         "detail": (None if not info.installed else
                                    "active: user-passed engine arguments are told apart from defaults"
                                    if explicit.active() else
                                    "inactive: vllm_rlpatch_startup.pth not processed; explicitness is inferred "
                                    "by comparing with stock defaults")},
        "process": {"pid": os.getpid(), "role": plugin.process_role(),
                    "register_seconds": plugin.register_seconds()},
        "env": {"warnings": env_warnings,
                "set": {k: v for k, v in os.environ.items() if k.startswith(envs.PREFIX)}},
        "patches": [s.as_dict() for s in registry.status()],
        "notes": [TRAINER_NOTE, _head_note(registry.status()), _support_note(registry.status())]
        if info.installed else [],
    }
    if model is not None:
        report["engine"] = engine_settings(model, engine_argv or [])
    return report


def render(report: dict[str, Any]) -> str:
    v = report["vllm"]
    if not v["installed"]:
        lines = [
            f"vllm-rlpatch {report['vllm_rlpatch']}",
            f"  vLLM      NOT INSTALLED in this Python environment: the plugin has nothing to patch; {INSTALL_VLLM}",
            f"  torch     {report['torch'] or 'not installed'}   python {report['python']}",
            f"  platform  {report['platform']['os']}",
            f"  entry point  {report['entry_point']['detail']}",
        ]
        lines += [f"  WARNING  {w}" for w in report["env"]["warnings"]]
        lines.append(f"  patches   {len(report['patches'])} known, none can apply without vLLM "
                     "(`vllm-rlpatch patches` lists them)")
        return "\n".join(lines)
    lines = [
        f"vllm-rlpatch {report['vllm_rlpatch']}",
        f"  vLLM      {v['version']} (distribution {v['distribution']}; newest tested {v['newest_tested']}"
        + ("; UNTESTED" if v.get("untested") else "") + ")",
        f"  torch     {report['torch']}   python {report['python']}",
        f"  platform  {report['platform']['os']}; vLLM platform {report['platform']['vllm_platform']}",
        f"  entry point  {report['entry_point']['detail']}",
        f"  start-up hook  {report['startup_hook']['detail']}",
    ]
    for w in report["env"]["warnings"]:
        lines.append(f"  WARNING  {w}")
    lines.append("")
    lines.append(f"  {'patch':<22} {'state':<12} reason")
    for p in report["patches"]:
        lines.append(f"  {p['name']:<22} {p['state']:<12} {p['reason']}")
    for n in report.get("notes", []):
        lines.append(f"  note: {n}")
    eng = report.get("engine")
    if eng:
        lines.append("")
        lines.append(f"  engine settings for {eng['model']} {' '.join(eng['engine_args'])}".rstrip())
        lines.append(f"  {'setting':<26} {'value':<48} {'source':<7} reason")
        for r in eng["settings"]:
            val = str(r["value"])
            val = val if len(val) <= 48 else val[:45] + "..."
            lines.append(f"  {r['setting']:<26} {val:<48} {r['source']:<7} {r['reason']}")
        for w in eng.get("warnings", []):
            lines.append(f"  WARNING  {w}")
    return "\n".join(lines)


@options.scoped_log_level
def main(argv: list[str]) -> int:

    ap = options.parser("vllm-rlpatch doctor", __doc__.split("\n\n")[0].replace("``", ""))
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    usermodel.add_model_options(ap, help="also show the RL-relevant settings an engine for this model would get ("
                                + usermodel.MODEL_HELP + "); further arguments are vLLM engine arguments (e.g. "
                                "--logprobs-mode raw_logprobs)")
    options.add_log_options(ap)
    args, rest = ap.parse_known_args(argv)
    options.apply_log_options(args)
    if rest and args.model is None:
        ap.error(f"unrecognized arguments: {' '.join(rest)}; engine arguments need --model")
    if args.model is not None:
        try:
            args.model = usermodel.resolve_for(args, "doctor --model")
        except usermodel.ToolError as e:
            print(f"vllm-rlpatch doctor: {e}", file=sys.stderr)
            return 2
    # vLLM logs to stdout: keep stdout for the report alone (its log lines go to stderr meanwhile).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    err = None
    try:
        report = collect(args.model, rest)
    except SystemExit as e:  # vLLM's own parser rejected an engine argument (it printed why)
        return int(e.code) if isinstance(e.code, int) else 2
    except usermodel.ToolError as e:
        err = e
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if err is not None:
        print(f"vllm-rlpatch doctor: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))
    return 0
