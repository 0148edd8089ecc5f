"""Build an engine config through one of vLLM's three entry points, without starting an engine.

    python config_paths.py MODE MODEL [extra CLI args...]
MODE[,MODE...]: engine_args | async_engine_args | cli  (suffix ":raw" passes logprobs_mode=raw_logprobs explicitly)
Prints `RESULT {...}` with the effective settings and, if the plugin is active, their provenance.
"""

import json
import sys


def main():
    modes, model = sys.argv[1], sys.argv[2]
    for mode in modes.split(","):
        one(mode, model)


def one(mode, model):
    base, _, variant = mode.partition(":")
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    kw = {"logprobs_mode": "raw_logprobs"} if variant == "raw" else {}
    common = dict(dtype="bfloat16", max_model_len=256)
    if base == "engine_args":  # what vllm.LLM(...) builds from its kwargs
        ea = EngineArgs(model=model, **common, **kw)
    elif base == "async_engine_args":  # AsyncLLM.from_engine_args(AsyncEngineArgs(...))
        ea = AsyncEngineArgs(model=model, **common, **kw)
    elif base == "cli":  # `vllm serve MODEL ...`: vLLM's own serve subcommand parser
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser(prog="vllm")
        sub = parser.add_subparsers(dest="subparser")
        ServeSubcommand().subparser_init(sub)
        argv = ["serve", model, "--dtype", "bfloat16", "--max-model-len", "256"]
        if variant == "raw":
            argv += ["--logprobs-mode", "raw_logprobs"]
        args = parser.parse_args(argv + sys.argv[3:])
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        ea = AsyncEngineArgs.from_cli_args(args)
    else:
        raise SystemExit(f"unknown mode {mode}")
    cfg = ea.create_engine_config()
    res = {"mode": mode, "vllm": vllm.__version__, "type": type(ea).__name__,
           "logprobs_mode": str(cfg.model_config.logprobs_mode),
           "worker_extension_cls": cfg.parallel_config.worker_extension_cls}
    try:
        from vllm_rlpatch.hooks import config as config_hook

        res["provenance"] = {k: s.as_dict() for k, s in config_hook.settings_for(ea).items()}
    except ImportError:
        res["provenance"] = None
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
