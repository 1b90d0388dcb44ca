"""Rank processes on loopback for the CPU harness (:mod:`recipe.bench.harness`): the rendezvous store the ranks
connect to, :func:`single_rank_env` for a rank in the calling process, and :func:`run_ranks` for 1..N new processes,
forked from a server that has imported torch and verl once, under the caller's environment."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any, Optional

import torch

from recipe.bench.harness import select_cpu_platform

_STORES: list[Any] = []  # single_rank_env's, served for the life of the process


def rendezvous_store() -> Any:
    """Serve the ranks' rendezvous store from this process, as torchrun's agent does (its port: ``.port``).

    The store binds port 0 itself and holds it while the returned object lives, so no other process can take the
    port between its choice and its use (a free port found first and bound later by rank 0 was lost to ``EADDRINUSE`` on
    a busy machine). The ranks connect to it as clients: :data:`AGENT_STORE_ENV` in their environment makes torch's
    ``env://`` rendezvous (verl's ``init_process_group``) use the store at ``MASTER_PORT`` instead of binding one.
    """
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


#: The environment under which a rank's ``env://`` rendezvous connects to :func:`rendezvous_store`'s store.
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def single_rank_env(port: Optional[int] = None, device: str = "cpu") -> None:
    """Environment for an in-process single rank (what Ray would set for a 1-worker group).
    ``device="cuda"`` leaves verl's platform detection alone (one GPU, NCCL)."""
    if device == "cpu":
        select_cpu_platform()
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port or _served_store_port()),
        **({} if port else AGENT_STORE_ENV),
    )


def _served_store_port() -> int:
    _STORES.append(rendezvous_store())
    return int(_STORES[-1].port)


def _rank_entry(rank: int, world_size: int, port: int, out_dir: str, job: Callable[..., Any], args: tuple) -> None:
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
