"""The package layout's promises, each checked in a fresh interpreter (imports are process-global).

* A GPU node never imports :mod:`verl_ext.cpu`: the method core and the ``verl.plugins`` entry
  point load without it unless ``VERL_PLATFORM=cpu``; with it, ``import verl`` alone registers the
  cpu platform, the Ray CPU check and the ``hf_cpu`` rollout.
* Imports inside :mod:`verl_ext` run one way: parsed from the source (imports inside functions
  included), the graph between its modules has no cycle, and ``verl_ext.config`` is a leaf that
  imports verl and the standard library only. The loss-mode checks the config used to import
  lazily now live in ``verl_ext.losses`` and still fire where configs are built and consumed.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD_CORE = ["verl_ext.losses", "verl_ext.divergences", "verl_ext.config", "verl_ext.actor_loss", "verl_ext.entropy", "verl_ext.plugin"]
CPU_MODULES = ("verl_ext.cpu",)


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
        import json
        import verl
        from verl.plugin.platform import PlatformRegistry
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY
        from verl.single_controller.ray.base import ResourcePoolManager
        from verl_ext.cpu.platform import PlatformCPU
        print(json.dumps({
            "platform": PlatformRegistry.get("cpu") is PlatformCPU,
            "rollout": _ROLLOUT_REGISTRY.get(("hf_cpu", "async")),
            "resource_check": getattr(ResourcePoolManager._check_resource_available, "__verl_ext_cpu__", False),
        }))
        """,
        VERL_PLATFORM="cpu",
    )
    assert out == {"platform": True, "rollout": "verl_ext.cpu.rollout.HFCpuServerAdapter", "resource_check": True}


# ------------------------------------------------------------------------------------------------
# The import graph inside verl_ext
# ------------------------------------------------------------------------------------------------

PACKAGE = ROOT / "verl_ext"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _node(module: str) -> str:
    """The graph node of a verl_ext module: a top-level module, or a whole subpackage
    (``verl_ext.cpu.platform`` -> ``verl_ext.cpu``): importing any module of a subpackage runs its
    ``__init__``, so the subpackage is one unit to the rest of verl_ext."""
    return ".".join(module.split(".")[:2])


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, at any depth (module level, functions, conditionals).
    ``from pkg import name`` counts as ``pkg.name`` when that is a verl_ext module, else ``pkg``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base == "__future__":
                continue
            found.add(base)
            for alias in node.names:
                if base.startswith("verl_ext") and _is_module(f"{base}.{alias.name}"):
                    found.add(f"{base}.{alias.name}")
    return found


def verl_ext_import_graph() -> dict[str, set[str]]:
    """node -> the verl_ext nodes it imports (self-edges and the empty ``verl_ext`` __init__ left out)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        node = _node(module)
        graph.setdefault(node, set())
        for name in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            if name.startswith("verl_ext.") and _node(name) != node:
                graph[node].add(_node(name))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``[]`` if it is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_import_parser_sees_lazy_and_package_imports() -> None:
    source = textwrap.dedent(
        """
        from __future__ import annotations
        import verl_ext.losses
        from verl_ext import divergences
        from verl_ext.cpu import PLATFORM_NAME

        def check():
            from verl_ext.verl_modes import check_verl_mode_options
            if True:
                import verl_ext.adaptive_delta as ad
        """
    )
    found = imported_modules(source, "verl_ext.config")
    assert {"verl_ext.losses", "verl_ext.divergences", "verl_ext.cpu", "verl_ext.verl_modes", "verl_ext.adaptive_delta"} <= found
    assert "verl_ext.cpu.PLATFORM_NAME" not in found and "__future__" not in found
    assert imported_modules("from . import losses\nfrom .config import X", "verl_ext.verl_modes") == {"verl_ext", "verl_ext.losses", "verl_ext.config"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_verl_ext_imports_run_one_way() -> None:
    graph = verl_ext_import_graph()
    assert {"verl_ext.config", "verl_ext.losses", "verl_ext.verl_modes", "verl_ext.plugin", "verl_ext.cpu"} <= set(graph)
    # the edges the method depends on are seen, so an empty graph cannot pass
    assert {"verl_ext.config", "verl_ext.divergences"} <= graph["verl_ext.losses"]
    assert {"verl_ext.losses", "verl_ext.verl_modes", "verl_ext.entropy"} <= graph["verl_ext.actor_loss"]
    assert {"verl_ext.losses", "verl_ext.cpu"} <= graph["verl_ext.plugin"]
    cycle = find_cycle(graph)
    assert cycle == [], "import cycle inside verl_ext: " + " -> ".join(cycle)


def test_config_is_a_leaf_importing_only_verl_and_the_standard_library() -> None:
    imports = imported_modules((PACKAGE / "config.py").read_text(), "verl_ext.config")
    assert not [name for name in imports if name.split(".")[0] == "verl_ext"], imports
    foreign = sorted(name for name in imports if name.split(".")[0] not in sys.stdlib_module_names | {"verl"})
    assert foreign == [], foreign


def test_config_checks_need_no_import_of_the_losses_yet_still_fire() -> None:
    """Without plugins, importing the config loads no other verl_ext module; a config built before
    the losses are imported is checked by its consumer (resolve_policy_config); once they are
    imported, construction checks the loss mode again, naming the key."""
    out = _run(
        """
        import json, sys
        from verl_ext.config import DivClipPolicyLossConfig
        loaded = sorted(m for m in sys.modules if m.startswith("verl_ext"))
        early = DivClipPolicyLossConfig(loss_mode="kl4")
        from verl_ext.losses import resolve_policy_config
        errors = []
        for build in (lambda: resolve_policy_config({"policy_loss": early}),
                      lambda: DivClipPolicyLossConfig(loss_mode="kl4"),
                      lambda: DivClipPolicyLossConfig(loss_mode="clip", adaptive_delta_target=0.01),
                      lambda: DivClipPolicyLossConfig(loss_mode="sapo", dual_clip_c=10.0)):
            try:
                build()
                errors.append(None)
            except ValueError as error:
                errors.append(str(error))
        print(json.dumps({"loaded": loaded, "errors": errors}))
        """,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert out["loaded"] == ["verl_ext", "verl_ext.config"]
    unknown, unknown_built, adaptive, dual_clip = out["errors"]
    assert unknown is not None and "actor_rollout_ref.actor.policy_loss.loss_mode='kl4' is not a registered" in unknown
    assert unknown_built == unknown
    assert adaptive is not None and "policy_loss.adaptive_delta_target adapts the KL budget delta" in adaptive
    assert dual_clip is not None and "policy_loss.dual_clip_c applies to the divclip modes" in dual_clip


def test_a_worker_that_imports_verl_checks_the_loss_mode_at_construction() -> None:
    """A Ray worker imports verl (whose plugin imports the losses) before hydra builds the config
    from its ``_target_``: the loss-mode check fires there, at construction."""
    out = _run(
        """
        import json
        import verl
        from verl_ext.config import DivClipPolicyLossConfig
        try:
            DivClipPolicyLossConfig(loss_mode="kl4")
            error = None
        except ValueError as e:
            error = str(e)
        print(json.dumps({"error": error}))
        """
    )
    assert out["error"] is not None and "policy_loss.loss_mode='kl4' is not a registered" in out["error"]
