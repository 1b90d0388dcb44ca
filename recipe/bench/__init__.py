"""Benchmarks: ``python -m recipe.bench <name> [--json] ...``.

Every benchmark measures its baseline in the same process/run and prints ratios against it,
so figures stay comparable across machines. Results are recorded in docs/benchmarks.md; ``harness``
(verl's actor ``TrainingWorker`` on 1..N spawned ranks) is the probes' engine and the tests'.
Who may import it: only its own ``__main__`` and tests. It imports :mod:`verl_ext`, :mod:`recipe.reward.score`
and verl, never ``tests/``: every probe runs from an installed wheel (``tests/test_installed_wheel.py``).
"""
