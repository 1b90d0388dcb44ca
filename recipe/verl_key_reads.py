"""The verl config keys the product's code reads, as recorded during the suite's trainer and engine runs.

``python -m recipe.verl_key_reads`` runs :data:`RECORD_TESTS` with ``DIVCLIP_RECORD_KEYS`` set (every process
records, :mod:`verl_ext.core.key_reads`) and writes each read key with the modules that read it to
:data:`READ_KEYS_PATH`; :mod:`recipe.verl_keys` gives every recorded key its row; a key no run recorded is verl's alone.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

from recipe.verl_key_checks import is_divclip_key
from verl_ext.core.key_reads import RECORD_ENV, read_records

ROOT = Path(__file__).resolve().parents[1]
READ_KEYS_PATH = Path(__file__).resolve().with_name("verl_keys_read.json")
COMMAND = "python -m recipe.verl_key_reads"

#: The runs recorded: verl's trainer end to end (every trainer mode, ERC-DAPO, kl_full through the vocabulary
#: pass, a resume), the actor engine with the seam (every loss mode, ERC, LoRA, fused kernels, the critic,
#: the top-k and the vocabulary pass), and the config checks over every mode and refusal.
RECORD_TESTS = (
    "tests/test_recipe_main.py",
    "tests/test_validation_length.py",
    "tests/test_actor_loss_engine.py",
    "tests/test_full_kl_engine.py",
    "tests/test_vocab_pass_engine.py",
    "tests/test_verl_features_engine.py",
    "tests/test_smoke_cpu.py",
    "tests/test_trainer_modes_cpu.py",
)


#: The name the tests that compare a recorded run with the committed record share (left out while recording).
RECORD_CHECKS = "reads_only_recorded_keys"


def record(tests: tuple[str, ...] = RECORD_TESTS) -> dict[str, list[str]]:
    """Run ``tests`` with the recorder on (records under a fresh folder): ``key -> the product modules that
    read it``, verl keys and the project's alike. Raises if the tests fail."""
    with tempfile.TemporaryDirectory(prefix="divclip_keys_") as scratch:
        env = {**os.environ, RECORD_ENV: scratch}
        env.pop("RAY_ADDRESS", None)
        # the tests comparing a run's reads with the committed record are left out: that record is being made
        options = ("-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-k", f"not {RECORD_CHECKS}")
        proc = subprocess.run([sys.executable, "-m", "pytest", *options, *tests], cwd=ROOT, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the recorded tests failed (pytest exit {proc.returncode}): nothing written")
        return {key: sorted(modules) for key, modules in sorted(read_records(Path(scratch)).items())}


@lru_cache(maxsize=1)
def read_keys() -> dict[str, tuple[str, ...]]:
    """The committed record: each verl key the product reads -> the product modules that read it."""
    data = json.loads(READ_KEYS_PATH.read_text())
    return {key: tuple(modules) for key, modules in data["keys"].items()}


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m recipe.verl_key_reads [tests...]``: record and write :data:`READ_KEYS_PATH`."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument(
        "tests", nargs="*", default=list(RECORD_TESTS), help="test files to run (default: RECORD_TESTS)"
    )
    parser.add_argument(
        "--from-dir",
        type=Path,
        default=None,
        help="write what an earlier run recorded in this folder (with DIVCLIP_RECORD_KEYS=<folder>) "
        "instead of running the tests",
    )
    args = parser.parse_args(argv)
    if args.from_dir is not None:
        recorded = {key: sorted(modules) for key, modules in sorted(read_records(args.from_dir).items())}
    else:
        recorded = record(tuple(args.tests))
    keys = {key: modules for key, modules in recorded.items() if not is_divclip_key(key)}
    READ_KEYS_PATH.write_text(
        json.dumps(
            {"command": COMMAND, "date": datetime.date.today().isoformat(), "tests": list(args.tests), "keys": keys},
            indent=1,
        )
        + "\n"
    )
    print(
        f"{len(keys)} verl keys read by the product ({len(recorded) - len(keys)} of the project's own left out): "
        f"{READ_KEYS_PATH}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
