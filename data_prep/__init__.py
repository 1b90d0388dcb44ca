"""data_prep: datasets in their upstream layouts -> verl's RL (and SFT) parquet schema.

``python -m data_prep`` writes the training, evaluation and SFT sets (docs/data_and_reward.md). Modules:
``io`` (inputs, the one error type), ``layouts``, ``templates``, ``convert`` (rows -> verl parquet),
``openmath`` (the SFT data), ``sft_tokens`` (an SFT row's tokens), ``__main__`` (the CLI).
Who may import it: its CLI, :mod:`recipe` and tests. It imports neither :mod:`recipe` nor :mod:`verl_ext`,
nor verl (``tests/test_layout.py`` parses every import, lazy ones included).
"""
