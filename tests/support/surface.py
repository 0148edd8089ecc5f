"""The package's public surface, printed as JSON by ``python -m support.surface`` (run by the snapshot tests in
a fresh interpreter with ``COLUMNS`` fixed, so argparse wraps the help the same way everywhere):

- ``names``: the public names of :mod:`vllm_rlpatch` and :mod:`vllm_rlpatch.refit` (a module's ``__all__``;
  without one, its attributes whose names do not start with ``_``, less submodules and ``__future__`` features);
- ``cli``: ``vllm-rlpatch --help`` and every subcommand's ``--help``: exit status and text.
"""

from __future__ import annotations

import __future__
import contextlib
import importlib
import io
import json
import sys
import types

MODULES = ("vllm_rlpatch", "vllm_rlpatch.refit")


def public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_")
                 and not isinstance(v, (types.ModuleType, __future__._Feature))]
    return sorted(names)


def cli_help(argv: list[str]) -> dict:
    from vllm_rlpatch.tools import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's --help
            code = e.code
    return {"argv": ["vllm-rlpatch", *argv], "exit": code, "text": out.getvalue()}


def surface() -> dict:
    from vllm_rlpatch.tools import cli

    mods = {name: importlib.import_module(name) for name in MODULES}
    helps = {"vllm-rlpatch": cli_help(["--help"])}
    helps.update({f"vllm-rlpatch-{c}": cli_help([c, "--help"]) for c in cli.COMMANDS})
    return {"names": {name: public_names(m) for name, m in mods.items()}, "cli": helps}


if __name__ == "__main__":
    json.dump(surface(), sys.stdout, indent=1)
