"""What every ``vllm-rlpatch`` command shares: plain-text help that shows each option's default, and
``--quiet`` / ``--verbose`` for vLLM's log level in the command's own process (so the report stands out)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os

LEVELS = {"quiet": "ERROR", "default": "WARNING", "verbose": "INFO", "debug": "DEBUG"}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; every option with a default says it (flags and unset options do not). Long
    options only: doctor and kv-pin pass unknown options to vLLM, whose -q is --quantization."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        unset = (action.default is None or action.default is False or action.default is argparse.SUPPRESS
                 or isinstance(action, argparse._CountAction))
        if unset or "%(default)" in help_ or "(default" in help_ or "default:" in help_:
            return help_
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{help_} (default: %(default)s)" if help_ else "(default: %(default)s)"
        return help_


def parser(prog: str, description: str | None = None, **kw) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kw)


def add_log_options(ap: argparse.ArgumentParser) -> None:
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true",
                   help="vLLM logs errors only, and no progress lines (default: vLLM's warnings, progress shown)")
    g.add_argument("--verbose", action="count", default=0,
                   help="vLLM's INFO log lines too (twice: DEBUG)")


def apply_log_options(args: argparse.Namespace) -> str:
    """Set vLLM's log level for this process and the engine processes it starts (before vLLM is imported).
    A ``VLLM_LOGGING_LEVEL`` the user set wins unless they passed -q/-v. Returns the level."""
    verbose = getattr(args, "verbose", 0) or 0
    if getattr(args, "quiet", False):
        level = LEVELS["quiet"]
    elif verbose:
        level = LEVELS["verbose"] if verbose == 1 else LEVELS["debug"]
    elif "VLLM_LOGGING_LEVEL" in os.environ:
        return os.environ["VLLM_LOGGING_LEVEL"]
    else:
        level = LEVELS["default"]
    os.environ["VLLM_LOGGING_LEVEL"] = level
    return level


@contextlib.contextmanager
def own_log_level():
    """Around a command run in-process (tests, notebooks): the ``VLLM_LOGGING_LEVEL`` that
    :func:`apply_log_options` sets for the command's vLLM does not outlive it."""
    before = os.environ.get("VLLM_LOGGING_LEVEL")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
        else:
            os.environ["VLLM_LOGGING_LEVEL"] = before


def scoped_log_level(fn):
    """Decorator for a command's ``main``: see :func:`own_log_level`."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with own_log_level():
            return fn(*args, **kwargs)

    return wrapper
