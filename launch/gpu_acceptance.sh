#!/usr/bin/env bash
# The GPU acceptance on one GPU node without network (docs/benchmarks.md, "GPU acceptance"): verl 0.9.1 and
# the project installed offline into $SITE, then `python -m recipe.bench gpu --acceptance` for FSDP2 and FSDP1
# in one call, acceptance.json and acceptance.md written to $OUT/gpu_acceptance/. Its exit code is the
# acceptance's: 0 every target met, 1 one missed or a run failed, 3 one unmeasured (see the docs).
#
# Prepare in the repo root on a machine with the shared folder and a pip (.gpu/ is git-ignored):
#   mkdir -p .gpu && cp /work/shared/gpu-node/* .gpu/ && pip wheel --no-deps -w .gpu .
# then on the GPU node (Python 3.12, CUDA torch 2.11), in the repo root:
#   bash launch/gpu_acceptance.sh [more acceptance options, e.g. --repeats 7 --search-seconds 90]
# Environment: OUT=outputs   SITE=/tmp/site (verl's wheels are installed there once; the project's each time)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-outputs}"
SITE="${SITE:-/tmp/site}"
fail() { echo "gpu_acceptance.sh: $*" >&2; exit 2; }
[[ -f .gpu/install.sh ]] || fail ".gpu/install.sh is missing: copy /work/shared/gpu-node/* into .gpu/ (see the header)"
compgen -G ".gpu/verl_divclip-*.whl" >/dev/null || fail "no project wheel in .gpu/: run 'pip wheel --no-deps -w .gpu .'"
[[ -d "$SITE/verl" ]] || bash .gpu/install.sh "$SITE"   # once per machine (a warm one keeps $SITE)
python3 -m pip install -q --no-deps --upgrade --target "$SITE" .gpu/verl_divclip-*.whl
export PYTHONPATH="$SITE:$PWD"
python3 -m recipe.bench gpu --acceptance --strategies fsdp2,fsdp --out "$OUT/gpu_acceptance" "$@"
