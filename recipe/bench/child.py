"""Run one benchmark variant in a fresh Python process (so that peak memory and compiled caches do not leak
between variants) and read back its figures: the last stdout line that is one JSON object. Also the parents'
shared command-line handling (:func:`subset`, :func:`forwarded`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[2]
"""The directory this ``recipe`` package was imported from: the checkout's root, or site-packages
for an installed wheel (``tests/test_installed_wheel.py`` runs the probes from one)."""


@dataclass(frozen=True)
class ChildRun:
    returncode: int
    result: Optional[dict[str, Any]]  #: the last JSON object the child printed, None if none
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.result is not None

    def last_error_line(self) -> list[str]:
        return self.stderr.strip().splitlines()[-1:]


def run_child(module: str, argv: list[str], env: Optional[dict[str, str]] = None) -> ChildRun:
    """``python -m module *argv`` in :data:`ROOT`, first on ``PYTHONPATH`` so that the child imports the very
    ``verl_ext`` and ``recipe`` its parent runs, with ``env`` added to the environment."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=full_env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return ChildRun(proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr)


def child_result(module: str, argv: list[str], name: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """:func:`run_child`'s figures, or a ``RuntimeError`` naming the run (``name``: "variant a_no_entropy"),
    the child's stderr's tail printed first."""
    child = run_child(module, argv, env)
    if not child.ok:
        sys.stderr.write(child.stderr[-4000:])
        raise RuntimeError(f"{name} failed with exit code {child.returncode}")
    return child.result


def subset(
    parser: argparse.ArgumentParser, option: str, value: str, choices: Iterable[str], allow_none: bool = False
) -> list[str]:
    """The names of ``option``'s comma-separated ``value``, in order; a name not in ``choices``, or none
    unless ``allow_none``, exits through ``parser.error`` (code 2) naming the choices."""
    names, choices = [name for name in value.split(",") if name], list(choices)
    unknown = sorted(set(names) - set(choices))
    if unknown or not (names or allow_none):
        parser.error(f"{option}: {f'unknown {unknown}' if unknown else 'none given'}; choose from {choices}")
    return names


def forwarded(args: argparse.Namespace, *options: str) -> list[str]:
    """The arguments that hand a child ``options`` (``--name``) as the parent parsed them: ``--name value``,
    or a flag alone where it is set (an unset flag and a ``None`` value are left out)."""
    argv: list[str] = []
    for option in options:
        value = getattr(args, option[2:].replace("-", "_"))
        if value is True:
            argv.append(option)
        elif value is not False and value is not None:
            argv += [option, str(value)]
    return argv


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the given ``--name value`` (or ``--name=value``) options: the parent's, not its children's."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(f"{name}=") for name in names):
            out.append(arg)
    return out


# ------------------------------------------------------------------------------------------------
# Host-memory benchmarks (entropy-memory, full-kl): children whose RSS tracks live memory
# ------------------------------------------------------------------------------------------------

LIVE_RSS_ENV: tuple[tuple[str, str], ...] = (("MALLOC_MMAP_THRESHOLD_", str(64 << 10)), ("MALLOC_ARENA_MAX", "2"))
"""glibc settings of a memory benchmark's child (a value already in the environment wins): mmap for every
allocation over 64 KiB returns it on free, so the RSS peak tracks live memory (docs/benchmarks.md)."""


MICRO_BATCH_OPTIONS = ("--tokens", "--vocab", "--hidden", "--sequences")
"""The options a memory benchmark's child gets for its micro-batch and tiny model
(``recipe.bench.harness.bench_micro_batch``)."""


def add_micro_batch_options(parser: argparse.ArgumentParser) -> None:
    """:data:`MICRO_BATCH_OPTIONS` with the memory benchmarks' defaults."""
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the update's micro-batch")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size (Qwen: 151936)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny model")
    parser.add_argument("--sequences", type=int, default=4, help="sequences the tokens are split into")


def run_memory_child(module: str, variant: str, args: argparse.Namespace, *options: str) -> dict[str, Any]:
    """:func:`child_result` of ``module --_child variant`` under :data:`LIVE_RSS_ENV`, handed the parent's
    :data:`MICRO_BATCH_OPTIONS` and ``options`` (:func:`forwarded`)."""
    argv = ["--_child", variant, *forwarded(args, *MICRO_BATCH_OPTIONS, *options)]
    env = {key: os.environ.get(key, default) for key, default in LIVE_RSS_ENV}
    return child_result(module, argv, f"variant {variant}", env)


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def gib(n: int) -> float:
    return round(n / 2**30, 3)
