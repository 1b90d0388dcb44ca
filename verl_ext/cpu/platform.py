"""A ``cpu`` platform for verl 0.9.1 (``VERL_PLATFORM=cpu``), so recipes can be debugged and tested without a GPU.

Through verl's own extension points: :class:`PlatformCPU`, and verl's FSDP engines registered for ``device="cpu"``
(FSDP2; FSDP1 refused by name) once verl's engine module is imported. docs/cpu_platform.md.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import platform as _pyplatform
import resource
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from verl_ext.cpu import DEVICE_RESOURCE, PLATFORM_NAME
from verl_ext.cpu.patch import patch_checked

logger = logging.getLogger(__name__)

_ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
_lock = threading.Lock()
_engines_registered = False


def _rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (``ru_maxrss`` is KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` host memory, the CPU analogue of ``torch.cuda.mem_get_info``."""
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


def _noop(*args: Any, **kwargs: Any) -> None:
    """Accelerator housekeeping (cache release, IPC collection, memory fraction) has no CPU meaning."""
    return None


def _build_cpu_device_module() -> types.ModuleType:
    """A ``torch.cuda``-shaped namespace for verl's ``get_torch_device()`` calls, backed by ``torch.cpu``; memory
    statistics report host RSS (``memory_*`` current, ``max_memory_*`` peak), so verl's ``perf/max_memory_*``
    metrics stay meaningful on CPU."""
    mod = types.ModuleType("verl_ext.cpu.platform.device_module")
    mod.__doc__ = "torch.cuda-like API for the verl_ext CPU platform"
    for name in ("Event", "Stream", "StreamContext", "current_stream", "is_available", "stream", "synchronize"):
        setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: "cpu"  # type: ignore[attr-defined]
    mod.device_count = lambda: 1  # type: ignore[attr-defined]
    mod.set_device = _noop  # type: ignore[attr-defined]
    mod.is_initialized = lambda: True  # type: ignore[attr-defined]
    mod.get_device_name = lambda device=None: _pyplatform.processor() or _pyplatform.machine()  # type: ignore[attr-defined]
    mod.manual_seed = torch.manual_seed  # type: ignore[attr-defined]
    mod.manual_seed_all = torch.manual_seed  # type: ignore[attr-defined]
    mod.get_rng_state = lambda device=None: torch.get_rng_state()  # type: ignore[attr-defined]
    mod.set_rng_state = lambda state, device=None: torch.set_rng_state(state)  # type: ignore[attr-defined]
    mod.empty_cache = _noop  # type: ignore[attr-defined]
    mod.ipc_collect = _noop  # type: ignore[attr-defined]
    mod.set_per_process_memory_fraction = _noop  # type: ignore[attr-defined]
    mod.reset_peak_memory_stats = _noop  # type: ignore[attr-defined]
    mod.mem_get_info = _mem_get_info  # type: ignore[attr-defined]
    mod.memory_allocated = lambda device=None: _rss_bytes()  # type: ignore[attr-defined]
    mod.memory_reserved = lambda device=None: _rss_bytes()  # type: ignore[attr-defined]
    mod.max_memory_allocated = lambda device=None: _peak_rss_bytes()  # type: ignore[attr-defined]
    mod.max_memory_reserved = lambda device=None: _peak_rss_bytes()  # type: ignore[attr-defined]
    return mod


_CPU_DEVICE_MODULE = _build_cpu_device_module()


class PlatformCPU(PlatformBase):
    """verl platform for plain CPU processes (gloo collectives, no accelerator). ``current_device()`` is
    ``"cpu"``, not an index: verl passes it to ``Tensor.to``/``torch.device``, where an integer means ``cuda:<i>``."""

    def __init__(self) -> None:
        super().__init__()
        # instantiated only when get_platform() resolves to "cpu": the one moment the patch is known to be wanted
        _patch_process_group_backend()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return _CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # never auto-detected: only an explicit VERL_PLATFORM=cpu selects it (verl reads it before probing)
        return False

    def current_device(self) -> str:  # type: ignore[override]
        return "cpu"

    def device_count(self) -> int:
        return 1

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        # no device masking on CPU; a dedicated name keeps verl's env plumbing harmless
        return "VERL_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        with torch.profiler.record_function(msg):
            yield

    def ray_resource_name(self) -> str:
        # per node, like "GPU": verl's placement groups (one per node) spread the ranks over nodes as on GPUs
        return DEVICE_RESOURCE

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        # a worker's share of its device slot, and as much of a CPU (a slot's bundle holds max_colocate_count CPUs)
        return {"num_cpus": num_gpus, "resources": {DEVICE_RESOURCE: num_gpus}}

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        """What has no host counterpart: device selection and synchronisation, the CUDA caching allocator's
        settings ("expandable_segments:...") and cache, the CUDA profiler, ``cudart``."""
        return None

    set_device = synchronize = set_allocator_settings = empty_cache = profiler_start = profiler_stop = _nothing
    cudart = _nothing


