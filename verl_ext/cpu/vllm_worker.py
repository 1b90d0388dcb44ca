"""The vLLM worker extension for verl's vLLM rollout on the cpu platform (runs inside vLLM's worker process).

vLLM's CPU build deletes each linear layer's weight once packed for its GEMM, so verl's next weight sync fails;
here the weight is kept (each held twice), and verl's ``process_weights_after_loading`` repacks it. docs/vllm_cpu.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from verl_ext.cpu.patch import patch_checked


def keep_cpu_linear_weights() -> None:
    """Make vLLM's CPU GEMM dispatch keep each linear layer's weight (module docstring). Idempotent; raises if
    vLLM's function no longer has the parameters ``(layer, remove_weight)`` of vLLM 0.24.0."""
    from vllm.model_executor.layers import utils as layer_utils

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def dispatch_cpu_unquantized_gemm(layer: Any, remove_weight: bool) -> None:
            return original(layer, remove_weight=False)

        return dispatch_cpu_unquantized_gemm

    patch_checked(
        layer_utils,
        "dispatch_cpu_unquantized_gemm",
        ["layer", "remove_weight"],
        "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm",
        make,
        written_for="vLLM 0.24.0",
    )


class CpuVLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's ``vLLMColocateWorkerExtension`` with vLLM's CPU linear layers keeping their weights."""

    def __new__(cls, **kwargs: Any) -> Any:
        keep_cpu_linear_weights()
        return super().__new__(cls, **kwargs)


__all__ = ["CpuVLLMWorkerExtension", "keep_cpu_linear_weights"]
