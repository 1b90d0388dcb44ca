"""The project as a user installs it: a wheel, in a fresh virtualenv, run from a directory that is
not the checkout, with no ``tests/`` and no editable install on the path.

The wheel is built offline from a copy of what ``pyproject.toml`` ships (the checkout is left
untouched) and installed with pip into a ``python -m venv``. Its third-party dependencies (torch,
verl, ...) come from the running environment through one ``.pth`` line naming its site-packages:
a ``.pth`` line only adds a directory, the ``.pth`` files inside it are not run, so the editable
install's import hook (``__editable__*.pth``) stays off and ``verl_ext``, ``recipe`` and
``data_prep`` can only come from the wheel. (verl's own wheel ships a top-level ``tests`` package,
so ``import tests`` may succeed there; what must not import is this project's test suite.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("verl_ext", "recipe", "data_prep")  # [tool.setuptools.packages.find] include
#: Modules of the vLLM-on-CPU seams (docs/vllm_cpu.md): they subclass verl's vLLM server and worker extension, so
#: they import only where vLLM is installed (.venv-vllm); elsewhere verl's own import of vLLM refuses them.
NEEDS_VLLM = {"verl_ext.cpu.vllm_server", "verl_ext.cpu.vllm_worker"}
# The CPU-sized probe at its smallest shape: the baseline and one ERC variant (tests/test_bench_gpu_probe_cpu.py).
PROBE_ARGS = ["--device", "cpu", "--tokens", "128", "--sequences", "4", "--vocab", "2048", "--layers", "1",
              "--hidden", "64", "--head-scale", "300", "--repeats", "1", "--variants", "divclip_erc_eager"]  # fmt: skip


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env() -> dict[str, str]:
    """The environment minus anything that would put the checkout on the path."""
    drop = {"PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME", "VERL_PLATFORM"}
    return {key: value for key, value in os.environ.items() if key not in drop} | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build the wheel, install it into a fresh venv; returns its python and a scratch cwd."""
    pytest.importorskip(
        "setuptools", minversion="68", reason="building the wheel offline needs the build backend installed"
    )
    base = tmp_path_factory.mktemp("installed_wheel")
    source = base / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for package in SHIPPED:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = _clean_env()
    _check(subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--quiet", "--wheel-dir", str(base / "dist"), str(source)],
                          cwd=base, env=env, capture_output=True, text=True, timeout=300))  # fmt: skip
    (wheel,) = (base / "dist").glob("verl_divclip-*.whl")
    venv = base / "venv"
    _check(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    python = venv / "bin" / "python"
    _check(subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           "--quiet", str(wheel)], cwd=base, env=env, capture_output=True, text=True, timeout=300))  # fmt: skip
    site = Path(_check(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      env=env, capture_output=True, text=True, timeout=60)).stdout.strip())  # fmt: skip
    dependencies = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_divclip_test_dependencies.pth").write_text("".join(f"{path}\n" for path in dependencies))
    cwd = base / "elsewhere"
    cwd.mkdir()
    return {"python": python, "site": site, "wheel": wheel, "cwd": cwd, "env": env, "dependencies": list(dependencies)}


def _run(installed: dict[str, Any], *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed["python"]), *args], cwd=installed["cwd"], env=installed["env"],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_the_wheel_ships_the_three_packages_and_no_tests(installed: dict[str, Any]) -> None:
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    tops = {name.split("/")[0] for name in names}
    metadata = {top for top in tops if top.startswith("verl_divclip-") and top.endswith(".dist-info")}
    assert len(metadata) == 1 and tops - metadata == set(SHIPPED), sorted(tops)
    assert {
        "recipe/bench/harness.py",
        "recipe/bench/child.py",
        "data_prep/sft_tokens.py",
        "verl_ext/cpu/__init__.py",
    } <= set(names)


def test_every_shipped_module_imports_from_the_wheel_alone(installed: dict[str, Any]) -> None:
    """Each module of the wheel (``__main__`` modules aside: they run their CLI) imports in the fresh
    venv from the wheel, with the checkout off the path and none of its test modules loaded."""
    out = _check(
        _run(
            installed,
            "-c",
            f"""
import importlib, json, pkgutil, sys
names = []
for top in {SHIPPED!r}:
    package = importlib.import_module(top)
    names += [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".") if not m.name.endswith(".__main__")]
failed = {{}}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as error:
        failed[name] = repr(error)
print(json.dumps({{
    "names": names, "failed": failed, "path": sys.path,
    "files": {{name: sys.modules[name].__file__ for name in names if name in sys.modules}},
    "project_tests": sorted(m for m in sys.modules if m.split(".")[0] == "tests" and m != "tests"),
}}))
""",
        )
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    failed = result["failed"]
    # without vLLM, exactly the modules that subclass verl's vLLM classes fail, and for that reason alone
    assert set(failed) == NEEDS_VLLM, failed
    assert all("vllm version None not supported" in error for error in failed.values()), failed
    assert {
        "recipe.bench.harness",
        "recipe.bench.gpu",
        "recipe.bench.entropy_memory",
        "data_prep.sft_tokens",
        "verl_ext.plugin",
    } <= set(result["names"])
    assert all(Path(file).is_relative_to(installed["site"]) for file in result["files"].values()), result["files"]
    # the running environment's site-packages may sit inside the checkout (CI's .venv at the repo root):
    # besides those, nothing on the path may come from the checkout
    dependencies = [Path(path).resolve() for path in installed["dependencies"]]
    from_checkout = [
        entry
        for entry in result["path"]
        if entry
        and Path(entry).resolve().is_relative_to(ROOT)
        and not any(Path(entry).resolve().is_relative_to(dep) for dep in dependencies)
    ]
    assert not from_checkout, result["path"]
    assert result["project_tests"] == []


def test_gpu_probe_help_and_cpu_probe_run_from_the_wheel(installed: dict[str, Any]) -> None:
    """``python -m recipe.bench gpu --help``, then the CPU-sized probe: its variants run in child
    processes (``recipe.bench.child``) that must import the same installed code."""
    help_text = _check(_run(installed, "-m", "recipe.bench", "gpu", "--help", timeout=120)).stdout
    assert help_text.startswith("usage: python -m recipe.bench gpu") and "--device" in help_text
    out = installed["cwd"] / "probe.json"
    proc = _check(_run(installed, "-m", "recipe.bench", "gpu", *PROBE_ARGS, "--out", str(out)))
    results = {r["variant"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"no_entropy", "divclip_erc_eager"}, results
    assert results["divclip_erc_eager"]["on_policy_invariant"] is True
    assert results["divclip_erc_eager"]["entropy_path"] == "divclip_fp32"
    assert "ratio 1, nothing masked" in proc.stdout
