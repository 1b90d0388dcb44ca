"""data_prep: datasets in their upstream layouts -> verl's RL (and SFT) parquet schema.

``python -m data_prep`` converts DAPO-Math-17k, KlearReasoner-MathSub-30K, the evaluation sets
(AIME24/25, HMMT Feb 2025, AMC, MATH-500, ...) and OpenMathReasoning (the SFT stage) from local
files or the hub into parquets that verl's trainer and :mod:`recipe.eval` read.

What lives here: ``io`` (opening inputs, the one error type), ``layouts`` (recognising each
upstream row layout), ``templates`` (the prompt templates), ``convert`` (rows -> verl parquet),
``openmath`` (the SFT data), ``sft_tokens`` (how an SFT row becomes tokens: the RL prompt, then
the target), ``__main__`` (the CLI).

Who may import it: its CLI, :mod:`recipe` (``smoke_task`` writes parquets with ``write_parquet``;
``sft_dataset`` tokenises SFT rows with ``sft_tokens``, the functions ``openmath`` measures them
with) and tests. It sits below both other packages: it imports neither :mod:`recipe` nor
:mod:`verl_ext`, nor verl (``tests/test_layout.py`` parses every import, lazy ones included).
"""
