"""Build an engine config through one of vLLM's three entry points, without starting an engine.

    python config_paths.py MODE MODEL [extra CLI args...]
MODE[,MODE...]: engine_args | async_engine_args | cli, optionally with ":FLAG+FLAG" passed explicitly:
  raw  logprobs_mode=raw_logprobs     auto  generation_config=auto     pc  enable_prefix_caching=True
  head hf_overrides={"head_dtype": "bfloat16"}
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
    flags = set(variant.split("+")) if variant else set()
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    kw = {}
    if "raw" in flags:
        kw["logprobs_mode"] = "raw_logprobs"
    if "auto" in flags:
        kw["generation_config"] = "auto"
    if "pc" in flags:
        kw["enable_prefix_caching"] = True
    if "head" in flags:
        kw["hf_overrides"] = {"head_dtype": "bfloat16"}
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
        if "raw" in flags:
            argv += ["--logprobs-mode", "raw_logprobs"]
        if "auto" in flags:
            argv += ["--generation-config", "auto"]
        if "pc" in flags:
            argv += ["--enable-prefix-caching"]
        if "head" in flags:
            argv += ["--hf-overrides", '{"head_dtype": "bfloat16"}']
        args = parser.parse_args(argv + sys.argv[3:])
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        ea = AsyncEngineArgs.from_cli_args(args)
    else:
        raise SystemExit(f"unknown mode {mode}")
    cfg = ea.create_engine_config()
    res = {"mode": mode, "vllm": vllm.__version__, "type": type(ea).__name__,
           "logprobs_mode": str(cfg.model_config.logprobs_mode),
           "generation_config": cfg.model_config.generation_config,
           "enable_prefix_caching": cfg.cache_config.enable_prefix_caching,
           "async_scheduling": cfg.scheduler_config.async_scheduling,
           "default_sampling": cfg.model_config.get_diff_sampling_param(),
           "worker_extension_cls": cfg.parallel_config.worker_extension_cls,
           "head_dtype": str(cfg.model_config.head_dtype),
           "hf_head_dtype": str(getattr(cfg.model_config.hf_config, "head_dtype", None))}
    try:
        from vllm_rlpatch.hooks import config as config_hook

        res["provenance"] = {k: s.as_dict() for k, s in config_hook.settings_for(ea).items()}
    except ImportError:
        res["provenance"] = None
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
