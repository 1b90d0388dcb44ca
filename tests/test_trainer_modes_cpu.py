"""verl's asynchronous trainer modes with the divclip rules, end to end on CPU (`launch/run_smoke_cpu.sh`: verl's
real v1 trainer, local Ray, FSDP2, hf_cpu rollouts with partial rollout, our reward).

Per mode -- ``colocate_async`` (trainer and rollout share the device slot; generation aborted at each step's
end and resumed on the new weights) and ``separate_async`` (a standalone rollout pool on its own slot, weights
sent over the ``cpu_gloo`` checkpoint engine, two updates per weight sync: verl's Decoupled PPO) -- one run
trains ERC-DAPO for two steps, validates and writes a checkpoint; a second run resumes from it and trains kl3
for two more steps (a resume restores the model, the optimizer, the dataloader and TransferQueue's prompt
groups; the loss is configuration, so the resumed segment is where the second rule runs) and validates again.
Both are trained as GPU users run verl (tests/test_smoke_cpu.py, ``GPU_PACKING``). The ``separate_async`` runs
also turn on verl's rollout correction: token-level IS weights masked outside an IcePop-style band and
token-level KL3 rejection sampling; the ``colocate_async`` runs validate each benchmark at its own response
length and sample count (recipe/validation/length.py). The resumed ``colocate_async`` segment runs kl3 in
``bypass_mode`` (pi_old := mu, the rollout's log-probs: a trust region around the behaviour policy), which needs
verl's own packing and marks no update on-policy.

Asserted on every step: a finite loss; the on-policy gauge exactly 0 on the step's first update (the one that
starts from pi_old) with the packing the update found aligned -- in bypass mode no gauge, nothing aligned, and
mu and pi_old one and the same; mu against pi_old (``actor/divclip/staleness/*``); verl's version lag of the
trained samples (``trajectory_staleness_worst``) equal to the lag the test derives from the data trace alone
(the step each prompt was fetched, or re-issued at the resume, against the step it was trained); the rule of
each segment. Across the resume, from the data trace: no prompt is trained twice, every prompt the first run
fetched and did not train was taken back from TransferQueue by the second and trained by it, and the two runs
together fetched the epoch's first prompts in verl's sampler order, none skipped.
With rollout correction the weights reach the loss (``actor/divclip/rollout_is_weight_mean`` away
from 1); tests/test_rollout_correction.py shows they change the gradient as verl's own loss applies them.

``policy_loss.old_log_prob_from_update`` (the old-log-prob pass skipped for the first mini-batch, whose pi_old the
update's own first forward supplies) in ``colocate_async``: the first ``colocate_async`` run takes the skip (the
default where exact) and records each step's rollout batch (tests/rollout_replay.py); one more run of the same
first segment with ``old_log_prob_from_update=false`` trains on those recorded batches (two runs of the smoke never
sample alike, tests/rollout_replay.py says why) and logs every metric the step computes from its batch
bit-identically -- the update's (pg loss, clip fractions, ERC's masks, the on-policy gauge, grad_norm, ...), pi_old's
as verl logs it from the pass (``actor/entropy``, the rollout-vs-actor figures, ``rollout_corr/*``), the staleness
figures -- except, by rule (:func:`is_not_compared`), wall clock and memory, what the step logged before the
old-log-prob pass (the live rollout's, which the replay does not change) and validation (live generation, run
only by the first). The skip is taken in the first run and not in the second: the old pass left pi_old of the
first mini-batch's samples (half of them) as placeholders for the update to supply, and none in the second.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from recipe.bench.trainer_modes import MODE_ARGS
from tests.helpers import read_trace
from tests.rollout_replay import replay_env, steps_log
from tests.test_smoke_cpu import VAL_LENGTHS, assert_on_policy_exact, run_smoke, step_metrics, validation_length_args

ASYNC_MODES = ("colocate_async", "separate_async")  # their smoke arguments: MODE_ARGS, shared with the benchmark
BYPASS = [
    "algorithm.rollout_correction.bypass_mode=true",
    "actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=false",
]
ROLLOUT_CORRECTION = [
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold='0.5_2.0'",  # IcePop-style band: weights outside are cut
    "algorithm.rollout_correction.rollout_rs=token_k3",
    "algorithm.rollout_correction.rollout_rs_threshold=2.0",
]
FIRST, RESUMED = (1, 2), (3, 4)
SAMPLES, FIRST_MINI_BATCH = 16 * 8, 8 * 8  # BATCH x ROLLOUT_N; ppo_mini_batch_size = BATCH / 2, x ROLLOUT_N
SKIP_OFF = "actor_rollout_ref.actor.policy_loss.old_log_prob_from_update=false"
NOT_COMPARED_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/", "actor/perf/", "val-core/", "val-aux/")
#: what the with/without-skip comparison must include: the update's own figures and pi_old's as verl logs them
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
STALENESS = "actor/divclip/staleness/"
#: the step's mean share of update rows whose pi_old the update supplied: what the skip changes by design
SKIP_METRIC = "actor/divclip/path/old_log_prob_from_update"
WORST = "training/off_policy/trajectory_staleness_worst/"


@pytest.fixture(scope="module", params=ASYNC_MODES)
def resumed_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    mode = request.param
    out = tmp_path_factory.mktemp(f"smoke_{mode}")
    overrides, env = MODE_ARGS[mode]
    # separate_async: rollout correction; colocate_async: validation at each benchmark's own length and n
    mode_extras = ROLLOUT_CORRECTION if mode == "separate_async" else validation_length_args(out)
    overrides = [*overrides, "trainer.val_before_train=False", *mode_extras]
    # lr 2e-4: one step moves the policy by a few nats on some tokens, so a sample one version old is off by that
    # much -- IcePop's band masks a quarter of the tokens. (At the smoke's 5e-3 it masked ~95%, and a batch with
    # every token outside the band makes verl 0.9.1's effective-sample-size figure divide by zero.)
    env = {
        **env,
        "DATA_TRACE": str(out / "trace.jsonl"),
        "SAVE_FREQ": "2",
        "TEST_FREQ": "2",
        "RESPONSE_LEN": "8",
        "LR": "2e-4",
    }
    # colocate_async: the first segment records its rollout batches for the replay without the skip
    record = {}
    if mode == "colocate_async":
        (out / "rollouts").mkdir()
        record = replay_env(out / "rollouts", "record")
    run_smoke(out, "erc_dapo", FIRST[-1], *overrides, **env, **record)
    first_checkpoint = sorted(p.name for p in (out / "ckpt").iterdir() if p.name.startswith("global_step_"))
    resumed = [*overrides, *(BYPASS if mode == "colocate_async" else [])]
    run_smoke(out, "kl3", RESUMED[-1], *resumed, **env)
    return {
        "mode": mode,
        "out": out,
        "metrics": step_metrics(out),
        "first_checkpoint": first_checkpoint,
        "bypass": RESUMED if mode == "colocate_async" else (),
        "first_segment": (overrides, {k: v for k, v in env.items() if k != "DATA_TRACE"}),
    }


@pytest.fixture(scope="module")
def without_skip(resumed_run: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The first ``colocate_async`` segment again, on its recorded batches, with ``old_log_prob_from_update=false``
    (no checkpoint, no validation: neither changes a training step)."""
    assert resumed_run["mode"] == "colocate_async"
    out = tmp_path_factory.mktemp("colocate_async_without_skip")
    overrides, env = resumed_run["first_segment"]
    env = {**env, "SAVE_FREQ": "-1", "TEST_FREQ": "-1", **replay_env(resumed_run["out"] / "rollouts", "replay")}
    run_smoke(out, "erc_dapo", FIRST[-1], *overrides, SKIP_OFF, **env)
    return {"metrics": step_metrics(out), "steps": steps_log(resumed_run["out"] / "rollouts", "replay")}


