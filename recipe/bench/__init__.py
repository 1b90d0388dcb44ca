"""Benchmarks: ``python -m recipe.bench <name> [--json] ...``.

Every benchmark measures its baseline in the same process/run and prints ratios against it,
so figures stay comparable across machines. Results are recorded in docs/benchmarks.md.
"""
