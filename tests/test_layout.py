"""The package layout's promises, each checked in a fresh interpreter (imports are process-global).

* A GPU node never imports :mod:`verl_ext.cpu`: the method core and the ``verl.plugins`` entry
  point load without it unless ``VERL_PLATFORM=cpu``; with it, ``import verl`` alone registers the
  cpu platform, the Ray CPU check and the ``hf_cpu`` rollout.
* The CPU modules' old paths (``verl_ext.platform_cpu``, ``verl_ext.ray_cpu``,
  ``verl_ext.rollout_cpu``) still import, warn with ``DeprecationWarning`` naming the new path, and
  hand out the very same objects.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD_CORE = ["verl_ext.losses", "verl_ext.divergences", "verl_ext.config", "verl_ext.actor_loss", "verl_ext.entropy", "verl_ext.plugin"]
CPU_MODULES = ("verl_ext.cpu", "verl_ext.platform_cpu", "verl_ext.ray_cpu", "verl_ext.rollout_cpu")


def _run(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter from the repo root; it prints one JSON object last."""
    environ = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    environ.update(env)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_method_core_and_plugin_do_not_import_the_cpu_package() -> None:
    out = _run(
        f"""
        import importlib, json, sys
        import verl  # runs the verl.plugins entry point (verl_ext.plugin) as on every GPU node
        for name in {METHOD_CORE!r}:
            importlib.import_module(name)
        print(json.dumps({{
            "core": [name for name in {METHOD_CORE!r} if name in sys.modules],
            "cpu": sorted(m for m in sys.modules if m.startswith({CPU_MODULES!r})),
        }}))
        """
    )
    assert out["core"] == METHOD_CORE
    assert out["cpu"] == []


def test_verl_platform_cpu_sets_the_process_up_through_the_plugin() -> None:
    out = _run(
        """
        import json, sys
        import verl
        from verl.plugin.platform import PlatformRegistry
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.single_controller.ray.base import ResourcePoolManager
        from verl_ext.cpu.platform import PlatformCPU
        print(json.dumps({
            "platform": PlatformRegistry.get("cpu") is PlatformCPU,
            "rollout": _ROLLOUT_REGISTRY.get(("hf_cpu", "async")),
            "resource_check": getattr(ResourcePoolManager._check_resource_available, "__verl_ext_cpu__", False),
            "old_paths": sorted(m for m in sys.modules if m in ("verl_ext.platform_cpu", "verl_ext.ray_cpu", "verl_ext.rollout_cpu")),
        }))
        """,
        VERL_PLATFORM="cpu",
    )
    assert out == {"platform": True, "rollout": "verl_ext.cpu.rollout.HFCpuServerAdapter", "resource_check": True, "old_paths": []}


def test_old_cpu_module_paths_warn_and_alias_the_new_modules() -> None:
    out = _run(
        """
        import importlib, json, warnings
        from verl_ext.cpu import platform, ray_resources, rollout, sampling, setup_cpu_process, cpu_platform_selected
        same = {}
        messages = {}
        for old in ("verl_ext.platform_cpu", "verl_ext.ray_cpu", "verl_ext.rollout_cpu"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                module = importlib.import_module(old)
            messages[old] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)]
        import verl_ext.platform_cpu as p, verl_ext.ray_cpu as r, verl_ext.rollout_cpu as ro
        from verl_ext.rollout_cpu import *  # the old __all__ still resolves
        same["platform"] = p.PlatformCPU is platform.PlatformCPU and p.register_cpu_platform is platform.register_cpu_platform
        same["platform_private"] = p._patch_process_group_backend is platform._patch_process_group_backend
        same["ray"] = r.setup_cpu_process is setup_cpu_process and r.cpu_platform_selected is cpu_platform_selected and r.enable_cpu_ray is ray_resources.enable_cpu_ray
        same["ray_private"] = r._check_cpu_resources_available is ray_resources._check_cpu_resources_available
        same["rollout"] = ro.HFCpuServerAdapter is rollout.HFCpuServerAdapter and ro.register_cpu_rollout is rollout.register_cpu_rollout
        same["sampling"] = ro.generate_batch is sampling.generate_batch and ro.SamplingSpec is sampling.SamplingSpec and ro.load_hf_model is rollout.load_hf_model
        same["star"] = generate_batch is sampling.generate_batch and HFCpuReplica is rollout.HFCpuReplica
        print(json.dumps({"same": same, "messages": messages}))
        """
    )
    assert all(out["same"].values()), out["same"]
    news = {"verl_ext.platform_cpu": "verl_ext.cpu.platform", "verl_ext.ray_cpu": "verl_ext.cpu.ray_resources", "verl_ext.rollout_cpu": "verl_ext.cpu.rollout"}
    for old, new in news.items():
        assert len(out["messages"][old]) == 1 and new in out["messages"][old][0], out["messages"]
