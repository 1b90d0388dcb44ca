"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on the ``cpu`` platform, on vLLM's CPU build:
the ``vllm`` replica pointed at :class:`verl_ext.cpu.vllm_server.CpuVLLMReplica`. Nothing here imports vLLM until
verl resolves the replica, so the main environment registers the loader and never calls it. docs/vllm_cpu.md.
"""

from __future__ import annotations

from verl_ext.cpu import cpu_platform_selected

VLLM_ROLLOUT_NAME = "vllm"


def _load_cpu_vllm_replica() -> type:
    """The registry's loader: :class:`verl_ext.cpu.vllm_server.CpuVLLMReplica` (importing it imports vLLM)."""
    from verl_ext.cpu.vllm_server import CpuVLLMReplica

    return CpuVLLMReplica


def register_cpu_vllm_rollout() -> None:
    """Point verl's ``vllm`` replica at :class:`CpuVLLMReplica` on the cpu platform. Idempotent, cheap (imports
    no vLLM). A no-op without ``VERL_PLATFORM=cpu``: on a GPU node verl's own ``vLLMReplica`` stays."""
    if not cpu_platform_selected():
        return
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(VLLM_ROLLOUT_NAME, _load_cpu_vllm_replica)


__all__ = ["VLLM_ROLLOUT_NAME", "register_cpu_vllm_rollout"]
