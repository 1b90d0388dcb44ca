"""Deprecated path: the cpu platform moved to :mod:`verl_ext.cpu.platform`.

Kept so that code and configs written against the old layout still import; every name (private
ones included) is looked up on the new module. Remove after one release.
"""

from __future__ import annotations

import warnings
from typing import Any

warnings.warn(
    "verl_ext.platform_cpu is deprecated: import verl_ext.cpu.platform instead",
    DeprecationWarning,
    stacklevel=2,
)

from verl_ext.cpu import platform as _moved  # noqa: E402
from verl_ext.cpu.platform import PLATFORM_NAME, PlatformCPU, register_cpu_platform  # noqa: E402,F401

__all__ = ["PLATFORM_NAME", "PlatformCPU", "register_cpu_platform"]


def __getattr__(name: str) -> Any:
    return getattr(_moved, name)
