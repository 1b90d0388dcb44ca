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
lazily (scoring) and vLLM only inside :func:`recipe.eval.generate.vllm_sampler`, never verl_ext. This
``__init__`` imports nothing: import each name from its module.
"""
