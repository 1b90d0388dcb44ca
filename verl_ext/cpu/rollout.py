"""``hf_cpu``: a CPU rollout backend for verl 0.9.1, a transformers server (:mod:`verl_ext.cpu.server`) plugged
into verl's registries for its own backends, so the v1 trainers run unchanged. Unsupported settings raise.
docs/cpu_end_to_end.md.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from verl_ext.cpu import ROLLOUT_NAME

SERVER_NAME_PREFIX = f"{ROLLOUT_NAME}_server_"
_ADAPTER_FQN = f"{__name__}.HFCpuServerAdapter"
_lock = threading.Lock()


# Registration is defined before the module imports verl: importing this module can itself trigger
# ``import verl``, whose ``verl.plugins`` entry point calls register_cpu_rollout() on this
# still-initialising module; verl's registries hold a loader and a dotted path, resolved later.


def _load_replica() -> type:
    return HFCpuReplica


def register_cpu_rollout() -> None:
    """Register ``hf_cpu`` with verl's rollout registries (idempotent, loads no model) in every process that
    resolves the rollout by name: the trainer's and the actor workers'; the ``verl.plugins`` entry point does."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    with _lock:
        existing = _ROLLOUT_REGISTRY.get((ROLLOUT_NAME, "async"))
        if existing not in (None, _ADAPTER_FQN):
            raise RuntimeError(f"rollout ({ROLLOUT_NAME!r}, 'async') already registered to {existing}")
        _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = _ADAPTER_FQN
        RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)


import logging  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from collections.abc import AsyncIterator, Generator  # noqa: E402

import ray  # noqa: E402
import torch  # noqa: E402
from verl.workers.rollout.base import BaseRollout  # noqa: E402
from verl.workers.rollout.replica import RolloutReplica  # noqa: E402

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (how the adapter finds it, as vLLM's adapter does)."""
    return f"{SERVER_NAME_PREFIX}{replica_rank}_{node_rank}"


class HFCpuServerAdapter(BaseRollout):
    """The rollout object inside each actor worker (``get_rollout_class("hf_cpu", "async")``): forwards each
    weight sync to the replica's server in buckets over the Ray object store."""

    def __init__(
        self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(config, model_config, device_mesh)
        if self.config.tensor_model_parallel_size != 1 or self.config.pipeline_model_parallel_size != 1:
            raise NotImplementedError("hf_cpu rollout: set actor_rollout_ref.rollout.tensor_model_parallel_size=1")
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.is_leader_rank = self.rollout_rank == 0
        self.server_handle: Optional[ray.actor.ActorHandle] = None
        self.sleep_level = 1

    def _server(self) -> Optional[ray.actor.ActorHandle]:
        if not self.is_leader_rank:
            return None
        if self.server_handle is None:
            # The server is launched after the hybrid engine, so look it up lazily (as vLLM does).
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        server = self._server()
        if server is not None:
            await server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        server = self._server()
        if server is not None:
            await server.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: Optional[int] = None,
        wire_format: str = "named_tensors",
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        """Stream ``(name, full_tensor)`` pairs to the server in buckets, then apply them. Only the leader rank
        sends, but every rank must exhaust ``weights``: with FSDP each item is a collective."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"hf_cpu rollout only takes wire_format='named_tensors', got {wire_format!r}")
        if peft_config is not None:
            raise NotImplementedError(
                "hf_cpu rollout cannot load LoRA adapters; set actor_rollout_ref.model.lora.merge=True"
            )
        from verl.workers.rollout.utils import ensure_async_iterator

        start = time.time()
        server = self._server()
        bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20
        if server is not None:
            await server.begin_weight_update.remote()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        sent = 0
        async for name, tensor in ensure_async_iterator(weights):
            if server is None:
                continue  # still iterate: the generator's collectives need every rank
            cpu = tensor.detach().to("cpu", copy=True).contiguous()
            bucket.append((name, cpu))
            size += cpu.numel() * cpu.element_size()
            if size >= bucket_bytes:
                sent += await server.load_weight_bucket.remote(bucket)
                bucket, size = [], 0
        if server is not None:
            if bucket:
                sent += await server.load_weight_bucket.remote(bucket)
            applied = await server.finish_weight_update.remote(global_steps)
            if self.replica_rank == 0:
                logger.info(
                    "hf_cpu update_weights: %d tensors in %.2fs (global_steps=%s)",
                    applied,
                    time.time() - start,
                    global_steps,
                )

    def generate_sequences(self, prompts: Any) -> Any:
        raise NotImplementedError("hf_cpu is a server backend: generation goes through HFCpuReplica / LLMServerClient")


class HFCpuReplica(RolloutReplica):
    """verl ``RolloutReplica`` for the ``hf_cpu`` backend: one :class:`HFCpuServer` per replica."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.world_size != 1:
            raise NotImplementedError(
                "hf_cpu rollout: each replica is one process; set actor_rollout_ref.rollout."
                "tensor_model_parallel_size/data_parallel_size/pipeline_model_parallel_size to 1 (world size "
                f"{self.world_size})"
            )
        # imported here, not at module level: the server's module is what a Ray worker imports first
        # when it unpickles the server class, and that import runs this module (verl's plugin)
        from verl_ext.cpu.server import HFCpuServer

        self.server_class = ray.remote(HFCpuServer)

    async def launch_servers(self) -> None:
        """Start the server actor on the node of this replica's first worker."""
        if self.is_reward_model or self.is_teacher_model:
            raise NotImplementedError("hf_cpu rollout serves the policy only (no reward/teacher model servers)")
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
        else:
            node_id = ray.get_runtime_context().get_node_id()
        name = server_actor_name(self.replica_rank) + self.name_suffix
        server = self.server_class.options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node_id, soft=False
            ),
            name=name,
            num_cpus=0,
            max_concurrency=self.max_concurrency,
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
        )
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"


__all__ = ["ROLLOUT_NAME", "HFCpuReplica", "HFCpuServerAdapter", "register_cpu_rollout", "server_actor_name"]
