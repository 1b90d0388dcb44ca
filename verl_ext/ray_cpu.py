"""Deprecated path: the Ray CPU resource check moved to :mod:`verl_ext.cpu.ray_resources`, and
``setup_cpu_process`` / ``cpu_platform_selected`` to :mod:`verl_ext.cpu`.

Kept so that code and configs written against the old layout (e.g. a
``worker_process_setup_hook: verl_ext.ray_cpu.setup_cpu_process``) still import; every name
(private ones included) is looked up on the new modules. Remove after one release.
"""

from __future__ import annotations

import warnings
from typing import Any

warnings.warn(
    "verl_ext.ray_cpu is deprecated: import verl_ext.cpu.ray_resources (enable_cpu_ray, required_cpus) "
    "or verl_ext.cpu (setup_cpu_process, cpu_platform_selected) instead",
    DeprecationWarning,
    stacklevel=2,
)

from verl_ext.cpu import PLATFORM_NAME as CPU_PLATFORM  # noqa: E402,F401
from verl_ext.cpu import cpu_platform_selected, setup_cpu_process  # noqa: E402,F401
from verl_ext.cpu import ray_resources as _moved  # noqa: E402
from verl_ext.cpu.ray_resources import SPARE_CPUS, enable_cpu_ray, required_cpus  # noqa: E402,F401

__all__ = ["enable_cpu_ray", "cpu_platform_selected", "required_cpus", "setup_cpu_process", "SPARE_CPUS"]


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
