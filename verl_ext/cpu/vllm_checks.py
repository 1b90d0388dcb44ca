"""What verl's vLLM rollout may not ask of vLLM's CPU build: refused, naming the key, before any server starts.

Used by :class:`verl_ext.cpu.vllm_server.CpuVLLMReplica`; imports nothing (no vLLM, no verl). docs/vllm_cpu.md.
"""

from __future__ import annotations

from typing import Any

from verl_ext.cpu import PLATFORM_NAME


def check_cpu_vllm_config(config: Any) -> None:
    """Refuse, naming the key, what verl's vLLM rollout would ask of vLLM's CPU backend and it cannot do."""
    problems = []
    if getattr(config, "free_cache_engine", False):
        problems.append(
            "actor_rollout_ref.rollout.free_cache_engine=True: vLLM's CPU backend has no sleep mode (verl would "
            "call engine.sleep/wake_up around every weight sync); set actor_rollout_ref.rollout.free_cache_engine=False"
        )
    if getattr(config, "enable_sleep_mode", False):
        problems.append(
            "actor_rollout_ref.rollout.enable_sleep_mode=True: vLLM's CPU platform has no sleep mode; set "
            "+actor_rollout_ref.rollout.enable_sleep_mode=False"
        )
    for key in ("tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size"):
        if int(getattr(config, key, 1) or 1) != 1:
            problems.append(f"actor_rollout_ref.rollout.{key}={getattr(config, key)}: only 1 is supported on CPU")
    disagg = getattr(config, "disaggregation", None)
    if disagg is not None and getattr(disagg, "enabled", False):
        problems.append(
            "actor_rollout_ref.rollout.disaggregation.enabled=True: PD disaggregation is not supported on CPU"
        )
    if problems:
        raise NotImplementedError(
            f"verl's vLLM rollout on the {PLATFORM_NAME} platform (VERL_PLATFORM={PLATFORM_NAME}, vllm-cpu; "
            "docs/vllm_cpu.md): " + "; ".join(problems)
        )


__all__ = ["check_cpu_vllm_config"]
