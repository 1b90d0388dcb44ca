"""verl's Ray resource pools and worker groups on CPU-only machines (``VERL_PLATFORM=cpu``).

What verl 0.9.1 does, and what it means on the ``cpu`` platform (:mod:`verl_ext.cpu.platform`):

* ``ResourcePoolManager.create_resource_pool`` builds every pool with ``use_gpu=True``: one placement
  group per node entry of ``trainer.nnodes x trainer.n_gpus_per_node``, each ``STRICT_PACK``, each
  bundle ``{"CPU": max_colocate_count, <device>: 1}`` with the device named by
  ``get_platform().ray_resource_name()``. On the cpu platform that is the custom resource
  :data:`verl_ext.cpu.DEVICE_RESOURCE` (``cpu_device``), which every Ray node advertises as many times
  as it has device slots -- as a GPU node advertises its GPUs. So a node's placement group needs that
  node's device slots, and with two nodes of one slot each the two ranks land on different nodes, as
  on a GPU cluster (a plain CPU count could not tell one node's slots from another's: both groups
  would fit on the head). ``RayClassWithInitArgs`` asks ``ray_resource_options(1 / max_colocate_count)``
  per worker: that share of a device slot and of a CPU, so the (up to 3) colocated worker groups verl
  puts on a device share its bundle exactly as they share a GPU.
* ``ResourcePoolManager._check_resource_available`` counts only ``"GPU"``/``"NPU"`` in the Ray
  cluster, so on a CPU-only node it finds 0 and raises. :func:`enable_cpu_ray` replaces that check, on
  the ``cpu`` platform only, with the same question asked of the device resource: can every node entry
  of every pool find its own node with enough device slots and the bundles' CPUs, with one CPU to
  spare for the actors verl creates *outside* the pools without resource options (agent-loop workers,
  reward-loop workers, the load balancer: Ray needs 1 free CPU to place a default actor, which then
  holds 0). Its errors say how to give Ray the resource (a local Ray:
  ``+ray_kwargs.ray_init.resources={cpu_device:N}``; a cluster node:
  ``ray start --resources='{"cpu_device": N}'``). Ray's CPU count is logical: on a 2-core machine give
  Ray 8 or more, the processes share the physical cores anyway.
* Ranks and devices: ``RayWorkerGroup`` passes ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
  ``MASTER_PORT`` to each worker through ``runtime_env``; ``LOCAL_RANK`` stays ``0`` (no
  device to map) and the platform's ``visible_devices_envvar`` is a dummy, so no
  ``CUDA_VISIBLE_DEVICES`` is read or set. The workers' process group is gloo
  (:mod:`verl_ext.cpu.platform` patches the backend string). Nothing else is needed.

Where verl has no extension point for the resource check, the patch is a method replacement on
``ResourcePoolManager`` that delegates to verl's original on every other platform, checks the
method's signature first (raises if verl changed it), and is applied once.
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
            f"no Ray node can hold {left[0]} device slots with their {left[0] * cpus_per_slot} CPUs (available per node: "
            f"{[(slots, cpus) for slots, cpus in nodes]} as ({DEVICE_RESOURCE!r}, CPU)); each node entry of "
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
            # Decided per call, from the platform actually resolved in this process.
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
    """Make verl's Ray resource pools usable on the ``cpu`` platform. Idempotent.

    Active only when ``VERL_PLATFORM=cpu`` (returns ``False`` and changes nothing otherwise);
    returns ``True`` once enabled. Call it in every process that creates resource pools (the
    trainer's ``TaskRunner`` actor and anything that launches standalone rollout replicas);
    the ``verl.plugins`` entry point runs in all of them.
    """
    global _enabled
    if not cpu_platform_selected():
        return False
    with _lock:
        if not _enabled:
            _patch_resource_check()
            _enabled = True
    return True


__all__ = ["SPARE_CPUS", "enable_cpu_ray", "required_cpus", "unplaceable_nodes"]
