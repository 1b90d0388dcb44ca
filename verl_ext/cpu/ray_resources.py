"""verl's Ray resource pools and worker groups on CPU-only machines (``VERL_PLATFORM=cpu``).

What verl 0.9.1 does, and what it means on the ``cpu`` platform (:mod:`verl_ext.cpu.platform`):

* ``ResourcePoolManager.create_resource_pool`` builds every pool with ``use_gpu=True``
  (``verl/single_controller/ray/base.py``). That is not a problem in itself: ``use_gpu`` means
  "bundles carry one *device* slot", and ``RayResourcePool.get_placement_groups`` names the
  device resource after ``get_platform().ray_resource_name()``, which is ``"CPU"`` on our
  platform. The bundle ``{"CPU": max_colocate_count, <device>: 1}`` therefore becomes
  ``{"CPU": 1}``: **one device = one CPU slot**, one bundle per "GPU" of
  ``trainer.n_gpus_per_node``. ``RayClassWithInitArgs`` asks ``ray_resource_options(1 /
  max_colocate_count)``, i.e. ``num_cpus=1/3`` per worker, so the (up to 3) colocated worker
  groups verl puts on a device share its CPU slot exactly as they share a GPU.
* ``ResourcePoolManager._check_resource_available`` counts only ``"GPU"``/``"NPU"`` in the Ray
  cluster, so on a CPU-only node it finds 0 and raises ``Total available GPUs 0 is less than
  total desired GPUs N``. This is the one thing that blocks verl's Ray layer on CPU.
  :func:`enable_cpu_ray` replaces that check, on the ``cpu`` platform only, with a CPU count:
  the pools need one CPU per device slot, plus one free CPU so that the actors verl creates
  *outside* the pools without resource options (agent-loop workers, reward-loop workers, the
  load balancer) can still be scheduled (Ray needs 1 free CPU to place a default actor, which
  then holds 0). On a 2-core machine set ``+ray_kwargs.ray_init.num_cpus=8`` (or more):
  Ray's CPU count is logical, the processes share the physical cores anyway.
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

import functools
import inspect
import logging
import threading
from typing import Any, Callable

from verl_ext.cpu import cpu_platform_selected

logger = logging.getLogger(__name__)

SPARE_CPUS = 1
"""CPUs the check keeps free outside the pools for verl's resource-less helper actors."""

_lock = threading.Lock()
_enabled = False


def required_cpus(resource_pool_spec: dict[str, list[int]]) -> int:
    """CPUs the Ray cluster must offer for ``resource_pool_spec`` on the cpu platform."""
    return sum(n for process_on_nodes in resource_pool_spec.values() for n in process_on_nodes) + SPARE_CPUS


def _check_cpu_resources_available(manager: Any) -> None:
    """CPU analogue of ``ResourcePoolManager._check_resource_available`` (one CPU per device slot)."""
    import ray

    per_node = ray._private.state.available_resources_per_node()
    available = sum(float(info.get("CPU", 0.0)) for info in per_node.values())
    slots = required_cpus(manager.resource_pool_spec) - SPARE_CPUS
    needed = slots + SPARE_CPUS
    if available < needed:
        raise ValueError(
            f"Ray has {available:g} CPUs available; the resource pools {dict(manager.resource_pool_spec)} need "
            f"{slots} (one per device slot on the cpu platform) plus {SPARE_CPUS} free for verl's helper actors. "
            f"Start Ray with more logical CPUs, e.g. +ray_kwargs.ray_init.num_cpus={max(8, needed)} "
            "(Ray's CPU count is logical; the processes share the physical cores)."
        )
    # per-node fit: every node listed in a pool must fit its bundles (placement groups are STRICT_PACK)
    largest_node = max((float(info.get("CPU", 0.0)) for info in per_node.values()), default=0.0)
    largest_request = max((n for nodes in manager.resource_pool_spec.values() for n in nodes), default=0)
    if largest_node < largest_request:
        raise ValueError(
            f"no Ray node has {largest_request} CPUs available for one node's bundles (largest: {largest_node:g}); "
            "raise ray_kwargs.ray_init.num_cpus"
        )


def _patch_resource_check() -> None:
    from verl.single_controller.ray.base import ResourcePoolManager

    original: Callable[..., Any] = ResourcePoolManager._check_resource_available
    if getattr(original, "__verl_ext_cpu__", False):
        return
    params = list(inspect.signature(original).parameters)
    if params != ["self"]:
        raise RuntimeError(
            "verl_ext.cpu.ray_resources: verl.single_controller.ray.base.ResourcePoolManager._check_resource_available "
            f"has parameters {params}, expected ['self'] as in verl 0.9.1; update the CPU resource check."
        )

    @functools.wraps(original)
    def _check_resource_available(self: Any) -> None:
        # Decided per call, from the platform actually resolved in this process.
        from verl.plugin.platform import get_platform

        if get_platform().ray_resource_name() == "CPU":
            return _check_cpu_resources_available(self)
        return original(self)

    _check_resource_available.__verl_ext_cpu__ = True  # type: ignore[attr-defined]
    ResourcePoolManager._check_resource_available = _check_resource_available  # type: ignore[method-assign]


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


__all__ = ["SPARE_CPUS", "enable_cpu_ray", "required_cpus"]
