"""`vllm-rlpatch` as a user meets it at a shell: a reader that stops early, mistyped commands and options.
Bad input is one line on stderr and exit 2 (no traceback, no usage block), and "did you mean" only for a near
miss. Engine-free, except the doctor test that needs vLLM's own parser of engine arguments (no engine starts)."""

import os
import subprocess
import sys

import pytest
from support.env import clean_env

from vllm_rlpatch.tools import cli, options

SIGPIPE_STATUS = 141  # 128 + SIGPIPE: what `yes | head -1` reports for `yes`


def _cli(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "vllm_rlpatch.tools.cli", *args], text=True, timeout=timeout,
                          env=clean_env(), **kw)


def _bad_input(*args, timeout=120) -> str:
    """The one stderr line of a refused command line (exit 2, nothing on stdout)."""
    p = _cli(*args, capture_output=True, timeout=timeout)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    return err[0]


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["patches"], ["patches", "--markdown"], ["upstream"],
                                  *([name, "--help"] for name in cli.COMMANDS)])
def test_a_reader_that_stops_early_ends_the_command_quietly(args):
    """`vllm-rlpatch ... | head -1`: the pipe is closed before the command writes (deterministically so). Exit
    141 as if killed by SIGPIPE; 0 where argparse's help printer already ignored the failed write itself."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = _cli(*args, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert p.returncode in (SIGPIPE_STATUS, 0) and p.stderr == "", (p.returncode, p.stderr[-2000:])
    if args[-1] != "--help":
        assert p.returncode == SIGPIPE_STATUS


@pytest.mark.parametrize("word, close", [("doctr", "doctor"), ("kvpin", "kv-pin"), ("rollout_dump", "rollout-dump"),
                                         ("patchs", "patches"), ("partiy", "parity"), ("--doctor", "doctor"),
                                         ("--bogus", None), ("bogus", None), ("-x", None), ("diff", None),
                                         ("doctorate", None)])
def test_did_you_mean_only_for_a_near_miss(word, close):
    assert options.suggestion(word, cli.COMMANDS) == close


def test_unknown_command_or_option_before_the_command():
    assert _bad_input("--bogus") == ("vllm-rlpatch: unknown option '--bogus': the command comes first, then its "
                                     "options; try --help")
    assert _bad_input("bogus") == "vllm-rlpatch: unknown command 'bogus'; try --help"
    assert _bad_input("doctr") == "vllm-rlpatch: unknown command 'doctr' (did you mean 'doctor'?); try --help"


@pytest.mark.parametrize("command", ["parity", "patches", "upstream", "demo"])
def test_an_unknown_option_is_one_line(command):
    assert _bad_input(command, "--garbage-flag") == (
        f"vllm-rlpatch {command}: unrecognized arguments: --garbage-flag (see vllm-rlpatch {command} --help)")


@pytest.mark.parametrize("args, line", [
    (["parity", "--temprature", "0.5"], "vllm-rlpatch parity: unrecognized arguments: --temprature 0.5; did you "
                                        "mean '--temperature'? (see vllm-rlpatch parity --help)"),
    (["parity", "--top-p", "abc"], "vllm-rlpatch parity: argument --top-p: invalid float value: 'abc' (see "
                                   "vllm-rlpatch parity --help)"),
    (["parity", "--engine-args", "{bad"], "vllm-rlpatch parity: --engine-args: Expecting property name "
                                          "enclosed in double quotes: line 1 column 2 (char 1) (see vllm-rlpatch "
                                          "parity --help)"),
    (["rollout-dump", "--out", "x.jsonl", "--garbage-flag"], "vllm-rlpatch rollout-dump: unrecognized arguments: "
                                                             "--garbage-flag (see vllm-rlpatch rollout-dump --help)"),
    (["rollout-diff", "a", "b", "--", "c", "d", "--bootsrap", "5"], "vllm-rlpatch rollout-diff: unrecognized "
     "arguments: --bootsrap; did you mean '--bootstrap'? (see vllm-rlpatch rollout-diff --help)"),
    (["bounds"], "vllm-rlpatch bounds: the following arguments are required: runs, --metric (see vllm-rlpatch "
                 "bounds --help)"),
    (["kv-pin"], "vllm-rlpatch kv-pin: the following arguments are required: --model (see vllm-rlpatch kv-pin "
                 "--help)"),
    (["upstream", "--list", "--markdown"], "vllm-rlpatch upstream: argument --markdown: not allowed with argument "
                                           "--list (see vllm-rlpatch upstream --help)"),
    (["doctor", "--garbage-flag"], "vllm-rlpatch doctor: unrecognized arguments: --garbage-flag; engine arguments "
                                   "need --model (see vllm-rlpatch doctor --help)"),
    (["doctor", "--jsn"], "vllm-rlpatch doctor: unrecognized arguments: --jsn; engine arguments need --model; did "
                          "you mean '--json'? (see vllm-rlpatch doctor --help)"),
])
def test_usage_errors_are_one_line(args, line):
    assert _bad_input(*args) == line


@pytest.mark.vllm
def test_doctor_refuses_an_unknown_engine_argument_in_one_line():
    """vLLM's own parser decides what an engine argument is; its refusal is our one line, not its usage block.
    vLLM's import may log a line or two first (as in test_user_model); ours is the last and no usage follows."""
    for args, ours in [
        (["--garbage-flag"], "vllm-rlpatch doctor: vLLM engine arguments: unrecognized arguments: --garbage-flag"),
        (["--max-model-length", "256"], "vllm-rlpatch doctor: vLLM engine arguments: unrecognized arguments: "
                                        "--max-model-length 256; did you mean '--max-model-len'?"),
    ]:
        p = _cli("doctor", "--model", "llama-tiny", *args, capture_output=True, timeout=300)
        err = p.stderr.strip().splitlines()
        assert p.returncode == 2 and p.stdout == "" and err and err[-1] == ours, (p.returncode, p.stderr[-3000:])
        assert "usage:" not in p.stderr and "Traceback" not in p.stderr and len(err) <= 3, p.stderr[-3000:]
