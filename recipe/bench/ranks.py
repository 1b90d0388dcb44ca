"""Ranks on loopback for the CPU harness (:mod:`recipe.bench.harness`): the rendezvous store the ranks connect to
(the tests' ``run_ranks`` too) and :func:`single_rank_env` for a rank in the calling process."""

from __future__ import annotations

import os
from typing import Any

from recipe.bench.harness import select_cpu_platform

_STORES: list[Any] = []  # single_rank_env's, served for the life of the process


def rendezvous_store() -> Any:
    """Serve the ranks' rendezvous store from this process, as torchrun's agent does (its port: ``.port``).

    It binds port 0 and holds it while the object lives, so no other process can take the port before rank 0 uses
    it (a free port bound later was lost to ``EADDRINUSE`` on a busy machine); the ranks, under
    :data:`AGENT_STORE_ENV`, connect to it at ``MASTER_PORT`` as clients.
    """
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


#: The environment under which a rank's ``env://`` rendezvous connects to :func:`rendezvous_store`'s store.
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}


def single_rank_env(device: str = "cpu") -> None:
    """Environment for an in-process single rank (what Ray would set for a 1-worker group), its rendezvous store
    served from this process; ``device="cuda"`` leaves verl's platform detection alone."""
    if device == "cpu":
        select_cpu_platform()
    _STORES.append(rendezvous_store())
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_STORES[-1].port),
        **AGENT_STORE_ENV,
    )
