"""Helpers the engine tests share (not product code: nothing in recipe/, verl_ext/ or data_prep/ uses them)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any, Optional

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


# ------------------------------------------------------------------------------------------------
# Rank processes: 1..N new processes on loopback, forked from a server that has imported torch and verl once
# ------------------------------------------------------------------------------------------------


def _rank_entry(rank: int, world_size: int, port: int, out_dir: str, job: Callable[..., Any], args: tuple) -> None:
    from recipe.bench.harness import select_cpu_platform
    from recipe.bench.ranks import AGENT_STORE_ENV

    select_cpu_platform()
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **AGENT_STORE_ENV,
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size))),
    )
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    result = job(rank, world_size, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


#: What the ranks' fork server imports once, so that each rank starts without importing them again (about 6 s of
#: CPU per rank on 2 cores, more than many jobs' own work).
FORK_SERVER_PRELOAD = ("torch", "verl")
#: Variables that change while a caller runs and that nothing reads at import (pytest's current test id).
_VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
_fork_server_env: Optional[dict[str, str]] = None


def _start_method() -> str:
    """``forkserver``, its server (re)started under the caller's current environment; ``spawn`` where this
    Python's fork server cannot be stopped.

    A forked rank keeps its server's environment and the modules it imported under it (verl's plugins, the key
    recorder, the platform). So when the caller has changed a variable since the server started, the server is
    stopped and the next start forks a new one from this process, which imports under the caller's environment:
    the ranks see what a spawned rank would, and later calls in the same environment fork again (a test that left a
    variable changed once made every later call in its process spawn, at ~6 s of imports per rank)."""
    global _fork_server_env
    import multiprocessing
    from multiprocessing import forkserver

    env = {k: v for k, v in os.environ.items() if k not in _VOLATILE_ENV}
    if _fork_server_env is None:
        multiprocessing.set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    elif env != _fork_server_env:
        stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own, 3.8 onwards
        if stop is None:
            return "spawn"
        stop()
    _fork_server_env = env  # the server starts with the next start, in this environment
    return "forkserver"


def run_ranks(job: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``job(rank, world_size, *args)`` in ``world_size`` new processes (gloo on loopback)
    and return each rank's (picklable) result, rank order. ``job`` must be a module-level function.

    Each rank is a fresh process -- forked from a server that has only imported torch and verl
    (:data:`FORK_SERVER_PRELOAD`), a new server whenever the environment has changed since the last one started
    (:func:`_start_method`) -- so the platform choice, the process group and anything a job patches never
    leak into the caller (pytest) process or into the next job. A failing rank raises here with its traceback.
    """
    import torch.multiprocessing as mp

    from recipe.bench.ranks import rendezvous_store

    store = rendezvous_store()  # served until the ranks have ended
    port = int(store.port)
    # The ranks inherit VERL_PLATFORM=cpu from the start: unpickling ``job`` imports its module, which may
    # import verl (and so resolve verl's platform) before _rank_entry runs. The caller's own setting is
    # given back once the ranks have ended.
    saved = os.environ.get("VERL_PLATFORM")
    os.environ["VERL_PLATFORM"] = "cpu"
    try:
        with tempfile.TemporaryDirectory(prefix="engine_harness_") as out_dir:
            mp.start_processes(
                _rank_entry,
                args=(world_size, port, out_dir, job, args),
                nprocs=world_size,
                join=True,
                start_method=_start_method(),
            )
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        if saved is None:
            os.environ.pop("VERL_PLATFORM", None)
        else:
            os.environ["VERL_PLATFORM"] = saved
