"""Shared test setup: make sure verl has loaded the divclip plugin before tests run, and start the
longest test files first (``tests/run.sh`` runs the files on two workers, so longest-first lets both
finish together)."""

from __future__ import annotations

import pytest
import verl  # noqa: F401  (runs the verl.plugins entry points)

#: Test files by their duration on 2 CPU cores under ``tests/run.sh`` (two workers), longest first (measured
#: with ``--junitxml``, 2026-11-27): end-to-end runs and fixtures of a minute or more. The vLLM file goes third,
#: not first: under ``.ci/run`` its environment is still being built beside the first two. The order only
#: affects how the two workers share the suite, not what any test checks.
LONGEST_FIRST = (
    "test_trainer_modes_cpu.py",
    "test_smoke_cpu.py",
    "test_vllm_cpu.py",  # with .venv-vllm (about 6 minutes in the suite); skipped in a moment without it
    "test_two_nodes_ray.py",
    "test_verl_features_engine.py",
    "test_bench_gpu_probe_cpu.py",
    "test_sft_chain_cpu.py",
    "test_launch.py",
    "test_old_pass_skip.py",
    "test_onpolicy.py",
    "test_actor_loss_engine.py",
    "test_recipe_main.py",
    "test_bench_entropy_memory.py",
    "test_cpu_rollout.py",
    "test_bench_onpolicy.py",
    "test_knobs.py",
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device (skipped, not passed, on the CPU machines; see docs/benchmarks.md)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: file order otherwise
