#!/usr/bin/env bash
# The project's test command: sets up .venv when missing, then runs the whole suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh -k kl3`).
# Two worker processes (TEST_WORKERS, default 2), each test file on one worker (its module fixtures run
# once): the end-to-end files spend half their time waiting on Ray, subprocesses and imports, so two
# lanes finish the suite in far less than one. tests/conftest.py starts the longest files first.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/setup_venv.sh"
cd "$root"
set +e
"$root/.venv/bin/python" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure here, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
