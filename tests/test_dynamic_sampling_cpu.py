"""The released-script profile's training-side mechanics in verl 0.9.1's real v1 trainer, on CPU
(`launch/run_smoke_cpu.sh`: local Ray, FSDP2, hf_cpu rollouts, our reward): dynamic sampling on the
reward's `acc` (algorithm.filter_groups), the +1 / -1 reward, and the micro-batch-normalised NLL
on correct responses with dual-clip 10. The smoke's tiny model writes no `</think>`, so the think
rule stays off here (with it every response would score -0.5 and no group would ever be kept)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.test_smoke_cpu import SMOKE_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
BATCH, ROLLOUT_N, STEPS = 16, 8, 1


@pytest.fixture(scope="module")
def released_smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smoke_released")
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SMOKE_OUT": str(out),
        "LOSS": "erc_dapo",
        "STEPS": str(STEPS),
        "BATCH": str(BATCH),
        "ROLLOUT_N": str(ROLLOUT_N),
        "TEST_FREQ": "100",
        "SAVE_FREQ": "100",
    }
    env.pop("RAY_ADDRESS", None)
    overrides = [
        "trainer.val_before_train=False",
        f"trainer.rollout_data_dir={out / 'rollouts'}",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_inflight_gen_batches=2",
        "+reward.custom_reward_function.reward_kwargs.wrong_score=-1.0",
        "actor_rollout_ref.actor.policy_loss.dual_clip_c=10.0",
        "actor_rollout_ref.actor.policy_loss.correct_nll_coef=0.1",
        "actor_rollout_ref.actor.policy_loss.correct_nll_norm=micro_batch",
    ]
    proc = subprocess.run(
        ["bash", str(ROOT / "launch/run_smoke_cpu.sh"), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_every_trained_group_has_mixed_results(released_smoke: Path) -> None:
    for step in range(1, STEPS + 1):
        rows = [json.loads(line) for line in (released_smoke / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        groups: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            groups[row["uid"].split("_")[0]].append(row["score"])
        assert len(groups) == BATCH and all(len(scores) == ROLLOUT_N for scores in groups.values()), step
        for scores in groups.values():
            assert set(scores) == {1.0, -1.0}, (step, scores)  # +1 / -1 reward, never all alike


def test_filtering_dropped_groups_and_the_nll_ran(released_smoke: Path) -> None:
    metrics = {
        json.loads(line)["step"]: json.loads(line)["data"]
        for line in (released_smoke / "metrics.jsonl").read_text().splitlines()
    }
    assert set(range(1, STEPS + 1)) <= set(metrics)
    for step in range(1, STEPS + 1):
        data = metrics[step]
        assert data["training/filter_groups/evicted_samples"] > 0  # uniform groups occurred and were replaced
        assert data["actor/divclip/correct_nll"] > 0 and 0 < data["actor/divclip/correct_fraction"] < 1
        assert "actor/divclip/erc/ratio_mean" in data
        # dynamic sampling refilled the batch, the old-log-prob pass still packed as the update: ERC on-policy exact
        assert data["actor/divclip/onpolicy/erc_masked_frac"] == 0.0
        assert data["actor/divclip/onpolicy/erc_ratio_dev_max"] <= 0.01