def _register_engines(transformer_impl: types.ModuleType) -> None:
    """Register verl's FSDP engines for ``device="cpu"`` (FSDP2) and a loud guard for FSDP1."""
    global _engines_registered
    with _lock:
        if _engines_registered:
            return
        from verl.workers.engine.base import EngineRegistry

        lm_cls = transformer_impl.FSDPEngineWithLMHead
        value_cls = transformer_impl.FSDPEngineWithValueHead
        for model_type, cls in (("language_model", lm_cls), ("value_model", value_cls)):
            registry = EngineRegistry._engines.setdefault(model_type, {})
            # skip existing keys: a re-run after a partial registration must not trip the duplicate-key assertion
            if PLATFORM_NAME not in registry.get("fsdp2", {}):
                EngineRegistry.register(model_type=model_type, backend="fsdp2", device=PLATFORM_NAME)(cls)
            if PLATFORM_NAME not in registry.get("fsdp", {}):
                EngineRegistry.register(model_type=model_type, backend="fsdp", device=PLATFORM_NAME)(_fsdp1_guard(cls))
        _patch_fsdp2_save_to_cpu()
        _engines_registered = True


def _live_storages(model: torch.nn.Module) -> set[int]:
    """Storage addresses of ``model``'s parameters (a DTensor's local shard for FSDP2)."""
    from torch.distributed.tensor import DTensor

    return {
        (param._local_tensor if isinstance(param, DTensor) else param).untyped_storage().data_ptr()
        for param in model.parameters()
    }


def _patch_fsdp2_save_to_cpu() -> None:
    """Make ``fsdp2_sharded_save_to_cpu`` copy the shards it saves (docs/cpu_platform.md). Idempotent."""
    from verl.utils import fsdp_utils

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def fsdp2_sharded_save_to_cpu(model: torch.nn.Module) -> tuple[dict[str, tuple[torch.Tensor, Any]], Any]:
            cpu_sharded_state, global_spec = original(model)
            live = _live_storages(model)
            copied = {
                name: (tensor.clone() if tensor.untyped_storage().data_ptr() in live else tensor, spec)
                for name, (tensor, spec) in cpu_sharded_state.items()
            }
            return copied, global_spec

        return fsdp2_sharded_save_to_cpu

    patch_checked(
        fsdp_utils, "fsdp2_sharded_save_to_cpu", ["model"], "verl.utils.fsdp_utils.fsdp2_sharded_save_to_cpu", make
    )


def _fsdp1_guard(base: type) -> type:
    """An engine class for ``strategy=fsdp`` on CPU that refuses to build, naming the fix."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "FSDP1 (strategy=fsdp) does not run on the CPU platform (VERL_PLATFORM=cpu): its "
            "FullyShardedDataParallel wrapper needs an accelerator device_id. Set "
            "actor_rollout_ref.actor.strategy=fsdp2 (and critic.strategy=fsdp2 / the engine config's "
            "strategy=fsdp2) to use FSDP2, which runs on gloo."
        )

    return type(f"{base.__name__}CPUFSDP1Unsupported", (base,), {"__init__": __init__, "__doc__": __init__.__doc__})


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot meta-path hook: run ``callback(module)`` right after ``name`` finishes importing."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; also stops us from finding ourselves below
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module
        callback = self.callback

        def exec_module(module: types.ModuleType) -> None:
            original_exec(module)
            callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _patch_process_group_backend() -> None:
    """Make verl's Ray-worker process-group init use plain ``cpu:gloo`` (docs/cpu_platform.md)."""
    from verl.utils import distributed as verl_dist

    fn = verl_dist.initialize_global_process_group_ray
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    if names != ("timeout_second", "backend"):
        raise RuntimeError(
            "verl_ext.cpu.platform: verl.utils.distributed.initialize_global_process_group_ray has "
            f"arguments {names}, expected ('timeout_second', 'backend') as in verl 0.9.1; the CPU "
            "platform's gloo backend patch needs updating for this verl version."
        )
    fn.__defaults__ = (None, "cpu:gloo")


def register_cpu_platform() -> None:
    """Register the ``cpu`` platform and the CPU FSDP2 engines with verl (idempotent), before verl resolves its
    platform: the ``verl.plugins`` entry point does, during ``import verl``."""
    if PlatformRegistry.get(PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)

    if _engines_registered:
        return
    module = sys.modules.get(_ENGINE_MODULE)
    if module is not None and hasattr(module, "FSDPEngineWithValueHead"):
        _register_engines(module)
        return
    with _lock:
        if not any(isinstance(f, _AfterImport) and f.name == _ENGINE_MODULE for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport(_ENGINE_MODULE, _register_engines))


__all__ = ["PLATFORM_NAME", "PlatformCPU", "register_cpu_platform"]
