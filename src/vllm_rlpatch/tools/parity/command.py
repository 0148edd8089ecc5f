"""``vllm-rlpatch parity``'s command line: the options, the run, the table on stdout, the JSON report and the
plot, and ``--max-error``'s exit code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_rlpatch.tools import options, plot, usermodel
from vllm_rlpatch.tools.parity.configs import CONFIGS, DEFAULT_OUT, REFERENCES, ParityError
from vllm_rlpatch.tools.parity.measure import worst_all
from vllm_rlpatch.tools.parity.rendering import json_safe, main_reference, render
from vllm_rlpatch.tools.parity.runner import run


def _parser() -> argparse.ArgumentParser:
    ap = options.parser(
        "vllm-rlpatch parity",
        "Rollout-vs-trainer logprob agreement per configuration (stock, each fix, all), before and after a\n"
        "weight update. With no arguments: the embedded model, T=0.7, top-p 0.9; the table on stdout,\n"
        "parity.json and parity.png in ./vllm-rlpatch-out/.")
    usermodel.add_model_options(ap, help=usermodel.MODEL_HELP + "; default: the embedded llama-tiny")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of the rollouts")
    ap.add_argument("--top-p", type=float, default=0.9, help="top-p of the rollouts")
    ap.add_argument("--top-k", type=int, default=0, help="top-k of the rollouts, 0 = off")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per sample")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="let samples end at EOS (default: every sample has --max-tokens tokens, ignore_eos)")
    ap.add_argument("--prompts", type=int, default=12, help="prompts per run")
    ap.add_argument("--runs", type=int, default=1, help="repeat with different prompts and seeds; mean ± sd")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompts' order and the sampling seeds")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--refit-to", help="checkpoint directory pushed as the update (default: the model + noise)")
    ap.add_argument("--refit-noise", type=float, default=0.5,
                    help="noise scale (x each matrix's std) of the default update")
    ap.add_argument("--engine-args", default="{}", help='JSON of extra vllm.LLM arguments, e.g. \'{"tensor_parallel_size": 2}\'')
    ap.add_argument("--references", default=",".join(REFERENCES),
                    help=f"trainer-side references to compare with (comma-separated subset of {','.join(REFERENCES)})")
    ap.add_argument("--out", metavar="DIR", default=DEFAULT_OUT,
                    help="where parity.json and parity.png go (unless --json/--plot name other paths)")
    ap.add_argument("--json", metavar="PATH", help="the full report, per-token data included (default: DIR/parity.json)")
    ap.add_argument("--plot", metavar="PATH.png",
                    help="the Δ logprob distributions per configuration (default: DIR/parity.png; needs matplotlib)")
    ap.add_argument("--no-plot", action="store_true", help="write no plot")
    ap.add_argument("--max-error", type=float,
                    help="exit 1 if the `all` configuration's token_mult_prob_error (fp32 reference, either phase) exceeds it")
    ap.add_argument("--workdir", help="keep the engines' logs and the update's weights here (default: a temporary "
                                      "directory, removed at the end)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="engines run at once (start-up overlaps; tokens/s is then measured under contention)")
    ap.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                    help="no progress lines (each engine's vLLM log goes to a file in --workdir either way)")
    return ap


def main(argv: list[str]) -> int:
    ap = _parser()
    args = ap.parse_args(argv)

    try:
        eargs = json.loads(args.engine_args)
        if not isinstance(eargs, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        ap.error(f"--engine-args: {e}")
    configs = tuple(c.strip() for c in args.configs.split(",") if c.strip())
    if args.max_error is not None and "all" not in configs:
        ap.error("--max-error checks the `all` configuration; include it in --configs")
    if args.max_error is not None and args.max_error < 1.0:
        ap.error("--max-error is a token_mult_prob_error bound (>= 1.0)")
    json_path = Path(args.json) if args.json else Path(args.out) / "parity.json"
    plot_path = None if args.no_plot else (Path(args.plot) if args.plot else Path(args.out) / "parity.png")
    if args.plot and not plot.available():
        ap.error(plot.missing_message("--plot"))

    try:
        model = usermodel.resolve_for(args, "parity")
    except usermodel.ToolError as e:
        print(f"vllm-rlpatch parity: {e}", file=sys.stderr)
        return 2
    try:
        report = run(model=model, configs=configs, temperature=args.temperature, top_p=args.top_p,
                     top_k=args.top_k, max_tokens=args.max_tokens, prompts=args.prompts, runs=args.runs,
                     seed=args.seed, refit_to=args.refit_to, refit_noise=args.refit_noise, engine_args=eargs,
                     workdir=args.workdir, keep_samples=True, progress=not args.no_progress,
                     ignore_eos=not args.stop_at_eos, jobs=args.jobs,
                     references=tuple(k.strip() for k in args.references.split(",") if k.strip()))
    except (ParityError, usermodel.ToolError) as e:
        print(f"vllm-rlpatch parity: {e}", file=sys.stderr)
        return 2
    print(render(report))
    if not _write(report, json_path, plot_path):
        return 2
    if args.max_error is not None:
        w = worst_all(report, main_reference(report))
        if w is None or not (w <= args.max_error):
            print(f"FAIL: `all` token_mult_prob_error {w} > --max-error {args.max_error}", file=sys.stderr)
            return 1
        print(f"ok: `all` token_mult_prob_error {w:.4f} <= --max-error {args.max_error}")
    return 0


def _write(report: dict, json_path: Path, plot_path: Path | None) -> bool:
    """The JSON report and the plot; False (and why, on stderr) when they cannot be written."""
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(json_safe(report)))
        print(f"\nJSON: {json_path}")
        if plot_path is not None and plot.available():
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            plot.parity_plot(report, str(plot_path), reference=main_reference(report))
            print(f"plot: {plot_path}")
        elif plot_path is not None:
            print(plot.missing_message(f"plot {plot_path}"))
    except OSError as e:
        print(f"vllm-rlpatch parity: cannot write the report: {e}", file=sys.stderr)
        return False
    return True
