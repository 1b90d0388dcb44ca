"""The vLLM worker extension for verl's vLLM rollout on the cpu platform (runs inside vLLM's worker process).

verl syncs the actor's weights into vLLM with ``vLLMColocateWorkerExtension.update_weights_from_ipc``: the model's
``load_weights`` copies each tensor into its parameter, then vLLM's ``process_weights_after_loading`` runs.
vLLM's CPU build, in that post-processing, hands every unquantized linear layer to a packed GEMM (oneDNN here)
and *deletes the weight* (``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in
``UnquantizedLinearMethod.process_weights_after_loading``: ``layer.weight`` becomes an empty parameter). That is
right for a model loaded once; verl loads weights every step, and the next load fails in vLLM's weight loader:
``AssertionError: Attempted to load weight (torch.Size([128, 64])) into parameter (torch.Size([0]))``.

:class:`CpuVLLMWorkerExtension` is verl's extension plus one change, made as the worker is built (before the
model loads): vLLM's ``dispatch_cpu_unquantized_gemm`` keeps the weight (``remove_weight=False``, as vLLM
already does for its embedding/LM-head layers). The packed GEMM is rebuilt from the new weights by the
``process_weights_after_loading`` verl runs after every sync. Cost: each linear weight is held twice (the
parameter and the packed copy).
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