def test_both_rules_train_validate_and_resume(resumed_run: dict[str, Any]) -> None:
    metrics, out = resumed_run["metrics"], resumed_run["out"]
    assert resumed_run["first_checkpoint"] == ["global_step_2"]
    assert set(FIRST + RESUMED) <= set(metrics)
    for step in FIRST + RESUMED:
        assert math.isfinite(metrics[step]["actor/pg_loss"]), step
    for step in FIRST:  # ERC-DAPO: clip-higher with ERC's entropy band
        assert "actor/divclip/erc/ratio_mean" in metrics[step] and metrics[step]["actor/divclip/erc/ratio_mean"] > 0
    for step in RESUMED:  # kl3 at delta 0.07 after the resume
        assert "actor/divclip/erc/ratio_mean" not in metrics[step]
        assert metrics[step]["actor/divclip/ratio_lower"] == pytest.approx(0.671, abs=1e-3)
    for step in (FIRST[-1], RESUMED[-1]):  # validation every second step, in each run
        assert any(key.startswith("val-core/") for key in metrics[step]), step
        if resumed_run["mode"] == "colocate_async":  # each benchmark at its own length and sample count
            for source, (length, n) in VAL_LENGTHS.items():
                assert metrics[step][f"val-aux/{source}/response_length/limit"] == length
                assert f"val-core/{source}/acc/mean@{n}" in metrics[step]
    attempts = sorted((out / "logs").glob("*.jsonl"))
    assert len(attempts) == 2
    resumed_steps = [json.loads(line)["step"] for line in attempts[1].read_text().splitlines()]
    assert min(resumed_steps) == RESUMED[0]  # the second run continued from the checkpoint, not from scratch


