"""The ``cpu`` verl platform (verl_ext/cpu/platform.py).

Platform selection is process-global in verl (a cached singleton read from ``VERL_PLATFORM``), so the
checks that select it run in one fresh interpreter (``subprocess``) and report back as JSON; the
pytest process keeps whatever platform it had.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = textwrap.dedent(
    """
    import json, os, sys
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from verl_ext.cpu.platform import PlatformCPU, register_cpu_platform
    register_cpu_platform()
    register_cpu_platform()  # idempotent
    out = {}
    hooked_before_import = "verl.workers.engine.fsdp.transformer_impl" not in sys.modules
    import torch
    from verl.plugin.platform import PlatformRegistry, get_platform
    from verl.utils import device as dev
    from verl.workers.engine import EngineRegistry, FSDPEngineWithLMHead
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead
    out["hooked_before_import"] = hooked_before_import
    out["registry_is_cpu_class"] = PlatformRegistry.get("cpu") is PlatformCPU
    out["platform_class"] = type(get_platform()).__name__
    out["device_name"] = dev.get_device_name()
    out["backend"] = dev.get_nccl_backend()
    out["device_id"] = dev.get_device_id()
    out["resource"] = dev.get_resource_name()
    tdev = dev.get_torch_device()
    out["max_mem_positive"] = tdev.max_memory_allocated() > 0 and tdev.memory_allocated() > 0
    free, total = tdev.mem_get_info()
    out["mem_info_sane"] = 0 < free <= total
    tdev.manual_seed(3); a = torch.rand(2); tdev.set_rng_state(tdev.get_rng_state()); tdev.empty_cache()
    out["lm_engine"] = EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead
    out["value_engine"] = EngineRegistry.get_engine_cls("value_model", "fsdp2") is FSDPEngineWithValueHead
    register_cpu_platform()  # again after the engines exist: no duplicate-registration assertion
    fsdp1 = EngineRegistry.get_engine_cls("language_model", "fsdp")
    try:
        fsdp1(None, None, None, None)
        out["fsdp1_error"] = None
    except NotImplementedError as e:
        out["fsdp1_error"] = str(e)
    from verl.utils.distributed import initialize_global_process_group_ray
    initialize_global_process_group_ray(timeout_second=60)
    out["pg_backend"] = str(torch.distributed.get_backend())
    t = torch.ones(3); torch.distributed.all_reduce(t)
    out["all_reduce"] = t.tolist()
    torch.distributed.destroy_process_group()
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("VERL_PLATFORM", None)
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])


def test_verl_platform_cpu_selects_the_cpu_platform(probe: dict[str, Any]) -> None:
    assert probe["registry_is_cpu_class"]
    assert probe["platform_class"] == "PlatformCPU"
    assert (probe["device_name"], probe["backend"], probe["device_id"], probe["resource"]) == (
        "cpu",
        "gloo",
        "cpu",
        "cpu_device",
    )  # a per-node device resource, like GPU


def test_cpu_device_module_reports_host_memory(probe: dict[str, Any]) -> None:
    assert probe["max_mem_positive"]
    assert probe["mem_info_sane"]


def test_fsdp2_engines_registered_lazily_for_cpu(probe: dict[str, Any]) -> None:
    assert probe["hooked_before_import"], "the probe must exercise the import-hook registration path"
    assert probe["lm_engine"] and probe["value_engine"]


def test_fsdp1_on_cpu_fails_naming_the_strategy_key(probe: dict[str, Any]) -> None:
    assert probe["fsdp1_error"] is not None
    assert "actor_rollout_ref.actor.strategy=fsdp2" in probe["fsdp1_error"]


def test_verl_ray_process_group_init_works_on_gloo(probe: dict[str, Any]) -> None:
    # verl's default backend string would be the invalid "cpu:gloo,cpu:gloo"
    assert probe["pg_backend"] == "cpu:gloo"
    assert probe["all_reduce"] == [1.0, 1.0, 1.0]


def test_cpu_platform_is_never_auto_detected() -> None:
    sys.path.insert(0, str(ROOT))
    from verl_ext.cpu.platform import PlatformCPU

    platform = PlatformCPU.__new__(PlatformCPU)  # no __init__: keep the pytest process unpatched
    assert platform.is_available()
    assert not platform.is_platform_available(use_smi_check=True)
    assert not platform.is_platform_available(use_smi_check=False)
