"""The package layout's promises: what an import loads is checked in a fresh interpreter (imports
are process-global); who imports whom is parsed from the source (imports inside functions included).

* A GPU node never imports :mod:`verl_ext.cpu`: the method core and the ``verl.plugins`` entry
  point load without it unless ``VERL_PLATFORM=cpu``; with it, ``import verl`` alone registers the
  cpu platform, the Ray CPU check and the ``hf_cpu`` rollout.
* Imports inside :mod:`verl_ext` run one way: parsed from the source (imports inside functions
  included), the graph between its modules is the one drawn in ``verl_ext``'s docstring and has no
  cycle, and ``verl_ext.config`` is a leaf that imports verl and the standard library only. The
  config's loss-mode checks live in ``verl_ext.registry`` and fire where configs are built and consumed.
* The method's math (:mod:`verl_ext.core`) imports no engine code: parsed, its modules import only torch,
  the standard library, ``verl_ext.config``, each other and verl's ``core_algos``; imported in a fresh
  interpreter, it loads no verl engine or worker module, no ``verl_ext.engine``, no transformers. Only
  ``verl_ext.engine`` (and the CPU platform) import verl's engine and worker modules: every hook into
  verl is behind the seam. No source file is over 600 lines.
* Who may import whom across the packages, as each package's docstring states it (parsed from the
  source, lazy imports included): product code (``verl_ext``, ``recipe``, ``data_prep``) never
  imports ``tests``; ``data_prep`` imports neither ``recipe`` nor ``verl_ext`` nor verl;
  ``verl_ext`` imports neither ``recipe`` nor ``data_prep``; only ``verl_ext.plugin`` (and the
  probes' CPU engine) imports ``verl_ext.cpu``, which imports nothing else of ``verl_ext``;
  nothing outside ``recipe.bench`` imports ``recipe.bench``; ``recipe.eval``'s modules import only the ones
  above them in its docstring's table, never ``verl_ext``; the reward's worker module is imported
  by the reward alone.
* No module of the product takes part in an import cycle: parsed module by module across the three
  packages, lazy imports included (a module's import of its own package excepted: Python makes that
  one anyway).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHOD_CORE = [
    "verl_ext.config",
    "verl_ext.core.surrogate",
    "verl_ext.core.divergences",
    "verl_ext.core.erc",
    "verl_ext.core.entropy",
    "verl_ext.core.vocab_pass",
    "verl_ext.core.coarsened_kl",
    "verl_ext.core.gauge",
    "verl_ext.registry",
    "verl_ext.engine.seam",
    "verl_ext.actor_loss",
    "verl_ext.plugin",
]
CPU_MODULES = ("verl_ext.cpu",)
PRODUCT_PACKAGES = ("verl_ext", "recipe", "data_prep")  # what pyproject.toml ships


def _run(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter from the repo root; it prints one JSON object last."""
    environ = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    environ.update(env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
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


# ------------------------------------------------------------------------------------------------
# The method's math apart from the engine; every hook into verl behind the seam
# ------------------------------------------------------------------------------------------------

CORE = ROOT / "verl_ext" / "core"
ENGINE_CODE = ("verl.workers.engine", "verl.workers.engine_workers", "verl.workers.utils", "verl_ext.engine", "peft")


def test_the_core_imports_no_engine_code_in_its_source() -> None:
    allowed_verl = {"verl.trainer.ppo.core_algos"}
    found: dict[str, set[str]] = {}
    for path in sorted(CORE.glob("*.py")):
        module = _module_name(path)
        names = imported_modules(path.read_text(), module, path.name == "__init__.py")
        foreign = {
            n
            for n in names
            if n.split(".")[0] not in sys.stdlib_module_names | {"torch"}
            and not _within(n, "verl_ext.core", "verl_ext.config")
            and n not in allowed_verl
        }
        if foreign:
            found[module] = foreign
    assert found == {}
    assert len(list(CORE.glob("*.py"))) >= 9  # the scan sees the package


def test_importing_the_core_loads_no_engine_code() -> None:
    """In a fresh interpreter (no plugins): the core loads no verl engine or worker module and nothing of
    verl_ext.engine; beyond what verl's own ``core_algos`` (``agg_loss``) loads, it adds only its own modules
    and the config."""
    out = _run(
        f"""
        import json, pkgutil, importlib, sys
        import verl.trainer.ppo.core_algos
        before = set(sys.modules)
        import verl_ext.core
        for info in pkgutil.iter_modules(verl_ext.core.__path__):
            importlib.import_module("verl_ext.core." + info.name)
        print(json.dumps({{
            "core": sorted(m for m in sys.modules if m.startswith("verl_ext.core.")),
            "engine": sorted(m for m in sys.modules if m.startswith({ENGINE_CODE!r})),
            "added": sorted(set(sys.modules) - before),
        }}))
        """,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert len(out["core"]) >= 9 and out["engine"] == []
    assert [m for m in out["added"] if not _within(m, "verl_ext.core", "verl_ext.config", "verl_ext")] == []


def test_only_the_seam_and_the_cpu_platform_import_verls_engine() -> None:
    """Every hook into verl's engine and workers lives in verl_ext.engine (the CPU platform registers
    verl's engine class for the cpu device, which is its own reason to import it)."""
    imports = product_imports()
    engine_modules = ("verl.workers.engine", "verl.workers.engine_workers")
    importers = {
        m for m, names in imports.items() if _within(m, "verl_ext") and any(_within(n, *engine_modules) for n in names)
    }
    assert importers and {m for m in importers if not _within(m, "verl_ext.engine", "verl_ext.cpu")} == set(), importers


def test_no_source_file_is_over_600_lines() -> None:
    lengths = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in PRODUCT_PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert len(lengths) > 50
    assert {path: n for path, n in lengths.items() if n > 600} == {}


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


def _nodes_run_at_import(tree: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``tree`` that run when the module is imported: all but function bodies."""
    for child in ast.iter_child_nodes(tree):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield child
            yield from _nodes_run_at_import(child)


def imported_modules(source: str, module: str, is_package: bool = False, at_import_only: bool = False) -> set[str]:
    """Every module ``source`` imports, at any depth (module level, functions, conditionals), or
    with ``at_import_only`` only those imported when the module itself is imported (no function
    bodies). ``from pkg import name`` counts as ``pkg.name`` when that is a module of the project's
    packages, else ``pkg``."""
    found: set[str] = set()
    tree = ast.parse(source)
    for node in _nodes_run_at_import(tree) if at_import_only else ast.walk(tree):
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
                if base.split(".")[0] in PRODUCT_PACKAGES and _is_module(f"{base}.{alias.name}"):
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
                return path[path.index(target) :] + [target]
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
        import verl_ext.registry
        from verl_ext.core import divergences
        from verl_ext.cpu import PLATFORM_NAME

        def check():
            from verl_ext.verl_modes import verl_policy_loss
            if True:
                import verl_ext.adaptive_delta as ad
        """
    )
    found = imported_modules(source, "verl_ext.config")
    assert {
        "verl_ext.registry",
        "verl_ext.core.divergences",
        "verl_ext.cpu",
        "verl_ext.verl_modes",
        "verl_ext.adaptive_delta",
    } <= found
    assert "verl_ext.cpu.PLATFORM_NAME" not in found and "__future__" not in found
    assert imported_modules("from . import registry\nfrom .config import X", "verl_ext.verl_modes") == {
        "verl_ext",
        "verl_ext.registry",
        "verl_ext.config",
    }
    assert imported_modules("from . import erc", "verl_ext.core.surrogate") == {"verl_ext.core", "verl_ext.core.erc"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_verl_ext_imports_run_one_way() -> None:
    graph = verl_ext_import_graph()
    assert {
        "verl_ext.config",
        "verl_ext.core",
        "verl_ext.engine",
        "verl_ext.registry",
        "verl_ext.plugin",
        "verl_ext.cpu",
    } <= set(graph)
    # the edges the method depends on are seen, so an empty graph cannot pass
    assert {"verl_ext.config", "verl_ext.core", "verl_ext.verl_modes"} <= graph["verl_ext.registry"]
    assert {"verl_ext.registry", "verl_ext.engine", "verl_ext.core"} <= graph["verl_ext.actor_loss"]
    assert {"verl_ext.registry", "verl_ext.cpu"} <= graph["verl_ext.plugin"]
    assert graph["verl_ext.core"] == {"verl_ext.config"} and graph["verl_ext.engine"] == {"verl_ext.core"}
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
        from verl_ext.registry import resolve_policy_config
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
    assert dual_clip is not None and "policy_loss.dual_clip_c is the divclip modes' dual-clip cap" in dual_clip


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


# ------------------------------------------------------------------------------------------------
# Who may import whom, across the packages (the rules of each package's docstring)
# ------------------------------------------------------------------------------------------------


def product_imports(at_import_only: bool = False) -> dict[str, set[str]]:
    """module -> every module it imports, for each module the wheel ships (``PRODUCT_PACKAGES``)."""
    imports: dict[str, set[str]] = {}
    for package in PRODUCT_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = _module_name(path)
            imports[module] = imported_modules(path.read_text(), module, path.name == "__init__.py", at_import_only)
    return imports


def _within(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def importers_of(target: str, imports: dict[str, set[str]]) -> set[str]:
    """The product modules outside ``target`` that import ``target`` or any module below it."""
    return {
        module
        for module, names in imports.items()
        if not _within(module, target) and any(_within(n, target) for n in names)
    }


def test_the_scan_covers_every_package_and_sees_their_imports() -> None:
    imports = product_imports()
    for package in PRODUCT_PACKAGES:
        assert sum(_within(module, package) for module in imports) >= 6, package
    # known edges, so that an empty scan cannot pass the rules below
    assert (
        "data_prep.sft_tokens" in imports["recipe.sft_dataset"] and "data_prep.convert" in imports["recipe.smoke.task"]
    )
    assert "data_prep.openmath" in imports["data_prep.__main__"]  # ``from data_prep import openmath``
    assert (
        "recipe.reward.score" in imports["recipe.eval.metrics"]
        and "verl_ext.cpu.platform" in imports["recipe.bench.harness"]
    )


def test_product_code_never_imports_tests() -> None:
    offenders = {
        module: sorted(n for n in names if _within(n, "tests", "conftest"))
        for module, names in product_imports().items()
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_data_prep_imports_neither_recipe_nor_verl_ext_nor_verl() -> None:
    imports = product_imports()
    offenders = {
        m: sorted(n for n in names if _within(n, "recipe", "verl_ext", "verl"))
        for m, names in imports.items()
        if _within(m, "data_prep")
    }
    assert {m: names for m, names in offenders.items() if names} == {}


def test_verl_ext_imports_neither_recipe_nor_data_prep() -> None:
    imports = product_imports()
    offenders = {
        m: sorted(n for n in names if _within(n, "recipe", "data_prep"))
        for m, names in imports.items()
        if _within(m, "verl_ext")
    }
    assert {m: names for m, names in offenders.items() if names} == {}
    assert importers_of("recipe", imports) == set()  # so nothing below recipe imports it


def test_package_inits_import_what_their_docstrings_promise() -> None:
    """``verl_ext/__init__``, ``recipe/__init__`` and each of recipe's subpackages' ``__init__`` import nothing
    (``import verl_ext.x`` loads only ``x``); ``verl_ext/cpu/__init__`` imports only the standard library when
    imported (its submodules, which pull in verl, are imported inside :func:`setup_cpu_process`)."""
    imports = product_imports()
    assert imports["verl_ext"] == set() and imports["recipe"] == set()
    subpackages = [p.parent.name for p in (ROOT / "recipe").glob("*/__init__.py")]
    assert "eval" in subpackages and {name: imports[f"recipe.{name}"] for name in subpackages} == {
        name: set() for name in subpackages
    }
    at_import = product_imports(at_import_only=True)["verl_ext.cpu"]
    assert sorted(n for n in at_import if n.split(".")[0] not in sys.stdlib_module_names) == []
    assert {"verl_ext.cpu.platform", "verl_ext.cpu.rollout"} <= imports["verl_ext.cpu"]  # the lazy ones are seen


def test_verl_ext_cpu_is_imported_by_the_plugin_and_the_cpu_engine_only() -> None:
    """Inside ``verl_ext`` only the plugin imports the CPU support, and ``verl_ext.cpu`` imports
    nothing else of ``verl_ext``. Outside it, only CPU-only tools do: the benchmarks' engine
    (``recipe.bench.harness``)."""
    imports = product_imports()
    importers = importers_of("verl_ext.cpu", imports)
    assert {m for m in importers if _within(m, "verl_ext")} == {"verl_ext.plugin"}
    assert {m for m in importers if not _within(m, "verl_ext", "recipe.bench")} == set(), importers
    outside = {
        m: sorted(n for n in names if _within(n, "verl_ext") and not _within(n, "verl_ext.cpu"))
        for m, names in imports.items()
        if _within(m, "verl_ext.cpu")
    }
    assert {m: names for m, names in outside.items() if names} == {}


def documented_verl_ext_graph() -> dict[str, set[str]]:
    """The import graph drawn in ``verl_ext/__init__.py``'s docstring (``a, b -> c, d (why)``)."""
    docstring = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text())) or ""
    block = docstring.split("::", 1)[1].split("\n\n")[1]  # the indented block after the "::"
    graph: dict[str, set[str]] = {}
    for line in block.splitlines():
        sources, targets = line.split("->")
        edges = {f"verl_ext.{t.strip()}" for t in re.split(r"[,;]", re.sub(r"\([^)]*\)", "", targets)) if t.strip()}
        for source in sources.split(","):
            graph[f"verl_ext.{source.strip()}"] = edges
    return graph


def test_verl_ext_imports_are_the_graph_its_docstring_draws() -> None:
    documented = documented_verl_ext_graph()
    assert {"verl_ext.config", "verl_ext.core", "verl_ext.engine", "verl_ext.plugin"} <= set(documented) and documented[
        "verl_ext.config"
    ] == set()
    actual = {
        node: edges for node, edges in verl_ext_import_graph().items() if node not in ("verl_ext", "verl_ext.cpu")
    }
    assert actual == documented, "update the graph in verl_ext/__init__.py's docstring to what the code imports"


def _ancestors(module: str) -> set[str]:
    """The packages above ``module`` (``recipe.bench.gpu`` -> ``recipe.bench``, ``recipe``)."""
    parts = module.split(".")
    return {".".join(parts[:end]) for end in range(1, len(parts))}


def product_import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (module level or inside functions), one node per module
    the wheel ships. A module's import of a package above it is no edge: Python imports every package
    before any module below it whatever the source says, so that dependency is in every package's
    modules alike and is no choice of ours (``verl_ext.cpu.platform`` reads ``PLATFORM_NAME`` from
    ``verl_ext.cpu``, whose ``setup_cpu_process`` imports the platform when called)."""
    imports = product_imports()
    return {
        module: {n for n in names if n in imports and n != module and n not in _ancestors(module)}
        for module, names in imports.items()
    }


def test_no_product_module_takes_part_in_an_import_cycle() -> None:
    """Across ``verl_ext``, ``recipe`` and ``data_prep``, module by module, lazy imports included: who
    imports whom runs one way (``recipe.bench.gpu`` and ``recipe.bench.acceptance`` share
    ``recipe.bench.gpu_workload``; ``recipe.bench.__main__`` routes ``gpu --acceptance``)."""
    graph = product_import_graph()
    # edges the scan must see, lazy ones included, so that an empty graph cannot pass
    assert {"recipe.bench.child", "recipe.bench.harness"} <= graph["recipe.bench.acceptance"]  # harness: in _loss
    assert "verl_ext.cpu.platform" in graph["verl_ext.cpu"]  # inside setup_cpu_process
    assert "verl_ext.cpu" not in graph["verl_ext.cpu.platform"]  # its own package: no edge
    cycle = find_cycle(graph)
    assert cycle == [], "import cycle: " + " -> ".join(cycle)


def test_recipe_bench_is_imported_by_nothing_else_and_imports_only_the_reward_of_recipe() -> None:
    imports = product_imports()
    assert importers_of("recipe.bench", imports) == set()
    of_recipe = {
        n
        for m, names in imports.items()
        if _within(m, "recipe.bench")
        for n in names
        if _within(n, "recipe") and not _within(n, "recipe.bench")
    }
    assert of_recipe == {"recipe.reward.score"}


def eval_table_order() -> list[str]:
    """The modules of ``recipe.eval`` in the order of its docstring's table (each imports only those above it)."""
    docstring = ast.get_docstring(ast.parse((ROOT / "recipe" / "eval" / "__init__.py").read_text())) or ""
    return re.findall(r"^``(recipe\.eval\.\w+)``", docstring, flags=re.MULTILINE)


def test_recipe_eval_modules_import_only_those_above_them_and_never_verl_ext() -> None:
    imports = product_imports()
    order = eval_table_order()
    assert order[:2] == ["recipe.eval.metrics", "recipe.eval.presets"] and order[-1] == "recipe.eval.cli"
    assert set(order) == {m for m in imports if _within(m, "recipe.eval")} - {"recipe.eval", "recipe.eval.__main__"}
    for position, module in enumerate(order):
        of_eval = {n for n in imports[module] if _within(n, "recipe.eval")}
        assert of_eval <= set(order[:position]), (module, sorted(of_eval - set(order[:position])))
    eval_imports = {n for m, names in imports.items() if _within(m, "recipe.eval") for n in names}
    assert not [n for n in eval_imports if _within(n, "verl_ext")]
    assert {n for n in eval_imports if _within(n, "recipe") and not _within(n, "recipe.eval")} == {
        "recipe.reward.score"
    }
    at_import = {
        n for m, names in product_imports(at_import_only=True).items() if _within(m, "recipe.eval") for n in names
    }
    assert not [n for n in at_import if _within(n, "recipe.reward.score", "vllm")], (
        "the reward and vLLM are imported lazily"
    )


def test_the_reward_worker_module_is_imported_by_the_reward_alone() -> None:
    """A math-verify worker process imports ``recipe.reward.workers`` only; ``recipe.reward.score`` is
    its one importer, and ``recipe.eval`` and the benchmarks are the reward's only importers."""
    imports = product_imports()
    assert not [n for n in imports["recipe.reward.workers"] if _within(n, *PRODUCT_PACKAGES)]
    assert importers_of("recipe.reward.workers", imports) == {"recipe.reward.score"}
    assert {
        m for m in importers_of("recipe.reward.score", imports) if not _within(m, "recipe.eval", "recipe.bench")
    } == set()
