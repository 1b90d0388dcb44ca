"""``policy_loss.old_log_prob_from_update`` in verl's ``colocate_async`` trainer mode, end to end on CPU: with and
without the skip, every metric a step computes from its batch is bit-identical.

Two ERC-DAPO runs of the CPU smoke (`launch/run_smoke_cpu.sh`, trained as GPU users run verl: bf16, dynamic batching,
shuffled mini-batches, two a step; tests/test_smoke_cpu.py's ``GPU_PACKING``) in ``colocate_async`` for two steps:
the first with the skip (the default where exact), the second with ``old_log_prob_from_update=false``.

Two runs of the smoke never train on the same samples (measured on this machine: even with no warm-up batch, the
same prompts got different responses; tests/rollout_replay.py says why), so the second run trains on the first
run's rollouts: its TaskRunner puts each step's recorded batch back into TransferQueue before the old-log-prob pass.
From there on the runs compute the same things from the same batch and weights. Asserted per step:

* every logged metric is bit-identical -- the update's (pg loss, clip fractions, ERC's masks, the on-policy gauge,
  grad_norm, ...), pi_old's as verl logs it from the pass (``actor/entropy``, the rollout-vs-actor figures,
  ``rollout_corr/*``), the staleness figures and the batch's -- except, by rule (:func:`is_not_compared`), wall
  clock and memory figures and what the step logged before the old-log-prob pass (the live rollout's, which the
  replay does not change);
* the skip was taken in the first run and not in the second: the old pass left pi_old of the first mini-batch's
  samples (half of them) as placeholders for the update to supply, and none in the second.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from recipe.bench.trainer_modes import MODE_ARGS
from tests.rollout_replay import DIR_ENV, MODE_ENV
from tests.test_smoke_cpu import GPU_PACKING, ROOT, run_smoke, step_metrics

STEPS = (1, 2)
SAMPLES, FIRST_MINI_BATCH = 16 * 8, 8 * 8  # BATCH x ROLLOUT_N; ppo_mini_batch_size = BATCH / 2, x ROLLOUT_N
SKIP_OFF = "actor_rollout_ref.actor.policy_loss.old_log_prob_from_update=false"
MEASURED_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/")
#: what the comparison must include: the update's own figures and pi_old's as verl logs them
COMPUTED = (
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/entropy",
    "actor/divclip/erc/clipfrac_lower",
    "actor/divclip/erc/ratio_mean",
    "actor/divclip/onpolicy/log_ratio_abs_max",
    "actor/divclip/staleness/behaviour_kl3_mean",
    "rollout_corr/kl",
    "training/rollout_probs_diff_mean",
    "critic/advantages/mean",
)


def is_not_compared(key: str, before_old_pass: set[str]) -> bool:
    """Wall clock, throughput and memory (``timing_s/``, ``timing_per_token_ms/``, ``perf/``, ``actor/perf/``), and
    the metrics the step had before its old-log-prob pass (the live rollout's: the replay does not change them)."""
    return key.startswith(MEASURED_PREFIXES) or key in before_old_pass


def replay_env(folder: Path, mode: str) -> dict[str, str]:
    """``launch/run_smoke_cpu.sh``'s ``PYTHON`` as a wrapper that runs tests.rollout_replay for ``-m recipe.main``."""
    wrapper = folder / "python.sh"
    python = sys.executable
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == -m && "$2" == recipe.main ]]; then shift 2; exec {python} -m tests.rollout_replay "$@"; fi\n'
        f'exec {python} "$@"\n'
    )
    wrapper.chmod(0o755)
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHON": str(wrapper), DIR_ENV: str(folder), MODE_ENV: mode, "PYTHONPATH": python_path}


def steps_log(folder: Path, mode: str) -> dict[int, dict[str, Any]]:
    lines = [json.loads(line) for line in (folder / f"steps-{mode}.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines}


@pytest.fixture(scope="module")
def with_and_without(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    overrides, env = MODE_ARGS["colocate_async"]
    overrides = [*overrides, "trainer.val_before_train=False"]
    env = {**env, "SAVE_FREQ": "-1", "TEST_FREQ": "-1", "RESPONSE_LEN": "4"}
    assert GPU_PACKING["PRECISION"] == "bf16" and GPU_PACKING["DYNAMIC_BSZ"]  # run_smoke trains as GPU users do
    replay = tmp_path_factory.mktemp("rollouts")
    runs = {}
    for name, mode, extra in (("with", "record", []), ("without", "replay", [SKIP_OFF])):
        out = tmp_path_factory.mktemp(f"colocate_async_{name}_skip")
        run_smoke(out, "erc_dapo", STEPS[-1], *overrides, *extra, **env, **replay_env(replay, mode))
        runs[name] = {"metrics": step_metrics(out), "steps": steps_log(replay, mode)}
    return runs


def test_colocate_async_logs_the_same_step_with_and_without_the_skip(with_and_without: dict[str, Any]) -> None:
    with_skip, without = with_and_without["with"], with_and_without["without"]
    for step in STEPS:
        before = set(with_skip["steps"][step]["before_old_pass"])
        assert before == set(without["steps"][step]["before_old_pass"]), step
        a, b = with_skip["metrics"][step], without["metrics"][step]
        compared = {k for k in a if not is_not_compared(k, before)}
        assert compared == {k for k in b if not is_not_compared(k, before)}, step
        assert set(COMPUTED) <= compared, set(COMPUTED) - compared
        assert all(math.isfinite(a[k]) for k in COMPUTED), step
        differing = {k: (a[k], b[k]) for k in sorted(compared) if repr(a[k]) != repr(b[k])}
        assert not differing, (step, differing)


def test_the_old_pass_skipped_the_first_mini_batch_only_with_the_skip(with_and_without: dict[str, Any]) -> None:
    for step in STEPS:
        assert with_and_without["with"]["steps"][step]["placeholders"] == FIRST_MINI_BATCH < SAMPLES, step
        assert with_and_without["without"]["steps"][step]["placeholders"] == 0, step
