"""Run one benchmark variant in a fresh Python process and read back its figures.

A fresh process per variant keeps peak-memory figures (RSS, ``torch.cuda.max_memory_allocated``) and
compiled caches from leaking between variants. The child prints its result as one JSON object on a
line of its own (the last such line counts); everything else on stdout/stderr is ignored.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    """``python -m module *argv`` in :data:`ROOT`, with :data:`ROOT` first on ``PYTHONPATH`` (so the
    child imports the very ``verl_ext`` and ``recipe`` its parent runs, from a checkout as from an
    installed wheel) and ``env`` added to the environment."""
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=full_env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return ChildRun(proc.returncode, json.loads(lines[-1]) if lines else None, proc.stderr)
