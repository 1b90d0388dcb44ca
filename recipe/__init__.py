"""recipe: the runnable recipe around :mod:`verl_ext` -- training entry points, reward, evaluation.

README.md's layout table maps its parts. Who may import it: its own entry points and tests;
neither :mod:`verl_ext` nor :mod:`data_prep` does. It imports :mod:`verl_ext`, :mod:`data_prep` and verl,
never ``tests/``; :mod:`recipe.eval`, :mod:`recipe.reward` and ``plots`` work without verl's trainer (and
without a GPU). This ``__init__`` (and each subpackage's) imports nothing.
"""
