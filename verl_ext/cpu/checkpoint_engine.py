"""``cpu_gloo``: verl's checkpoint engine for the cpu platform (``separate_async``'s standalone rollout pool).

Actor rank 0 broadcasts buckets of raw bytes to the rollout workers over a gloo group of their own (bit-equal
tensors). Registered in ``CheckpointEngineRegistry`` when imported. docs/cpu_platform.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import time
from collections.abc import AsyncGenerator, AsyncIterator, Generator
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    TensorMeta,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

from verl_ext.cpu import CHECKPOINT_ENGINE_NAME

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

SOURCE_RANK = 0
"""Actor rank 0 is the source of every broadcast (rank 0 of the transfer group too)."""

CHUNK_ALIGNMENT = 16
"""Byte alignment of each chunk inside a bucket, so that a chunk can be viewed as any dtype."""

Weights = Union[Generator[tuple[str, torch.Tensor], None, None], AsyncIterator[tuple[str, torch.Tensor]]]


def _node_ip() -> str:
    """This process's Ray node address, or loopback outside Ray."""
    import ray

    return ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"


def _aligned(offset: int) -> int:
    return -(-offset // CHUNK_ALIGNMENT) * CHUNK_ALIGNMENT


async def _contiguous_cpu(weights: Weights) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
    async for name, tensor in ensure_async_iterator(weights):
        yield name, tensor.detach().to("cpu").contiguous()


@CheckpointEngineRegistry.register(CHECKPOINT_ENGINE_NAME)
class CpuGlooCheckpointEngine(CheckpointEngine):
    """Broadcasts the actor's weights to the rollout workers over gloo.

    Args:
        bucket_size: the largest bucket in bytes (verl passes ``update_weights_bucket_megabytes << 20``).
        is_master: true on actor rank 0, which hosts the group's store and sends.
        timeout_s: how long a rank waits for the others (store, group set-up, each broadcast).
        host: the address rank 0's store listens on (default: the Ray node's address); the one knob of
            ``checkpoint_engine.engine_kwargs.cpu_gloo`` besides ``timeout_s``.
    """

    def __init__(
        self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0, host: Optional[str] = None
    ) -> None:
        if bucket_size < CHUNK_ALIGNMENT:
            raise ValueError(f"cpu_gloo: bucket_size must be at least {CHUNK_ALIGNMENT} bytes, got {bucket_size}")
        self.bucket_size = int(bucket_size)
        self.is_master = is_master
        self.timeout = timedelta(seconds=float(timeout_s))
        self.host = host
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self._store: Optional[dist.TCPStore] = None
        self._group: Optional[dist.ProcessGroup] = None

    # -- the group, built for each sync ----------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """On the source: open the group's store on a free port and return its address; elsewhere ``{}``."""
        if not self.is_master:
            return {}
        host = self.host or _node_ip()
        self._store = dist.TCPStore(host, 0, None, True, self.timeout, wait_for_workers=False)
        return {"master_addr": host, "master_port": int(self._store.port)}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Actor rank 0 is group rank 0, the rollout workers ranks 1..n; the other actor ranks sit out (-1)."""
        source = metadata[SOURCE_RANK]
        if "master_port" not in source:
            raise RuntimeError("cpu_gloo: actor rank 0 must be the checkpoint engine's master (is_master=True)")
        world_size = 1 + rollout_world_size
        address = {"world_size": world_size, "master_addr": source["master_addr"], "master_port": source["master_port"]}
        actor_kwargs = {key: [value] * actor_wg_world_size for key, value in address.items()}
        actor_kwargs["rank"] = [SOURCE_RANK] + [-1] * (actor_wg_world_size - 1)
        rollout_kwargs = {key: [value] * rollout_world_size for key, value in address.items()}
        rollout_kwargs["rank"] = list(range(1, world_size))
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        """Join the transfer group (blocks until every member has joined); rank -1 only records its rank."""
        self.rank, self.world_size = rank, world_size
        if rank < 0:
            return
        if rank == SOURCE_RANK:
            if self._store is None:
                raise RuntimeError("cpu_gloo: init_process_group on the source before prepare()")
            store = self._store
        else:
            store = dist.TCPStore(master_addr, master_port, None, False, self.timeout)
            self._store = store
        self._group = dist.ProcessGroupGloo(
            dist.PrefixStore(CHECKPOINT_ENGINE_NAME, store), rank, world_size, self.timeout
        )

    def finalize(self) -> None:
        """Drop the group and the store (a new pair is built for the next sync)."""
        self._group = self._store = self.rank = self.world_size = None

    async def _broadcast(self, tensor: torch.Tensor) -> None:
        if self._group is None:
            raise RuntimeError("cpu_gloo: no transfer group (prepare/init_process_group were not called)")
        options = dist.BroadcastOptions()
        options.rootRank = SOURCE_RANK
        work = self._group.broadcast([tensor], options)
        await asyncio.to_thread(work.wait)

    # -- the transfer ----------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(self, weights: Weights, global_steps: Optional[int] = None) -> dict[str, float]:
        """Broadcast ``weights`` in buckets from the source; the other actor ranks only walk the generator. Returns
        the source's transfer figures (``checkpoint_engine/cpu_gloo/*``), ``{}`` elsewhere."""
        if self.rank is None:
            raise RuntimeError("cpu_gloo: send_weights before init_process_group")
        if self.rank < 0:
            async for _ in ensure_async_iterator(weights):
                pass  # each item is a collective over the actor ranks: rank 0 needs this rank to produce it
            return {}
        if self.rank != SOURCE_RANK:
            raise RuntimeError(f"cpu_gloo: only the source sends; group rank {self.rank} is a rollout worker")
        start, sent_bytes, buckets = time.time(), 0, 0
        metas: list[TensorMeta] = []
        chunks: list[torch.Tensor] = []
        filled = 0
        async for meta, chunk in split_weight_chunks(_contiguous_cpu(weights), self.bucket_size):
            offset = _aligned(filled)
            if metas and offset + meta.chunk_size > self.bucket_size:
                sent_bytes += await self._send_bucket(metas, chunks, last=False)
                buckets += 1
                metas, chunks, offset = [], [], 0
            meta.offset = offset
            metas.append(meta)
            chunks.append(chunk)
            filled = offset + meta.chunk_size
        sent_bytes += await self._send_bucket(metas, chunks, last=True)
        seconds = time.time() - start
        logger.info(
            "cpu_gloo: sent %.1f MB in %d buckets to %d rollout workers in %.2fs (global_steps=%s)",
            sent_bytes / 2**20,
            buckets + 1,
            (self.world_size or 1) - 1,
            seconds,
            global_steps,
        )
        return {"checkpoint_engine/cpu_gloo/sent_mb": sent_bytes / 2**20, "checkpoint_engine/cpu_gloo/seconds": seconds}

    async def _send_bucket(self, metas: list[TensorMeta], chunks: list[torch.Tensor], last: bool) -> int:
        size = (metas[-1].offset + metas[-1].chunk_size) if metas else 0
        payload = torch.zeros(size, dtype=torch.uint8)
        for meta, chunk in zip(metas, chunks, strict=True):
            payload[meta.offset : meta.offset + meta.chunk_size] = chunk
        description = torch.frombuffer(bytearray(pickle.dumps({"metas": metas, "last": last})), dtype=torch.uint8)
        await self._broadcast(torch.tensor([description.numel(), payload.numel()], dtype=torch.int64))
        await self._broadcast(description)
        await self._broadcast(payload)
        return size

    @torch.no_grad()
    async def receive_weights(
        self, global_steps: Optional[int] = None
    ) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Yield ``(name, tensor)`` as the source's buckets arrive (rollout workers only)."""
        if self.rank is None or self.rank <= SOURCE_RANK:
            raise RuntimeError(f"cpu_gloo: receive_weights on group rank {self.rank}; only rollout workers receive")
        async for name, tensor in merge_weight_chunks(self._receive_chunks(), self.bucket_size):
            yield name, tensor

    async def _receive_chunks(self) -> AsyncGenerator[tuple[TensorMeta, torch.Tensor], None]:
        while True:
            lengths = torch.zeros(2, dtype=torch.int64)
            await self._broadcast(lengths)
            description = torch.empty(int(lengths[0]), dtype=torch.uint8)
            payload = torch.empty(int(lengths[1]), dtype=torch.uint8)  # fresh per bucket: yielded views stay valid
            await self._broadcast(description)
            await self._broadcast(payload)
            message = pickle.loads(description.numpy().tobytes())
            for meta in message["metas"]:
                yield meta, payload[meta.offset : meta.offset + meta.chunk_size]
            if message["last"]:
                return


__all__ = ["CHUNK_ALIGNMENT", "CpuGlooCheckpointEngine", "SOURCE_RANK"]
