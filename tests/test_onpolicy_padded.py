"""The on-policy invariant on verl's padded path (``actor_rollout_ref.model.use_remove_padding=false``).

tests/test_onpolicy.py runs every mode and packing with remove-padding (verl's default). Here the same
engine-level check runs with the padding kept: verl's ``TrainingWorker`` on the CPU platform, verl's
default bf16, dynamic batching with the log-prob pass at 2:1 and 3:1 of the update's token budget (and
fixed micro-batches of different sizes), the old-log-prob pass packed as the update's first epoch
(``policy_loss.pack_old_log_prob_as_update``, the default), learning rate 0 so every first-epoch
mini-batch is on-policy:

* every first-epoch update micro-batch is one the old pass computed (the recorded packings: what the code
  guarantees), ``actor/divclip/path/pack_old_log_prob_as_update`` is 1, and the gauge, ``ppo_kl``, the clip fraction
  and ERC's mask read exactly 0;
* the control: the same packings with verl's own packing of the old pass
  (``pack_old_log_prob_as_update=false``): the passes' micro-batches differ, the path reads 0, and the
  gauge reads > 0 on at least one packing (the kernels' noise the alignment removes; which packings show it
  depends on the machine's kernels, so the claim is: at least one).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from recipe.bench.harness import TinyQwen3Spec, WorkerOptions, build_actor_worker, make_rollout_batch, save_tiny_qwen3
from tests.helpers import run_ranks
from tests.test_onpolicy import (
    GAUGE,
    MODES,
    PROMPT_LENS,
    RESPONSE_LENS,
    assert_exactly_on_policy,
    first_epoch_mini_batches_of,
    on_policy_case,
    token_groups,
    worker_options,
)
from tests.test_onpolicy import (
    PACKINGS as REMOVE_PADDING_PACKINGS,
)
from verl_ext.engine.packing import first_epoch_mini_batches

PADDED_MODES = ("kl3", "erc", "gspo", "erc+vocab_pass")
PACKINGS = {
    name: REMOVE_PADDING_PACKINGS[name]
    for name in (
        "dynamic 40/80, 2 shuffled mini-batches, 2 epochs",
        "dynamic 24/72, 1 mini-batch",
        "dynamic 64/128, 4 shuffled mini-batches",
        "fixed 2/4, 1 mini-batch",
    )
}


def padded_options(packing: dict[str, Any]) -> WorkerOptions:
    """tests/test_onpolicy.py's options for ``packing`` (bf16, lr 0) with ``use_remove_padding=False``."""
    return WorkerOptions(**{**worker_options(packing).__dict__, "use_remove_padding": False})


def job_padded(rank: int, world_size: int, model_path: str) -> list[dict[str, Any]]:
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=5)
    results = []
    for packing_name, packing in PACKINGS.items():
        worker = build_actor_worker(model_path, padded_options(packing))
        assert worker.engine.model_config.use_remove_padding is False  # the padded path is the one that runs
        for mode in PADDED_MODES:
            results.append(
                {"packing": packing_name, "mode": mode, **on_policy_case(worker, batch, MODES[mode], packing)}
            )
        control = on_policy_case(worker, batch, MODES["kl3"], packing, aligned=False)
        results.append({"packing": packing_name, "mode": "kl3, verl's packing", **control})
    return results


@pytest.fixture(scope="module")
def padded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    # the confident model of tests/test_onpolicy.py: one bf16 ulp of a logit is far outside every clip band
    model = save_tiny_qwen3(
        Path(tmp_path_factory.mktemp("tiny_qwen3_padded")), TinyQwen3Spec(), seed=0, head_scale=1000.0
    )
    return run_ranks(job_padded, 1, model)[0]


def case(results: list[dict[str, Any]], packing: str, mode: str) -> dict[str, Any]:
    return next(r for r in results if r["packing"] == packing and r["mode"] == mode)


@pytest.mark.parametrize("mode", PADDED_MODES)
@pytest.mark.parametrize("packing", list(PACKINGS))
def test_the_padded_path_is_exactly_on_policy_with_the_aligned_packing(
    padded: list[dict[str, Any]], packing: str, mode: str
) -> None:
    result = case(padded, packing, mode)
    spec = PACKINGS[packing]
    groups = [
        g.tolist()
        for g in first_epoch_mini_batches(len(PROMPT_LENS), spec["mini_batch"], 11, spec.get("shuffle", False))
    ]
    # the old pass ran once per first-epoch update mini-batch, and each update micro-batch is one it computed
    assert len(result["old_calls"]) == len(groups), (result["old_calls"], groups)
    update_groups = token_groups(result["new_calls"][: len(groups)], groups)
    assert update_groups and update_groups == token_groups(result["old_calls"], groups), result
    assert_exactly_on_policy(
        result, MODES[mode], first_epoch_mini_batches_of(spec)
    )  # gauge 0, path/pack_old_log_prob_as_update 1


def test_the_padded_paths_control_is_verls_packing_and_shows_the_noise(padded: list[dict[str, Any]]) -> None:
    """With ``pack_old_log_prob_as_update=false`` the padded path's passes pack differently, the update finds no
    pack_old_log_prob_as_update, and the kernels' noise reaches the gauge in at least one packing; the aligned kl3
    arm of the same packings reads exactly 0 (the test above)."""
    noisy = {}
    for packing in PACKINGS:
        control = case(padded, packing, "kl3, verl's packing")
        old_sizes = sorted(len(micro) for call in control["old_calls"] for micro in call)
        new_sizes = sorted(len(micro) for call in control["new_calls"] for micro in call)
        assert old_sizes != new_sizes or len(control["old_calls"]) != len(control["new_calls"]), control
        m = control["metrics"]
        assert set(m["actor/divclip/path/pack_old_log_prob_as_update"]) == {0.0}, m
        assert math.isfinite(m[GAUGE + "log_ratio_abs_max"][0])
        noisy[packing] = m[GAUGE + "log_ratio_abs_max"][0]
        assert case(padded, packing, "kl3")["metrics"][GAUGE + "log_ratio_abs_max"] == [0.0]
    assert max(noisy.values()) > 0, noisy