def test_every_step_starts_exactly_on_policy_and_reports_its_staleness(resumed_run: dict[str, Any]) -> None:
    metrics = resumed_run["metrics"]
    lags = lags_from_the_trace(resumed_run["out"] / "trace.jsonl")
    for step in FIRST + RESUMED:
        data = metrics[step]
        # verl's lag of the samples trained (from the versions its rollout stamped on them) is the lag the test's
        # own bookkeeping gives each prompt: the step it was fetched or re-issued at against the step it trained at
        assert data[WORST + "mean"] == pytest.approx(statistics.fmean(lags[step]), abs=1e-9), (step, lags[step])
        assert (data[WORST + "min"], data[WORST + "max"]) == (min(lags[step]), max(lags[step])), (step, lags[step])
        # the skip is taken in colocate_async's first segment only (separate_async and the bypass block it)
        taken = resumed_run["mode"] == "colocate_async" and step in FIRST
        assert (data[SKIP_METRIC] > 0) == taken, (step, data[SKIP_METRIC])
        if step in resumed_run["bypass"]:  # pi_old is mu: nothing to pack, no update starts on-policy
            assert not any(key.startswith("actor/divclip/onpolicy/") for key in data)
            assert data["actor/divclip/path/pack_old_log_prob_as_update"] == 0.0
            assert data[STALENESS + "behaviour_kl3_mean"] == data[STALENESS + "behaviour_log_ratio_abs_max"] == 0.0
            continue
        assert_on_policy_exact(data, erc=step in FIRST)
        # mu and pi_old differ (rollout numerics, and the versions in between): k3 is > 0 wherever they do
        assert data[STALENESS + "behaviour_kl3_mean"] > 0 and data[STALENESS + "behaviour_log_ratio_abs_max"] > 0
    assert max(max(lags[step]) for step in FIRST + RESUMED) >= 1  # samples of older policies were trained


def lags_from_the_trace(path: Path) -> dict[int, list[int]]:
    """Per training step t, for each prompt it trained, t - 1 - v: pi_old's weight version less v, the version the
    rollout held when the prompt's generation started, from the test's own bookkeeping in the data trace. A prompt
    fetched at step s starts with version s - 1 (the weights of step s - 1's update); one restored from TransferQueue
    at the resume's step r keeps its first run's version if it had finished, and is generated anew with version r - 1
    (the resumed weights) if it was pending or running (verl re-issues those). Every prompt is trained with the same
    number of samples, so a mean over prompts is one over samples."""
    version: dict[tuple[Any, ...], int] = {}
    for line in read_trace(str(path), "fetched"):
        for prompt in line["prompts"]:
            version.setdefault(tuple(prompt), line["step"] - 1)
    for line in read_trace(str(path), "restored"):
        for prompt, status in zip(line["prompts"], line["status"], strict=True):
            if status in ("pending", "running"):
                version[tuple(prompt)] = line["step"] - 1
    trained = read_trace(str(path), "trained")
    assert len({line["samples"] / len(line["prompts"]) for line in trained}) == 1  # n samples per prompt, no padding
    lags: dict[int, list[int]] = {}
    for line in trained:
        lags.setdefault(line["step"], []).extend(line["step"] - 1 - version[tuple(p)] for p in line["prompts"])
    return lags


def test_no_prompt_is_trained_twice_and_none_is_skipped_across_the_resume(resumed_run: dict[str, Any]) -> None:
    path = str(resumed_run["out"] / "trace.jsonl")
    attempts = list(dict.fromkeys(line["attempt"] for line in read_trace(path, "fetched")))
    assert len(attempts) == 2

    def prompts(event: str, attempt: str) -> list[tuple[Any, ...]]:
        return [tuple(p) for line in read_trace(path, event) if line["attempt"] == attempt for p in line["prompts"]]

    fetched_first, trained_first = prompts("fetched", attempts[0]), prompts("trained", attempts[0])
    restored, fetched_second = prompts("restored", attempts[1]), prompts("fetched", attempts[1])
    trained_second = prompts("trained", attempts[1])
    assert restored  # the first run's checkpoint held fetched, untrained prompt groups
    trained = trained_first + trained_second
    assert trained and max(Counter(trained).values()) == 1  # within the epoch: nothing trained twice
    assert len(set(fetched_first)) == len(fetched_first) and not set(fetched_first) & set(fetched_second)
    assert set(trained_first) <= set(fetched_first)
    # what the first run held untrained at its checkpoint (the run ended there) came back, and nothing else
    assert Counter(restored) == Counter(fetched_first) - Counter(trained_first)
    assert set(trained_second) <= set(restored) | set(fetched_second)
    assert set(restored) <= set(trained_second)  # and the resumed run trained every one of them
    assert {line["step"] for line in read_trace(path)} == set(FIRST + RESUMED)
    # none skipped by the resumed dataloader: the two attempts fetched the sampler's first prompts of the epoch
    fetched = [index for index, _ in fetched_first + fetched_second]
    order = epoch_order(resumed_run["out"] / "assets" / "data" / "train.parquet")
    assert len(fetched) <= len(order) and sorted(fetched) == sorted(order[: len(fetched)])


