"""verl's Ray resource pools on CPU-only machines: verl's resource check counts only ``GPU``/``NPU``, so on the cpu
platform :func:`enable_cpu_ray` replaces it by the same question of ``cpu_device`` (every node entry of every pool
its own node with enough slots and CPUs, plus :data:`SPARE_CPUS`). docs/cpu_platform.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from verl_ext.cpu import DEVICE_RESOURCE, cpu_platform_selected
from verl_ext.cpu.patch import patch_checked

logger = logging.getLogger(__name__)

SPARE_CPUS = 1
"""CPUs the check keeps free outside the pools for verl's resource-less helper actors."""

_lock = threading.Lock()
_enabled = False


def required_cpus(resource_pool_spec: dict[str, list[int]], max_colocate_count: int = 1) -> int:
    """CPUs the Ray cluster must offer for ``resource_pool_spec`` on the cpu platform: each device slot's
    bundle holds ``max_colocate_count`` CPUs, plus :data:`SPARE_CPUS`."""
    return (
        sum(n for process_on_nodes in resource_pool_spec.values() for n in process_on_nodes) * max_colocate_count
        + SPARE_CPUS
    )


def unplaceable_nodes(requests: list[int], nodes: list[tuple[float, float]], cpus_per_slot: int) -> list[int]:
    """The per-node slot requests (``trainer.n_gpus_per_node`` per node entry) that no distinct node can
    hold, given each node's available ``(device slots, CPUs)``: largest request first onto the smallest
    node that fits it (each node hosts one placement group's worth, as STRICT_PACK groups per node do)."""
    free = sorted(nodes)
    left = []
    for request in sorted(requests, reverse=True):
        fit = next(
            (i for i, (slots, cpus) in enumerate(free) if slots >= request and cpus >= request * cpus_per_slot), None
        )
        if fit is None:
            left.append(request)
        else:
            free.pop(fit)
    return left


def _check_cpu_resources_available(manager: Any) -> None:
    """``ResourcePoolManager._check_resource_available`` for the cpu platform's device resource."""
    import ray

    per_node = ray._private.state.available_resources_per_node()
    nodes = [(float(info.get(DEVICE_RESOURCE, 0.0)), float(info.get("CPU", 0.0))) for info in per_node.values()]
    cpus_per_slot = int(getattr(manager, "max_colocate_count", 1))
    requests = [n for process_on_nodes in manager.resource_pool_spec.values() for n in process_on_nodes]
    how = (
        f"give every Ray node its device slots as the resource {DEVICE_RESOURCE!r}: a local Ray with "
        f"+ray_kwargs.ray_init.resources={{{DEVICE_RESOURCE}:N}}, a cluster node with "
        f"ray start --resources='{{\"{DEVICE_RESOURCE}\": N}}' (N = trainer.n_gpus_per_node)"
    )
    if sum(slots for slots, _ in nodes) < sum(requests):
        raise ValueError(
            f"Ray offers {sum(slots for slots, _ in nodes):g} {DEVICE_RESOURCE!r} slots; the resource pools "
            f"{dict(manager.resource_pool_spec)} need {sum(requests)} (trainer.nnodes x trainer.n_gpus_per_node): {how}"
        )
    left = unplaceable_nodes(requests, nodes, cpus_per_slot)
    if left:
        raise ValueError(
            f"no Ray node can hold {left[0]} device slots with their {left[0] * cpus_per_slot} CPUs (available per "
            f"node: {[(slots, cpus) for slots, cpus in nodes]} as ({DEVICE_RESOURCE!r}, CPU)); each node entry of "
            f"{dict(manager.resource_pool_spec)} needs its own node: {how}, and enough logical CPUs"
        )
    available = sum(cpus for _, cpus in nodes)
    needed = required_cpus(manager.resource_pool_spec, cpus_per_slot)
    if available < needed:
        raise ValueError(
            f"Ray has {available:g} CPUs available; the resource pools {dict(manager.resource_pool_spec)} need "
            f"{needed - SPARE_CPUS} ({cpus_per_slot} per device slot) plus {SPARE_CPUS} free for verl's helper actors. "
            f"Start Ray with more logical CPUs, e.g. +ray_kwargs.ray_init.num_cpus={max(8, needed + 2)} "
            "(Ray's CPU count is logical; the processes share the physical cores)."
        )


def _patch_resource_check() -> None:
    from verl.single_controller.ray.base import ResourcePoolManager

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _check_resource_available(self: Any) -> None:
            # decided per call, from the platform this process resolved
            from verl.plugin.platform import get_platform

            if get_platform().ray_resource_name() == DEVICE_RESOURCE:
                return _check_cpu_resources_available(self)
            return original(self)

        return _check_resource_available

    patch_checked(
        ResourcePoolManager,
        "_check_resource_available",
        ["self"],
        "verl.single_controller.ray.base.ResourcePoolManager._check_resource_available",
        make,
    )


def enable_cpu_ray() -> bool:
    """Make verl's Ray resource pools usable on the ``cpu`` platform (idempotent) in every process that creates
    them (the ``verl.plugins`` entry point runs in all). ``False``, changing nothing, without ``VERL_PLATFORM=cpu``."""
    global _enabled
    if not cpu_platform_selected():
        return False
    with _lock:
        if not _enabled:
            _patch_resource_check()
            _enabled = True
    return True


__all__ = ["SPARE_CPUS", "enable_cpu_ray", "required_cpus", "unplaceable_nodes"]
