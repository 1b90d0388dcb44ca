"""The rollout side of per-benchmark validation lengths (:mod:`recipe.validation.length`).

:class:`ValidationLengthAgentLoop` is verl's ``SingleTurnAgentLoop`` sending a validation row's length as
``max_tokens``; importing this module registers it, per process, so :class:`ValidationLengthAgentLoopManager`
imports it in every agent-loop worker it starts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.trainer.ppo.v1 import AgentLoopManagerTQ

from recipe.validation.length import LENGTH_COLUMN, VALIDATION_AGENT_LOOP


@register(VALIDATION_AGENT_LOOP)
class ValidationLengthAgentLoop(SingleTurnAgentLoop):
    """``SingleTurnAgentLoop`` at the validation row's own response length (``LENGTH_COLUMN``)."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if LENGTH_COLUMN not in kwargs:
            raise KeyError(
                f"agent loop {VALIDATION_AGENT_LOOP!r} runs validation rows, which carry {LENGTH_COLUMN!r} "
                "(recipe.validation.length.PerBenchmarkValidationLoader); this row has none"
            )
        length = int(kwargs.pop(LENGTH_COLUMN))
        # SingleTurnAgentLoop truncates to self.response_length after generation
        self.response_length = length
        return await super().run({**sampling_params, "max_tokens": length}, **kwargs)


def _register_validation_agent_loop(worker: Any) -> str:
    """Run inside an agent-loop worker (``__ray_call__``): importing this module registered the
    loop in that process's registry; return its target to show it."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    return str(_agent_loop_registry[VALIDATION_AGENT_LOOP]["_target_"])


class ValidationLengthAgentLoopManager(AgentLoopManagerTQ):
    """verl's ``AgentLoopManagerTQ`` whose workers also know :class:`ValidationLengthAgentLoop`.

    Dispatch (``generate_sequences``) and the workers are verl's own; only the registry of each
    worker process gains the validation loop, before any batch is sent.
    """

    async def _init_agent_loop_workers(self) -> None:
        await super()._init_agent_loop_workers()
        targets = await asyncio.gather(
            *[worker.__ray_call__.remote(_register_validation_agent_loop) for worker in self.agent_loop_workers]
        )
        expected = f"{ValidationLengthAgentLoop.__module__}.{ValidationLengthAgentLoop.__qualname__}"
        if any(target != expected for target in targets):
            raise RuntimeError(f"agent-loop workers registered {VALIDATION_AGENT_LOOP!r} as {targets}, not {expected}")


__all__ = ["ValidationLengthAgentLoop", "ValidationLengthAgentLoopManager"]
