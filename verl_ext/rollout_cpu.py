"""Deprecated path: the ``hf_cpu`` rollout moved to :mod:`verl_ext.cpu.rollout` (server, replica,
adapter, registration) and :mod:`verl_ext.cpu.sampling` (batched sampling).

Kept so that code written against the old layout still imports; every name (private ones
included) is looked up on the new modules. verl's rollout registry now names the adapter
``verl_ext.cpu.rollout.HFCpuServerAdapter``. Remove after one release.
"""

from __future__ import annotations

import warnings
from typing import Any

warnings.warn(
    "verl_ext.rollout_cpu is deprecated: import verl_ext.cpu.rollout (or verl_ext.cpu.sampling for "
    "generate_batch, process_logits, SamplingSpec, sampling_spec_from_params) instead",
    DeprecationWarning,
    stacklevel=2,
)

from verl_ext.cpu import rollout as _rollout  # noqa: E402
from verl_ext.cpu import sampling as _sampling  # noqa: E402
from verl_ext.cpu.rollout import *  # noqa: E402,F401,F403
from verl_ext.cpu.sampling import *  # noqa: E402,F401,F403

__all__ = [
    "ROLLOUT_NAME",
    "HFCpuReplica",
    "HFCpuServer",
    "HFCpuServerAdapter",
    "SamplingSpec",
    "generate_batch",
    "process_logits",
    "register_cpu_rollout",
    "sampling_spec_from_params",
    "server_actor_name",
]


def __getattr__(name: str) -> Any:
    for module in (_rollout, _sampling):
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
