""".ci/run's control flow, on a stand-in checkout: its own copy of the script, with stand-ins for the two environment
builds, ruff and the test command. The vLLM build runs in the background; whichever step ends the run -- a failed
``.venv`` build, a lint finding, a failing or a passing suite -- the exit status says so and no build is left behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: each step's stand-in: what it does when told to pass (the vLLM build sleeps, long enough to outlive an early end)
STEPS = {
    "launch/setup_vllm_venv.sh": 'echo $$ > "$MARKS/vllm.pid"; sleep "$VLLM_BUILD_S"; echo built > "$MARKS/vllm.done"',
    # (once the vLLM build is surely running: it starts first, in the background)
    "launch/setup_venv.sh": 'until [ -s "$MARKS/vllm.pid" ]; do sleep 0.05; done; echo venv >> "$MARKS/order"; '
    'exit "${FAIL_VENV:-0}"',
    ".venv/bin/ruff": 'echo "ruff $1" >> "$MARKS/order"; [ "$1" != "${FAIL_RUFF:-none}" ]',
    "tests/run.sh": 'echo "tests $DIVCLIP_REQUIRE_VLLM $DIVCLIP_VLLM_SETUP_STATUS" >> "$MARKS/order"; '
    'exit "${FAIL_TESTS:-0}"',
}

#: (environment, the run's exit status, the steps run in order, whether the vLLM build finishes)
ALL = ["venv", "ruff check", "ruff format", "tests"]
CASES = {
    "all pass": ({"VLLM_BUILD_S": "1"}, 0, ALL, True),
    "the suite fails": ({"VLLM_BUILD_S": "1", "FAIL_TESTS": "4"}, 4, ALL, True),
    "the .venv build fails": ({"VLLM_BUILD_S": "60", "FAIL_VENV": "3"}, 3, ALL[:1], False),
    "a lint finding": ({"VLLM_BUILD_S": "60", "FAIL_RUFF": "check"}, 1, ALL[:2], False),
    "a format finding": ({"VLLM_BUILD_S": "60", "FAIL_RUFF": "format"}, 1, ALL[:3], False),
}


def stand_in_checkout(folder: Path) -> Path:
    (folder / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", folder / ".ci" / "run")
    for path, body in STEPS.items():
        target = folder / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"#!/usr/bin/env bash\n{body}\n")
        target.chmod(0o755)
    return folder


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[-1][:3]


@pytest.mark.parametrize("case", list(CASES))
def test_ci_run_exits_with_the_failing_step_and_leaves_no_build_behind(tmp_path: Path, case: str) -> None:
    env_extra, status, order, finished = CASES[case]
    checkout, marks = stand_in_checkout(tmp_path / "repo"), tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "MARKS": str(marks), **env_extra}
    started = time.monotonic()
    proc = subprocess.run(["bash", ".ci/run"], cwd=checkout, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == status, proc.stderr[-2000:]
    steps = (marks / "order").read_text().splitlines()
    assert [line.split()[0] if line.startswith("tests") else line for line in steps] == order, steps
    if "tests" in order:  # the suite is told to require the vLLM lane and where the build's status appears
        assert steps[-1] == f"tests 1 {checkout / '.ci-vllm-setup.status'}"
        assert (checkout / ".ci-vllm-setup.status").read_text().strip() == "0"  # the run waited for the build
    build = int((marks / "vllm.pid").read_text())
    deadline = time.monotonic() + 10
    while alive(build) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(build), f"{case}: the vLLM build (pid {build}) outlived .ci/run"
    assert (marks / "vllm.done").exists() == finished
    if not finished:  # ended with the run, not after its 60 s
        assert time.monotonic() - started < 30
