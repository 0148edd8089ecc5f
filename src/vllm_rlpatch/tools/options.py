"""What every ``vllm-rlpatch`` command shares: plain-text help that shows each option's default, usage errors
of one line (with a "did you mean" for a near miss), and ``--quiet`` / ``--verbose`` for vLLM's log level in the
command's own process (so the report stands out)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
from collections.abc import Iterable
from typing import NoReturn

LEVELS = {"quiet": "ERROR", "default": "WARNING", "verbose": "INFO", "debug": "DEBUG"}
UNRECOGNIZED = "unrecognized arguments: "  # argparse's wording of an unknown option, the one error with a hint
LONG_OPTION = re.compile(r"(?<!\S)--[\w-]+")


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


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of neighbours (optimal string alignment) from a to b."""
    prev2, prev = [], list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            d = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                d = min(d, prev2[j - 2] + 1)
            cur.append(d)
        prev2, prev = prev, cur
    return prev[-1]


def suggestion(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate ``word`` is a typo of, or None. A typo is a few edits away: 1 for a word of up to 4
    letters, 2 up to 12, 3 beyond (leading dashes not counted); anything further is a different word, and
    suggesting it misleads more than it helps (``--bogus`` is not ``bounds``)."""
    size = len(word.lstrip("-"))
    allowed = 1 if size <= 4 else 2 if size <= 12 else 3
    best = min(candidates, key=lambda c: edit_distance(word, c), default=None)
    return best if best is not None and edit_distance(word, best) <= allowed else None


def option_hint(ap: argparse.ArgumentParser, message: str) -> str:
    """``; did you mean '--x'?`` for an argparse "unrecognized arguments" error whose first unknown option is a
    typo of one of ``ap``'s options, else ``""``."""
    first = LONG_OPTION.search(message, len(UNRECOGNIZED)) if message.startswith(UNRECOGNIZED) else None
    if first is None:
        return ""
    known = (s for action in ap._actions for s in action.option_strings if s.startswith("--"))
    close = suggestion(first.group(), known)
    return f"; did you mean {close!r}?" if close else ""


class ArgumentParser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit 2: ``PROG: what is wrong (see PROG --help)``. argparse's
    usage block before it would bury the one line that says what to fix."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}{option_hint(self, message)} (see {self.prog} --help)\n")


def parser(prog: str, description: str | None = None, **kw) -> ArgumentParser:
    return ArgumentParser(prog=prog, description=description, formatter_class=HelpFormatter, **kw)


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
