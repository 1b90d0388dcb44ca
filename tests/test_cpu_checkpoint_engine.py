"""The ``cpu_gloo`` checkpoint engine (:mod:`verl_ext.cpu.checkpoint_engine`) and the copying FSDP2 save.

* Registration: ``import verl`` under ``VERL_PLATFORM=cpu`` (the plugin) registers ``cpu_gloo``; elsewhere
  ``checkpoint_engine.custom_backend_module`` (verl's ``import_external_libs``) does.
* The topology verl's ``CheckpointEngineManager`` builds from ``prepare()``'s metadata: actor rank 0 sends,
  the other actor ranks sit out, the rollout workers follow.
* A real transfer between spawned processes on loopback, driven as the manager drives it (prepare ->
  build_topology -> init_process_group -> send/receive -> finalize): two actor ranks whose weight generator
  is a collective (each tensor all-gathered from both ranks' halves, as FSDP's ``full_tensor()``), one
  rollout worker receiving. The received state dict is bit-equal (bytes, dtypes, shapes; NaN, inf and -0.0
  included), through several buckets, a tensor larger than a bucket and odd-sized bf16 tensors; a second
  sync over the same engines works too (the group is rebuilt each time).
* ``separate_async``'s ``DetachActorWorker.save_model_to_cpu`` / ``restore_model_from_cpu`` on FSDP2 over
  gloo (2 ranks): after an in-place update the restore brings back the saved weights (on CPU verl's save
  kept views of the live parameters; the cpu platform makes it copy).

About 20 s on 2 cores (two interpreters, two spawned process groups).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests.helpers import run_ranks  # noqa: E402
from verl_ext.cpu.checkpoint_engine import CpuGlooCheckpointEngine  # noqa: E402

BUCKET_BYTES = 1024
ACTOR_RANKS = 2


def _state_dict() -> dict[str, torch.Tensor]:
    """Weights of mixed dtypes and sizes: several buckets, one tensor over a bucket, odd-sized bf16."""
    gen = torch.Generator().manual_seed(0)
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45, 3.0])
    return {
        "embed.weight": torch.randn(33, 4, generator=gen),
        "layers.0.big": torch.randn(700, generator=gen),  # 2800 bytes: three chunks of a 1 KiB bucket
        "layers.0.norm": torch.randn(3, generator=gen).to(torch.bfloat16),  # 6 bytes: the next offset is unaligned
        "layers.0.proj": torch.randn(5, 7, generator=gen),
        "layers.1.half": torch.randn(11, generator=gen).to(torch.float16),
        "layers.1.specials": specials,
        "layers.1.scalar": torch.tensor(2.5, dtype=torch.float64),
        "positions": torch.arange(9, dtype=torch.int64),
    }


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_registered_by_the_plugin_on_cpu_and_by_custom_backend_module_elsewhere() -> None:
    probe = (
        "import json, verl\n"
        "from verl.checkpoint_engine import CheckpointEngineRegistry\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "before = 'cpu_gloo' in CheckpointEngineRegistry._registry\n"
        "import_external_libs('verl_ext.cpu.checkpoint_engine')\n"
        "print(json.dumps([before, CheckpointEngineRegistry.get('cpu_gloo').__module__]))\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "VERL_PLATFORM"}
    runs = {
        platform: subprocess.Popen(
            [sys.executable, "-c", probe],
            cwd=_ROOT,
            stdout=subprocess.PIPE,
            text=True,
            env={**env, **({"VERL_PLATFORM": platform} if platform else {})},
        )
        for platform in ("cpu", "")
    }
    found = {
        platform: json.loads(run.communicate(timeout=300)[0].strip().splitlines()[-1]) for platform, run in runs.items()
    }
    assert found == {"cpu": [True, "verl_ext.cpu.checkpoint_engine"], "": [False, "verl_ext.cpu.checkpoint_engine"]}


def test_topology_sends_from_actor_rank_zero_only() -> None:
    metadata = [{"master_addr": "10.0.0.1", "master_port": 1234}, {}, {}, {}, {}]
    actor, rollout = CpuGlooCheckpointEngine.build_topology(3, 2, metadata)
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert actor["world_size"] == [3] * 3 and rollout["world_size"] == [3] * 2
    assert set(rollout["master_port"]) == {1234} and set(actor["master_addr"]) == {"10.0.0.1"}
    with pytest.raises(RuntimeError, match="is_master"):
        CpuGlooCheckpointEngine.build_topology(2, 1, [{}, {}, {}])


def _collective_weights(rank: int, group: Any) -> Any:
    """What FSDP's per-tensor generator is to the engine: every tensor needs every actor rank (all-gather)."""
    import torch.distributed as dist

    for name, full in _state_dict().items():
        raw = full.contiguous().view(-1).view(torch.uint8)
        half = (raw.numel() + 1) // 2
        mine = torch.zeros(half, dtype=torch.uint8)
        piece = raw[rank * half : (rank + 1) * half]
        mine[: piece.numel()] = piece
        gathered = [torch.empty(half, dtype=torch.uint8) for _ in range(ACTOR_RANKS)]
        dist.all_gather(gathered, mine, group=group)
        yield name, torch.cat(gathered)[: raw.numel()].view(full.dtype).view(full.shape)