def epoch_order(train_file: Path) -> list[int]:
    """The training prompts' dataset indices in the order verl's dataloader yields them in the first epoch: verl's
    own ``create_rl_sampler`` over the smoke's train file, with the data config recipe.main composes (the smoke
    leaves ``data.shuffle`` / ``data.seed`` at their defaults: shuffled, by torch's default generator seed)."""
    import pyarrow.parquet as pq
    from verl.trainer.ppo.utils import create_rl_sampler

    from tests.test_recipe_main import compose_config

    indices = [
        row["index"] for row in pq.read_table(train_file, columns=["extra_info"]).column("extra_info").to_pylist()
    ]
    assert len(set(indices)) == len(indices)  # an index names one prompt
    return [indices[position] for position in create_rl_sampler(compose_config().data, indices)]


def test_rollout_correction_weights_reach_the_loss(resumed_run: dict[str, Any]) -> None:
    metrics = resumed_run["metrics"]
    if resumed_run["mode"] != "separate_async":
        assert all("rollout_corr/rollout_is_mean" not in metrics[step] for step in FIRST + RESUMED)
        assert all("actor/divclip/rollout_is_weight_mean" not in metrics[step] for step in FIRST + RESUMED)
        return
    for step in FIRST + RESUMED:
        data = metrics[step]
        assert "rollout_corr/rollout_is_mean" in data and "rollout_corr/rollout_rs_masked_fraction" in data
        assert 0 < data["actor/divclip/rollout_is_weight_mean"] <= 2.0  # IcePop: weights outside [0.5, 2] are 0
    assert any(metrics[step]["actor/divclip/rollout_is_weight_mean"] != 1.0 for step in FIRST + RESUMED)


def is_not_compared(key: str, before_old_pass: set[str]) -> bool:
    """Wall clock, throughput and memory (``timing_s/``, ``timing_per_token_ms/``, ``perf/``, ``actor/perf/``),
    validation (``val-core/``, ``val-aux/``: live generation, in the recording run only), and the metrics the step had
    before its old-log-prob pass (the live rollout's: the replay does not change them)."""
    return key.startswith(NOT_COMPARED_PREFIXES) or key in before_old_pass


@pytest.mark.parametrize("resumed_run", ["colocate_async"], indirect=True)
def test_colocate_async_logs_the_same_step_with_and_without_the_skip(
    resumed_run: dict[str, Any], without_skip: dict[str, Any]
) -> None:
    with_skip = {"metrics": resumed_run["metrics"], "steps": steps_log(resumed_run["out"] / "rollouts", "record")}
    for step in FIRST:
        before = set(with_skip["steps"][step]["before_old_pass"])
        assert before == set(without_skip["steps"][step]["before_old_pass"]), step
        a, b = with_skip["metrics"][step], without_skip["metrics"][step]
        compared = {k for k in a if not is_not_compared(k, before)}
        assert compared == {k for k in b if not is_not_compared(k, before)}, step
        assert set(COMPUTED) <= compared, set(COMPUTED) - compared
        assert all(math.isfinite(a[k]) for k in COMPUTED), step
        assert 0 < a[SKIP_METRIC] < 1 and b[SKIP_METRIC] == 0.0, step  # the first of two mini-batches, with the skip
        differing = {k: (a[k], b[k]) for k in sorted(compared - {SKIP_METRIC}) if repr(a[k]) != repr(b[k])}
        assert not differing, (step, differing)


@pytest.mark.parametrize("resumed_run", ["colocate_async"], indirect=True)
def test_the_old_pass_skipped_the_first_mini_batch_only_with_the_skip(
    resumed_run: dict[str, Any], without_skip: dict[str, Any]
) -> None:
    recorded = steps_log(resumed_run["out"] / "rollouts", "record")
    assert sorted(recorded) == list(FIRST)  # the resumed segment ran without the recorder
    for step in FIRST:
        assert recorded[step]["placeholders"] == FIRST_MINI_BATCH < SAMPLES, step
        assert without_skip["steps"][step]["placeholders"] == 0, step
