"""verl's ``vLLMReplica``/``vLLMHttpServer`` on the cpu platform: the two hooks they need on vLLM's CPU build.

``launch_servers``' device query of each worker (``get_accelerator_ids()`` has no ids for ``cpu_device``) is
answered by the worker's node and node-local rank; the server gets the CPU worker extension. Importing this module
imports vLLM. docs/vllm_cpu.md.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_ext.cpu.vllm_checks import check_cpu_vllm_config

WORKER_EXTENSION_FQN = "verl_ext.cpu.vllm_worker.CpuVLLMWorkerExtension"


class CpuVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server with the CPU worker extension (module docstring)."""

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION_FQN


def _node_and_slot(worker: Any) -> tuple[str, str]:
    """Runs inside a rollout worker (``__ray_call__``): its node id and node-local rank (its "device id")."""
    return ray.get_runtime_context().get_node_id(), str(
        os.environ.get("RAY_LOCAL_RANK", os.environ.get("LOCAL_RANK", "0"))
    )


def _is_device_query(fn: Any) -> bool:
    """Whether ``fn`` is verl's query of a rollout worker's node and CUDA device in ``vLLMReplica.launch_servers``
    (a lambda there that reads ``get_accelerator_ids``)."""
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and code.co_name == "<lambda>"
        and code.co_qualname.startswith(f"{vLLMReplica.launch_servers.__qualname__}.<locals>.")  # .<listcomp> on 3.11
        and "get_accelerator_ids" in code.co_names
    )


class _RayCall:
    """``handle.__ray_call__`` of a :class:`_DeviceQueryHandle`: ``remote(fn)`` runs :func:`_node_and_slot` in
    place of verl's device query (:func:`_is_device_query`), and any other ``fn`` as asked."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def remote(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_device_query(fn):
            return self._handle.__ray_call__.remote(_node_and_slot, *args, **kwargs)
        return self._handle.__ray_call__.remote(fn, *args, **kwargs)


def _same(handle: Any) -> Any:
    return handle


class _DeviceQueryHandle:
    """A rollout worker's actor handle whose ``__ray_call__`` answers the device query for the cpu platform;
    everything else is the real handle's, and pickling it (into the server actor's arguments) sends the real one."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.__ray_call__ = _RayCall(handle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def __reduce__(self) -> Any:
        return (_same, (self._handle,))


class CpuVLLMReplica(vLLMReplica):
    """verl's ``vLLMReplica`` on the cpu platform (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        check_cpu_vllm_config(self.config)
        self.server_class = ray.remote(CpuVLLMHttpServer)

    async def launch_servers(self) -> None:
        workers = self.workers
        self.workers = [_DeviceQueryHandle(worker) for worker in workers]
        try:
            await super().launch_servers()
        finally:
            self.workers = workers


__all__ = ["CpuVLLMHttpServer", "CpuVLLMReplica", "WORKER_EXTENSION_FQN"]
