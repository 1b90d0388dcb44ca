"""data_prep: datasets in their upstream layouts -> verl's RL (and SFT) parquet schema.

``python -m data_prep`` converts DAPO-Math-17k, KlearReasoner-MathSub-30K, the evaluation sets
(AIME24/25, HMMT Feb 2025, AMC, MATH-500, ...) and OpenMathReasoning (the SFT stage) from local
files or the hub into parquets that verl's trainer and :mod:`recipe.eval` read.

What lives here: ``io`` (opening inputs, the one error type), ``layouts`` (recognising each
upstream row layout), ``templates`` (the prompt templates), ``convert`` (rows -> verl parquet),
``openmath`` (the SFT data), ``__main__`` (the CLI).

Who may import it: its CLI, :mod:`recipe.smoke_task` (``write_parquet``) and tests. It imports no
verl and no :mod:`verl_ext`; only ``openmath`` imports :mod:`recipe.sft_dataset`, so that SFT rows
are tokenised exactly as the RL rollouts see their prompts.
"""
