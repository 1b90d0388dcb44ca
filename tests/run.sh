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
# The project's own modules byte-compiled once, up front: where PYTHONDONTWRITEBYTECODE is set (the development
# machine sets it) no process writes them, and each of the suite's few hundred processes (Ray workers, ranks,
# dry runs) would compile what it imports of them again. (pip compiled the installed packages.)
"$root/.venv/bin/python" -m compileall -q -j 0 recipe verl_ext data_prep tests > /dev/null
# libgomp's threads (torch's OpenMP pool) spin between parallel regions by default; with two lanes of a few
# processes each on 2 cores, the spinning takes the CPU from the other lane. PASSIVE makes them sleep instead: the
# thread count, and so every result, stays as given (tests/test_old_pass_skip.py alone: 116 -> 94 CPU seconds).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
set +e
# --durations: the slowest setups and calls end the output, so a slow run says where its time went
"$root/.venv/bin/python" -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=25 "$@"
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure here, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit "$rc"
