"""Rollout A/B: dump samples, compare two sets of repeated runs, derive bounds from measured runs.

    vllm-rlpatch rollout-dump --model PATH --embedded|--prompts FILE [--n N] [--seed S | --seeds 1,2,3]
                              [--temperature T --top-p P --top-k K --max-tokens M --ignore-eos]
                              [--engine-args JSON] --out RUN.jsonl        (with --seeds: a {seed} in --out)
    vllm-rlpatch rollout-diff A1.jsonl A2.jsonl ... -- B1.jsonl B2.jsonl ... [--reference MODEL]
                              [--bootstrap N] [--json OUT] [--plot OUT.png]
    vllm-rlpatch bounds RUN.jsonl ... --metric NAME [--margin X] [--json OUT]

A *run* is one dump file: every prompt sampled ``n`` times with one seed. Statistics are computed per run
(generation length, truncation and EOS rates, mean and per-sample minimum logprob, mean logprob per position
bucket, and ``token_mult_prob_error`` against a trainer-side reference when one is given); a side is a set
of runs with different seeds. ``rollout-diff`` reports, per statistic, both sides' run values (mean and the
run-to-run range), the difference of the pooled statistic with a hierarchical bootstrap confidence interval
(runs resampled, then samples within each run) and flags a difference only when the interval excludes 0
**and** it is larger than the run-to-run range inside either side. ``bounds`` turns repeated runs into a
floor and a ceiling with the rule stated. One run per side, or identical seeds, are refused or flagged:
they give zero spread and prove nothing.

One module per command (:mod:`.cmd_dump`, :mod:`.cmd_diff`, :mod:`.cmd_bounds`); :mod:`.runs` holds what they
share (runs read back, their statistics, the reference).
"""

from vllm_rlpatch.tools.rollout.cmd_bounds import bounds
from vllm_rlpatch.tools.rollout.cmd_diff import compare, diff, table
from vllm_rlpatch.tools.rollout.cmd_dump import dump
from vllm_rlpatch.tools.rollout.cmd_dump import fit_to_context as _fit  # the name tests/test_user_model.py uses
from vllm_rlpatch.tools.rollout.runs import (
    BUCKETS,
    HIGHER_IS_WORSE,
    STATS,
    RolloutError,
    load_run,
    load_side,
    run_values,
)

__all__ = ["BUCKETS", "HIGHER_IS_WORSE", "STATS", "RolloutError", "bounds", "compare", "diff", "dump", "load_run",
           "load_side", "run_values", "table"]