def _transfer_job(rank: int, world_size: int) -> dict[str, Any]:
    """Ranks 0..1 are actor ranks (their own group, as the actor worker group), the last rank a rollout worker."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    actor_group = dist.new_group(list(range(ACTOR_RANKS)))
    is_actor = rank < ACTOR_RANKS
    engine = CpuGlooCheckpointEngine(bucket_size=BUCKET_BYTES, is_master=rank == 0, timeout_s=60, host="127.0.0.1")
    results: dict[str, Any] = {"syncs": []}
    for global_steps in (3, 4):  # the manager rebuilds the group on every sync
        metadata: list[Any] = [None] * world_size
        dist.all_gather_object(metadata, engine.prepare())  # the manager's ray.get of every prepare()
        actor_kwargs, rollout_kwargs = CpuGlooCheckpointEngine.build_topology(
            ACTOR_RANKS, world_size - ACTOR_RANKS, metadata
        )
        kwargs, index = (actor_kwargs, rank) if is_actor else (rollout_kwargs, rank - ACTOR_RANKS)
        engine.init_process_group(**{key: values[index] for key, values in kwargs.items()})
        if is_actor:
            produced = []

            def counted(weights: Any, produced: list = produced) -> Any:
                for item in weights:
                    produced.append(item[0])
                    yield item

            metrics = asyncio.run(
                engine.send_weights(counted(_collective_weights(rank, actor_group)), global_steps=global_steps)
            )
            results["syncs"].append({"produced": len(produced), "metrics": metrics})
        else:

            async def receive(global_steps: int = global_steps) -> dict[str, torch.Tensor]:
                return {
                    name: tensor.clone() async for name, tensor in engine.receive_weights(global_steps=global_steps)
                }

            results["syncs"].append({"received": asyncio.run(receive())})
        engine.finalize()
    return results


def test_cpu_gloo_transfers_a_state_dict_bit_for_bit() -> None:
    actor0, actor1, rollout = run_ranks(_transfer_job, ACTOR_RANKS + 1)
    expected = _state_dict()
    for sync in rollout["syncs"]:
        received = sync["received"]
        assert list(received) == list(expected)  # the generator's order
        for name, tensor in expected.items():
            got = received[name]
            assert (got.dtype, got.shape) == (tensor.dtype, tensor.shape), name
            assert _bytes(got) == _bytes(tensor), name
    for actor in (actor0, actor1):  # rank 1 sends nothing, but walked the whole (collective) generator
        assert [sync["produced"] for sync in actor["syncs"]] == [len(expected)] * 2
    assert actor1["syncs"][0]["metrics"] == {}
    sent_mb = actor0["syncs"][0]["metrics"]["checkpoint_engine/cpu_gloo/sent_mb"]
    assert sent_mb * 2**20 >= sum(t.numel() * t.element_size() for t in expected.values())


def _detach_job(rank: int, world_size: int) -> dict[str, bool]:
    """DetachActorWorker's save/restore handlers on an FSDP2 module over gloo, as separate_async calls them."""
    import torch.distributed as dist
    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (the cpu platform registers its engines, and its save fix)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.experimental.separation.engine_workers import DetachActorWorker

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    worker = DetachActorWorker.__new__(DetachActorWorker)  # the handlers only need the strategy and the module
    worker._strategy_handlers = None
    worker.config = SimpleNamespace(actor=SimpleNamespace(strategy="fsdp2"))
    worker.actor = SimpleNamespace(engine=SimpleNamespace(module=model))

    def full() -> dict[str, torch.Tensor]:
        return {name: param.full_tensor().clone() for name, param in model.named_parameters()}

    saved = full()
    worker.save_model_to_cpu(0)  # pi_old of the cycle (local_trigger_step 0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)  # an optimizer step updates the live shards in place
    updated = full()
    worker.save_model_to_cpu(1)
    worker.restore_model_from_cpu(0)
    restored = full()
    worker.restore_model_from_cpu(1)
    back = full()
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)  # noqa: E731
    return {
        "restored_pi_old": same(restored, saved),
        "back_to_current": same(back, updated),
        "moved": not same(updated, saved),
    }


def test_detach_actor_worker_restores_saved_fsdp2_weights_on_cpu() -> None:
    for result in run_ranks(_detach_job, 2):
        assert result == {"restored_pi_old": True, "back_to_current": True, "moved": True}
