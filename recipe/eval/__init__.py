"""Offline evaluation: sample a checkpoint on the eval sets, then score mean@k / pass@k / maj@k.

Two subcommands (``python -m recipe.eval {generate,score} ...``, see docs/evaluation.md):

* ``generate`` samples ``n`` responses per problem with vLLM for every evaluation parquet
  (written by ``python -m data_prep``) using the benchmark's sampling preset (the ERC or the
  ATR paper's settings), scores each response with our reward (``recipe/reward/score.py``) and writes
  one JSONL per benchmark. Every argument (paths, parquet schema, n >= k, temperature and
  top-p ranges, preset coverage) is validated *before* vLLM is imported, so a typo costs a
  second on a login node instead of a GPU allocation.
* ``score`` reads those JSONL files or verl's validation dumps (``trainer.validation_data_dir``)
  and prints a Markdown table per metric, one row per checkpoint, plus a "final (best)" row when
  several checkpoints are given; ``--aggregate`` reports mean ± std over runs (seeds).

Metrics (per problem, then averaged over problems, then an unweighted average over benchmarks in
the "Avg" column): mean@k, the unbiased pass@k of Chen et al. (2021), and maj@k; definitions in
:mod:`recipe.eval.metrics`.

What lives here, one job per module (each imports only the ones above it):

============================  =====================================================================
``recipe.eval.metrics``       pass@k / mean@k / maj@k estimators, per-benchmark averages (pure)
``recipe.eval.presets``       benchmark names and order, the papers' sampling presets, validation
``recipe.eval.problems``      evaluation parquets, run folders, the reward scorer (shared inputs)
``recipe.eval.generate``      ``generate``: plan, vLLM sampler (the only vLLM import), JSONL writer
``recipe.eval.readers``       ``score``'s inputs: generate files and verl validation dumps
``recipe.eval.tables``        ``score``'s output: metrics per checkpoint, Markdown, mean ± std
``recipe.eval.cli``           argument parsing and the two commands (``__main__`` runs it)
============================  =====================================================================

Who may import it: anyone (CLI users, :mod:`recipe.plots`, tests); it imports :mod:`recipe.reward.score`
lazily (scoring) and vLLM only inside :func:`vllm_sampler`, never verl_ext. The names below are
re-exported so that ``from recipe.eval import pass_at_k`` (the pre-split module's API) keeps working.
"""

from __future__ import annotations

from recipe.eval.cli import main
from recipe.eval.generate import (
    BenchmarkPlan,
    Sampler,
    check_model_path,
    plan_generation,
    refuse_existing_outputs,
    run_generate,
    vllm_sampler,
)
from recipe.eval.metrics import (
    METRICS,
    Checkpoint,
    ProblemSamples,
    majority_vote,
    mean_at_k,
    pass_at_k,
    resolve_k,
    score_benchmark,
    vote_key,
)
from recipe.eval.presets import (
    BENCHMARK_ALIASES,
    DISPLAY_NAMES,
    PRESET_CHAT_TEMPLATE_KWARGS,
    PRESETS,
    SamplingSpec,
    canonical_benchmark,
    display_name,
    parse_k_list,
    resolve_chat_template_kwargs,
    resolve_sampling,
)
from recipe.eval.problems import REQUIRED_COLUMNS, Problem, Scorer, expand_files, load_eval_parquet, reward_scorer
from recipe.eval.readers import PromptIndex, file_kind, iter_jsonl, load_runs, parse_generate_rows, parse_verl_dump
from recipe.eval.tables import aggregate_runs, render_aggregate, render_tables, row_label, score_runs

__all__ = [
    "BENCHMARK_ALIASES",
    "DISPLAY_NAMES",
    "METRICS",
    "PRESETS",
    "PRESET_CHAT_TEMPLATE_KWARGS",
    "REQUIRED_COLUMNS",
    "BenchmarkPlan",
    "Checkpoint",
    "Problem",
    "ProblemSamples",
    "PromptIndex",
    "Sampler",
    "SamplingSpec",
    "Scorer",
    "aggregate_runs",
    "canonical_benchmark",
    "check_model_path",
    "display_name",
    "expand_files",
    "file_kind",
    "iter_jsonl",
    "load_eval_parquet",
    "load_runs",
    "main",
    "majority_vote",
    "mean_at_k",
    "parse_generate_rows",
    "parse_k_list",
    "parse_verl_dump",
    "pass_at_k",
    "plan_generation",
    "refuse_existing_outputs",
    "render_aggregate",
    "render_tables",
    "resolve_chat_template_kwargs",
    "resolve_k",
    "resolve_sampling",
    "reward_scorer",
    "row_label",
    "run_generate",
    "score_benchmark",
    "score_runs",
    "vllm_sampler",
    "vote_key",
]
