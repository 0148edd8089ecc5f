"""vllm-rlpatch: makes the vLLM rollout engine correct for RL; these commands show and measure what it does.

usage: vllm-rlpatch COMMAND [options]      (vllm-rlpatch COMMAND --help: the command's options and defaults)
       vllm-rlpatch --version
"""

from __future__ import annotations

import os
import signal
import sys

from vllm_rlpatch import __version__
from vllm_rlpatch.envs import EnvError
from vllm_rlpatch.tools import demo, doctor, kvpin, options, parity, rollout, table, upstream
from vllm_rlpatch.tools.usermodel import ToolError

SIGPIPE_STATUS = 128 + signal.SIGPIPE


def _patches(argv: list[str]) -> int:
    ap = options.parser("vllm-rlpatch patches", "List the patch specs.")
    ap.add_argument("--markdown", action="store_true", help="the table as Markdown (docs/reference.md)")
    ap.add_argument("--update-docs", metavar="PATH",
                    help="rewrite the generated tables (patches, environment variables, upstream diffs) in this "
                         "Markdown file or in every page under this directory (docs)")
    args = ap.parse_args(argv)
    if args.update_docs:
        try:
            changed = table.regenerate(args.update_docs)
        except (OSError, ValueError) as e:
            raise ToolError(str(e)) from None
        print(f"{args.update_docs}: {'updated ' + ', '.join(changed) if changed else 'already current'}")
        return 0
    print(table.markdown() if args.markdown else table.plain())
    return 0


def _demo(argv: list[str]) -> int:
    return demo.main(argv)


def _parity(argv: list[str]) -> int:
    return parity.main(argv)


def _upstream(argv: list[str]) -> int:
    return upstream.main(argv)


def _kv_pin(argv: list[str]) -> int:
    return kvpin.main(argv)


def _rollout_dump(argv: list[str]) -> int:
    return rollout.dump(argv)


def _rollout_diff(argv: list[str]) -> int:
    return rollout.diff(argv)


def _bounds(argv: list[str]) -> int:
    return rollout.bounds(argv)


def _doctor(argv: list[str]) -> int:
    return doctor.main(argv)


COMMANDS = {
    "parity": (_parity, "rollout-vs-trainer logprob agreement: stock, each fix, all; before/after a weight update"),
    "doctor": (_doctor, "versions, each patch's state and reason, an engine's RL settings and their provenance"),
    "demo": (_demo, "doctor + a short generate on the embedded model, showing what the plugin changed"),
    "kv-pin": (_kv_pin, "measure the largest KV-cache pin that survives sleep -> trainer reserve -> wake (CUDA)"),
    "rollout-dump": (_rollout_dump, "sample every prompt n times per seed; one JSON line per sample (A/B input)"),
    "rollout-diff": (_rollout_diff, "A vs B over repeated runs: spreads, bootstrap CIs, flags beyond the spread"),
    "bounds": (_bounds, "a floor and a ceiling for one statistic from repeated measured runs"),
    "upstream": (_upstream, "upstream-ready diffs of the fixes: base, upstream status, runtime patch; --check"),
    "patches": (_patches, "list the patch specs (name, vLLM range, fixed_in, toggle, upstream)"),
}


def _usage() -> None:
    print(__doc__.strip())
    print("\ncommands:")
    for name, (_, doc) in COMMANDS.items():
        print(f"  {name:<12} {doc}")


def _unknown(word: str) -> str:
    close = options.suggestion(word, COMMANDS)
    hint = f" (did you mean {close!r}?)" if close else ""
    if word.startswith("-"):
        return f"vllm-rlpatch: unknown option {word!r}{hint}: the command comes first, then its options; try --help"
    return f"vllm-rlpatch: unknown command {word!r}{hint}; try --help"


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        _usage()
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return 0
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(_unknown(argv[0]), file=sys.stderr)
        return 2
    try:
        return cmd[0](argv[1:])
    except (EnvError, ToolError) as e:
        print(f"vllm-rlpatch {argv[0]}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Run one command. A reader that stops early (``vllm-rlpatch patches | head -1``) ends it quietly with
    141, the status of a process killed by SIGPIPE, as shell tools do; stdout then points at /dev/null so that
    Python's flush at exit cannot fail a second time (the recipe of Python's signal module documentation)."""
    try:
        try:
            return _dispatch(list(sys.argv[1:] if argv is None else argv))
        finally:  # also when argparse exits (--help): output still buffered must meet a closed pipe here
            sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
