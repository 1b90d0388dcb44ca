"""Shared test setup: make sure verl has loaded the divclip plugin before tests run."""

import verl  # noqa: F401  (runs the verl.plugins entry points)


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped, not passed, on the CPU machines; see docs/benchmarks.md)"
    )
