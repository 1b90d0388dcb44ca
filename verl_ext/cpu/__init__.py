"""verl on CPU-only machines (support code, not the method): the recipe's trainer and its tests run without a GPU.

Only :mod:`verl_ext.plugin` (lazily, under ``VERL_PLATFORM=cpu``), CPU-only tools and tests import it, so a GPU
node never does; it imports verl, torch, Ray and transformers but nothing else of ``verl_ext``. This ``__init__``
imports only the standard library. docs/cpu_platform.md, docs/cpu_end_to_end.md, docs/vllm_cpu.md.
"""

from __future__ import annotations

import os
import sys

PLATFORM_NAME = "cpu"
"""Value of ``VERL_PLATFORM`` that selects the cpu platform."""

DEVICE_RESOURCE = "cpu_device"
"""The Ray resource that is one "device" of the cpu platform (what ``GPU`` is on CUDA): every Ray node
advertises as many as it has device slots (``trainer.n_gpus_per_node``), so verl's per-node placement
groups land one per node as they do on GPUs. A local Ray gets it from ``ray_kwargs.ray_init.resources``
(``launch/run_smoke_cpu.sh`` sets it); a cluster node from ``ray start --resources='{"cpu_device": N}'``."""


ROLLOUT_NAME = "hf_cpu"
"""Value of ``actor_rollout_ref.rollout.name`` that selects the CPU rollout backend."""

CHECKPOINT_ENGINE_NAME = "cpu_gloo"
"""Value of ``actor_rollout_ref.rollout.checkpoint_engine.backend`` that selects the CPU weight transfer."""


def cpu_platform_selected() -> bool:
    """True when this process runs verl on the ``cpu`` platform (``VERL_PLATFORM=cpu``)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def setup_cpu_process() -> None:
    """Everything a process needs for verl's trainer on CPU (no-op without ``VERL_PLATFORM=cpu``); the plugin
    calls it in every process that imports verl. Also usable as a Ray ``worker_process_setup_hook``."""
    if not cpu_platform_selected():
        return
    from verl_ext.cpu.ray_resources import enable_cpu_ray
    from verl_ext.cpu.rollout import register_cpu_rollout

    platform_module = sys.modules.get("verl_ext.cpu.platform")
    if platform_module is None or hasattr(platform_module, "register_cpu_platform"):
        from verl_ext.cpu.platform import register_cpu_platform

        register_cpu_platform()
    # else: verl_ext.cpu.platform is itself importing verl right now, half-initialised (its importer registers
    # the platform once it has finished importing, e.g. recipe/bench/harness.py)
    enable_cpu_ray()
    register_cpu_rollout()
    from verl_ext.cpu.vllm_rollout import register_cpu_vllm_rollout

    register_cpu_vllm_rollout()  # verl's `vllm` rollout on vLLM's CPU build (imports no vLLM until used)
    if "verl_ext.cpu.checkpoint_engine" not in sys.modules:
        # registers cpu_gloo in CheckpointEngineRegistry as it is imported (as verl's own engines do); a
        # module found already there is being imported, or was, and registers (or registered) itself
        import verl_ext.cpu.checkpoint_engine  # noqa: F401


__all__ = [
    "CHECKPOINT_ENGINE_NAME",
    "DEVICE_RESOURCE",
    "PLATFORM_NAME",
    "ROLLOUT_NAME",
    "cpu_platform_selected",
    "setup_cpu_process",
]
