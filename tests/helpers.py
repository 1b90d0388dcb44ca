"""Helpers the engine tests share (not product code: nothing in recipe/, verl_ext/ or data_prep/ uses them)."""

from __future__ import annotations

import json
import socket
from typing import Any

import torch
from tensordict import TensorDict

EXACT_SGD: dict[str, Any] = dict(optimizer="SGD", lr=0.5, clip_grad=1e9)
"""``WorkerOptions`` overrides under which an update is exactly ``-lr * grad`` (SGD, clipping off), so a test
compares gradients by comparing parameter updates."""


def shard_for_rank(batch: TensorDict, rank: int, world_size: int) -> TensorDict:
    """The contiguous slice of ``batch`` that verl's dispatch sends to data-parallel ``rank``."""
    from verl.utils import tensordict_utils as tu

    n = batch.batch_size[0]
    if n % world_size:
        raise ValueError(f"batch size {n} is not divisible by world size {world_size}")
    return tu.chunk_tensordict(batch, world_size)[rank]


def param_delta(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``after - before`` per parameter (under :data:`EXACT_SGD` this is exactly ``-lr * grad``)."""
    return {k: after[k] - before[k] for k in before}


def free_port() -> int:
    """A free TCP port on the loopback interface, for a process that binds it itself at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_trace(path: str, event: str = "trained") -> list[dict[str, Any]]:
    """The lines of one ``event`` (``trained``, ``fetched`` or ``restored``) of a
    :class:`recipe.data_trace.DataTrace` file, in file order."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [line for line in lines if line.get("event", "trained") == event]
