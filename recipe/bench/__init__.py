"""Benchmarks: ``python -m recipe.bench <name> [--json] ...``, each against a baseline of the same run
(results in docs/benchmarks.md); ``harness`` is the probes' engine and the tests'.

Imported only by its own ``__main__`` and tests; imports :mod:`verl_ext`, :mod:`recipe.reward.score` and verl,
never ``tests/`` (every probe runs from an installed wheel).
"""
