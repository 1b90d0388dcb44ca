"""pi_old from the update's own first forward (``policy_loss.old_log_prob_from_update``,
:mod:`verl_ext.engine.old_from_update`): the old-log-prob pass skipped where it would repeat that forward.

On verl's real actor worker (FSDP2, CPU), under verl's default bf16, with the old pass packed as the update:

* **Bit-identical with and without the skip**, in every loss mode of the on-policy tests (``kl_full`` and its
  diagnostic included: pi_old's top-k comes from the update's forward too), with dynamic batching at the
  configs' 2:1 budgets, shuffled mini-batches and two epochs; in the ATR shape (one mini-batch, two epochs) for
  a mode of each kind; and on two data-parallel ranks: the parameters after the step (SGD with
  clipping off, so every update is ``-lr * grad``: the gradients of every mini-batch), every logged update
  metric per mini-batch (clip fractions, ERC's masks, the gauge, grad_norm, ...) and the pi_old verl writes
  and logs ``actor/entropy`` from (the collected ``old_log_probs`` and ``entropy``, and pi_old's top-k).
* **The control**: taking pi_old from a mini-batch *after* an optimizer step (the second) changes the step.
* **What it saves**: old-pass rows per step -- none for the ATR shape, 7/8 of them for the ERC shape (8
  mini-batches).
* **Where it is not exact** the recipe refuses ``true`` before Ray, naming the key, and leaves the default
  (null) off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from recipe.bench.harness import (
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    full_params,
    make_rollout_batch,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import run_ranks, shard_for_rank
from tests.test_onpolicy import MODES, PACKINGS, PROMPT_LENS, RESPONSE_LENS, divclip_loss, worker_options
from verl_ext.engine.topk_capture import OLD_TOPK_IDS

SKIP_MODES = MODES
EVERY_MODE_PACKING = "dynamic 40/80, 2 shuffled mini-batches, 2 epochs"
ATR_SHAPE = "ATR shape: dynamic 24/72, 1 mini-batch, 2 epochs"
SKIP_PACKINGS: dict[str, dict[str, Any]] = {
    EVERY_MODE_PACKING: PACKINGS[EVERY_MODE_PACKING],
    ATR_SHAPE: dict(budgets=(24, 72), mini_batch=8, epochs=2),
}
#: a mode of each kind in the ATR shape: a constraint, ERC, pi_old's top-k (materialised and vocabulary pass),
#: verl's own
ATR_SHAPE_MODES = ["kl3", "erc", "kl_full", "kl_full+vocab_pass", "vanilla"]
TWO_RANK_PACKING = EVERY_MODE_PACKING
SGD = dict(optimizer="SGD", lr=0.05, clip_grad=1e9)  # every update is -lr * grad: parameters compare gradients
#: per update micro-batch, the share of its rows whose pi_old the update supplied: what differs by design
SKIP_METRIC = "actor/divclip/path/old_log_prob_from_update"


def is_measured_not_computed(name: str) -> bool:
    """Wall-clock and process-memory figures (``mfu``, ``perf/*``): not the step's numbers."""
    return name == "mfu" or name.startswith("perf/")


def skip_worker(model_path: str, packing: dict[str, Any]) -> Any:
    return build_actor_worker(model_path, WorkerOptions(**{**worker_options(packing).__dict__, **SGD}))


def step(worker: Any, batch: Any, mode: dict[str, Any], packing: dict[str, Any], skip: bool) -> dict[str, Any]:
    """One training step as ``DivClipTrainer`` runs it: the old pass (skipping the first mini-batch with
    ``skip``), the update, and with ``skip`` the collect; what verl writes and logs, and the update's metrics."""
    from verl_ext.engine.packing import UpdatePacking
    from verl_ext.engine.topk_capture import OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS, old_topk_request

    worker.set_loss_fn(divclip_loss(mode))
    info = UpdatePacking(mini_batch_size=packing["mini_batch"], seed=11, shuffle=packing.get("shuffle", False))
    k = old_topk_request(mode)  # kl_full / its diagnostic: the pass stores pi_old's top-k, as the trainer asks
    old = compute_log_prob(worker, batch, packing=info, old_topk=k, old_from_update=skip)
    # what the pass gives the update
    fields = ("old_log_probs", "entropy", *((OLD_TOPK_LOG_PROBS, OLD_TOPK_IDS) if k else ()))
    data = batch.clone()
    for key in fields:
        data[key] = old[key]
    metrics = update_actor(
        worker,
        data,
        calculate_entropy="erc_beta_low" in mode,
        mini_batch_size=packing["mini_batch"],
        epochs=packing.get("epochs", 1),
        shuffle=info.shuffle,
        seed=info.seed,
    )
    if skip:
        old = compute_log_prob(worker, batch, packing=info, old_topk=k, collect=True)
    return {
        **{key: old[key].values().clone() for key in fields},
        "from_update": [float(v) for v in metrics.pop(SKIP_METRIC)],
        "metrics": {
            k: [repr(float(v)) for v in vals]
            for k, vals in metrics.items()
            if isinstance(vals, list) and not is_measured_not_computed(k)
        },
    }


def job_with_and_without(
    rank: int, world_size: int, model_path: str, packing_name: str, modes: list[str], supplying_mini_batch: int = 0
) -> list[dict[str, Any]]:
    """Two workers from the same checkpoint run the same steps, one with the skip: every mode in turn (they stay
    in lockstep while the skip is exact), the parameters compared after each step."""
    import verl_ext.actor_loss  # noqa: F401  (installs the seam, as unpickling the loss does on a worker)
    import verl_ext.engine.old_from_update as old_from_update

    old_from_update.SUPPLYING_MINI_BATCH = supplying_mini_batch
    packing = SKIP_PACKINGS[packing_name]
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=5)
    if world_size > 1:
        batch = shard_for_rank(batch, rank, world_size)
    plain, skipping = skip_worker(model_path, packing), skip_worker(model_path, packing)
    results = []
    for name in modes:
        without = step(plain, batch, SKIP_MODES[name], packing, skip=False)
        with_skip = step(skipping, batch, SKIP_MODES[name], packing, skip=True)
        params = full_params(plain), full_params(skipping)
        results.append(
            {
                "mode": name,
                "without": without,
                "with": with_skip,
                "params_equal": all(torch.equal(params[0][n], params[1][n]) for n in params[0]),
                "params_moved": any(
                    not torch.equal(params[0][n], p) for n, p in full_params_initial(model_path).items()
                ),
            }
        )
    return results


_INITIAL: dict[str, dict[str, torch.Tensor]] = {}


def full_params_initial(model_path: str) -> dict[str, torch.Tensor]:
    """The checkpoint's parameters (names as the engine's), to show a step moved them."""
    if model_path not in _INITIAL:
        from safetensors.torch import load_file

        _INITIAL[model_path] = {name: t for name, t in load_file(str(Path(model_path) / "model.safetensors")).items()}
    return _INITIAL[model_path]


def assert_bit_identical(result: dict[str, Any]) -> None:
    """Everything equal but :data:`SKIP_METRIC`, which says the skip was taken (the first mini-batch's micro-batches
    read 1) only in the run with it."""
    without, with_skip = result["without"], result["with"]
    assert set(without["from_update"]) == {0.0} and max(with_skip["from_update"]) == 1.0, result["mode"]
    tensors = [key for key in without if key not in ("metrics", "from_update")]
    assert set(tensors) == {key for key in with_skip if key not in ("metrics", "from_update")}, result["mode"]
    for key in tensors:  # pi_old's log-probs, entropy and (kl_full) top-k: none a placeholder (NaN, id -1)
        assert torch.equal(without[key], with_skip[key]), (result["mode"], key)
        placeholder = with_skip[key] < 0 if key == OLD_TOPK_IDS else torch.isnan(with_skip[key])
        assert not placeholder.any(), (result["mode"], key)
    assert without["metrics"] == with_skip["metrics"], {
        k: (v, with_skip["metrics"].get(k)) for k, v in without["metrics"].items() if with_skip["metrics"].get(k) != v
    }
    assert result["params_equal"], f"{result['mode']}: the gradients differ"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_skip")), TinyQwen3Spec(), seed=0, head_scale=1000.0)


@pytest.fixture(scope="module")
def every_mode(model: str) -> list[dict[str, Any]]:
    return run_ranks(job_with_and_without, 1, model, EVERY_MODE_PACKING, list(SKIP_MODES))[0]


@pytest.fixture(scope="module")
def atr_shape(model: str) -> list[dict[str, Any]]:
    return run_ranks(job_with_and_without, 1, model, ATR_SHAPE, ATR_SHAPE_MODES)[0]


@pytest.mark.parametrize("mode", list(SKIP_MODES))
def test_the_skip_changes_nothing_in_any_mode(every_mode: list[dict[str, Any]], mode: str) -> None:
    (result,) = [r for r in every_mode if r["mode"] == mode]
    assert_bit_identical(result)
    assert min(result["with"]["from_update"]) == 0.0  # the second mini-batch's pi_old came from the pass


@pytest.mark.parametrize("mode", ATR_SHAPE_MODES)
def test_the_skip_changes_nothing_in_the_atr_shape(atr_shape: list[dict[str, Any]], mode: str) -> None:
    (result,) = [r for r in atr_shape if r["mode"] == mode]
    assert_bit_identical(result)
    assert set(result["with"]["from_update"]) == {1.0}  # one mini-batch: every row's pi_old from the update


def test_the_steps_moved_the_parameters(every_mode: list[dict[str, Any]], atr_shape: list[dict[str, Any]]) -> None:
    # the comparison is of real steps: the parameters left the checkpoint
    assert all(r["params_moved"] for r in every_mode + atr_shape)


def test_two_ranks_are_bit_identical_with_and_without_the_skip(model: str) -> None:
    ranks = run_ranks(job_with_and_without, 2, model, TWO_RANK_PACKING, ["kl3", "erc+vocab_pass", "kl_full", "gspo"])
    for results in ranks:
        for result in results:
            assert_bit_identical(result)


def test_the_control_a_mini_batch_after_an_optimizer_step_differs(model: str) -> None:
    """pi_old from the *second* mini-batch's forward (after the first optimizer step) is not pi_old: its ratios
    read 1 where they should not, so its gradients and clip decisions change -- the skip is exact only because
    the mini-batch it takes runs first."""
    (result,) = run_ranks(job_with_and_without, 1, model, TWO_RANK_PACKING, ["kl3"], 1)[0]
    assert not result["params_equal"]
    assert not torch.equal(result["without"]["old_log_probs"], result["with"]["old_log_probs"])
    differing = {k for k, v in result["without"]["metrics"].items() if result["with"]["metrics"].get(k) != v}
    assert "actor/ppo_kl" in differing and "grad_norm" in differing, differing


# ------------------------------------------------------------------------------------------------
# What the skip saves: old-pass forwards per step
# ------------------------------------------------------------------------------------------------


def job_old_pass_rows(rank: int, world_size: int, model_path: str, mini_batch: int, rows: int) -> dict[str, int]:
    """Rows the old pass runs through the model (forward-only steps) per step, with and without the skip."""
    import verl_ext.actor_loss  # noqa: F401

    packing = dict(budgets=(40, 80), mini_batch=mini_batch, shuffle=True, epochs=2)
    repeat = rows // len(PROMPT_LENS)
    batch = make_rollout_batch(PROMPT_LENS * repeat, RESPONSE_LENS * repeat, TinyQwen3Spec().vocab_size, seed=5)

    def rows_seen(skip: bool) -> dict[str, int]:
        worker = skip_worker(model_path, packing)
        engine = worker.engine
        seen = {"old": 0, "update": 0}
        forward_step = engine.forward_step

        def counting(micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            seen["old" if forward_only else "update"] += len(micro_batch)
            return forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)

        engine.forward_step = counting
        step(worker, batch, SKIP_MODES["kl3"], packing, skip)
        return seen

    counts = {}
    for skip in (False, True):
        seen = rows_seen(skip)
        counts[f"old_rows_{'with' if skip else 'without'}_skip"] = seen["old"]
        counts[f"update_rows_{'with' if skip else 'without'}_skip"] = seen["update"]
    return counts


def test_the_atr_shape_runs_no_old_pass(model: str) -> None:
    """ATR's configs: the step's prompts are one mini-batch (``ppo_mini_batch_size = train_batch_size``) seen
    twice (``ppo_epochs=2``): the first forward of the update is pi_old for every row."""
    counts = run_ranks(job_old_pass_rows, 1, model, 8, 8)[0]
    assert counts["old_rows_without_skip"] == 8 and counts["old_rows_with_skip"] == 0, counts
    assert counts["update_rows_with_skip"] == counts["update_rows_without_skip"] == 16, counts  # 2 epochs


def test_the_erc_shape_runs_seven_eighths_of_the_old_pass(model: str) -> None:
    """ERC's configs: 8 mini-batches per step (``ppo_mini_batch_size = train_batch_size / 8``): the pass runs
    for the 7 after the first."""
    counts = run_ranks(job_old_pass_rows, 1, model, 2, 16)[0]
    assert counts["old_rows_without_skip"] == 16 and counts["old_rows_with_skip"] == 14, counts


# ------------------------------------------------------------------------------------------------
# Where it is not exact
# ------------------------------------------------------------------------------------------------

PACKING_OFF = "actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=false"
ROLLOUT_CORRECTION_READS = (
    "algorithm.rollout_correction.rollout_is / rollout_rs (their weights and rejection read pi_old before the update)"
)
ULYSSES = "actor_rollout_ref.actor.ulysses_sequence_parallel_size > 1 (one rank returns the group's outputs)"
#: case -> (overrides, the reason the rule gives, word for word: it is the refusal's and the metric's text)
BLOCKERS: dict[str, tuple[list[str], str]] = {
    "packing off": ([PACKING_OFF], f"{PACKING_OFF} (the pass is not packed as the update)"),
    "KL in the reward": (
        ["algorithm.use_kl_in_reward=true"],
        "algorithm.use_kl_in_reward=true (verl's apply_kl_penalty reads pi_old before the update)",
    ),
    "rollout correction": (["algorithm.rollout_correction.rollout_is=token"], ROLLOUT_CORRECTION_READS),
    "rejection sampling alone": (["algorithm.rollout_correction.rollout_rs=token_k3"], ROLLOUT_CORRECTION_READS),
    "bypass mode": (
        ["algorithm.rollout_correction.bypass_mode=true", PACKING_OFF],
        f"{PACKING_OFF} (the pass is not packed as the update)",
    ),
    # bypass mode's own reason, packing left on (validation refuses the pair; the rule still names bypass mode)
    "bypass mode, packed": (
        ["algorithm.rollout_correction.bypass_mode=true"],
        "algorithm.rollout_correction.bypass_mode=true (there is no old-log-prob pass)",
    ),
    "an estimator reading pi_old": (
        ["algorithm.adv_estimator=optimal_token_baseline"],
        "algorithm.adv_estimator=optimal_token_baseline (the estimator reads pi_old)",
    ),
    "the other estimator reading pi_old": (
        ["algorithm.adv_estimator=tir_optimal_token_baseline"],
        "algorithm.adv_estimator=tir_optimal_token_baseline (the estimator reads pi_old)",
    ),
    "a Decoupled-PPO cycle": (
        ["trainer.v1.trainer_mode=separate_async"],
        "trainer.v1.trainer_mode=separate_async (a Decoupled-PPO cycle's pi_old is its first weights, not the "
        "update's)",
    ),
    "Ulysses on the actor": (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], ULYSSES),
    "Ulysses on its engine": (["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2"], ULYSSES),
}


def trainer_config(overrides: list[str]) -> Any:
    from tests.test_recipe_main import compose_config

    return compose_config("actor_rollout_ref.actor.policy_loss.loss_mode=kl3", *overrides)


@pytest.mark.parametrize("case", list(BLOCKERS))
def test_where_it_is_not_exact_it_is_not_taken(case: str) -> None:
    from verl_ext.config_rules.composed import old_log_prob_from_update_blocker

    overrides, expected = BLOCKERS[case]
    assert old_log_prob_from_update_blocker(trainer_config([])) is None  # the default config: taken
    assert old_log_prob_from_update_blocker(trainer_config(overrides)) == expected


def test_rollout_correction_without_the_rollouts_log_probs_reads_no_pi_old() -> None:
    """Without ``rollout.calculate_log_probs`` verl computes no IS weights or rejection from mu (nothing before the
    update reads pi_old), so rollout correction alone does not block the skip."""
    from verl_ext.config_rules.composed import old_log_prob_from_update_blocker

    overrides = ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"]
    assert old_log_prob_from_update_blocker(trainer_config(overrides)) is None
    assert old_log_prob_from_update_blocker(trainer_config(overrides[:1])) == ROLLOUT_CORRECTION_READS  # the control


def test_no_rollout_correction_at_all_blocks_nothing() -> None:
    """``algorithm.rollout_correction=null``: verl runs no rollout correction (neither bypass nor weights), and the
    rules read it so -- the skip is taken, and ERC is accepted."""
    from recipe.config_checks import validate_divclip_config
    from tests.test_recipe_main import ERC, compose_config
    from verl_ext.config_rules.composed import old_log_prob_from_update_blocker

    assert old_log_prob_from_update_blocker(trainer_config(["algorithm.rollout_correction=null"])) is None
    erc = [*ERC, "actor_rollout_ref.actor.calculate_entropy=true"]
    validate_divclip_config(compose_config(*erc, "algorithm.rollout_correction=null"))


@pytest.mark.parametrize(
    "model_config, expected",
    [
        ({"hidden_size": 64, "hidden_dropout": 0.1}, "hidden_dropout=0.1"),
        ({"hidden_size": 64, "attention_dropout": 0.0, "hidden_dropout": 0}, None),  # zero: no dropout
        ({"hidden_size": 64, "use_dropout": True}, None),  # a switch, not a probability
        ({"hidden_size": 64, "num_layers": 2}, None),  # positive values of other keys
        ({"hidden_size": 64, "classifier_dropout": None}, None),
    ],
    ids=["positive", "zero", "a bool", "other keys", "null"],
)
def test_a_local_model_with_dropout_is_not_taken_before_ray(
    tmp_path: Path, model_config: dict[str, Any], expected: str | None
) -> None:
    """The rule reads a local checkpoint's config.json (a hub id it cannot read: the worker checks the model it
    built, :func:`test_a_model_with_dropout_is_not_taken_on_the_worker`)."""
    from verl_ext.config_rules.composed import old_log_prob_from_update_blocker

    (tmp_path / "config.json").write_text(json.dumps(model_config))
    reason = old_log_prob_from_update_blocker(trainer_config([f"actor_rollout_ref.model.path={tmp_path}"]))
    if expected is None:
        assert reason is None
    else:
        assert reason == f"the model's {expected} (a train-mode forward is not the eval-mode pass)"


@pytest.mark.parametrize(
    "overrides",
    [
        ["actor_rollout_ref.actor.policy_loss.loss_mode=kl_full"],
        ["actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=true"],
    ],
)
def test_kl_fulls_top_k_does_not_block_it(overrides: list[str]) -> None:
    from verl_ext.config_rules.composed import old_log_prob_from_update_blocker

    assert old_log_prob_from_update_blocker(trainer_config(overrides)) is None


def test_asked_where_it_is_not_exact_is_refused_naming_the_key() -> None:
    from verl_ext.config_rules.composed import validate_old_log_prob_from_update

    key = "actor_rollout_ref.actor.policy_loss.old_log_prob_from_update"
    validate_old_log_prob_from_update(trainer_config([f"{key}=true"]))  # exact: accepted
    with pytest.raises(ValueError) as refused:
        validate_old_log_prob_from_update(trainer_config([f"{key}=true", "algorithm.use_kl_in_reward=true"]))
    assert str(refused.value) == (
        f"{key}=true, but the update's first forward is not pi_old here: algorithm.use_kl_in_reward=true (verl's "
        "apply_kl_penalty reads pi_old before the update). Leave it null (taken only where exact) or set it false"
    )


def test_a_model_with_dropout_is_not_taken_on_the_worker() -> None:
    from verl_ext.engine.old_from_update import dropout_reason

    class Engine:
        module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))

    assert "p=0.1" in dropout_reason(Engine())
    Engine.module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0))
    assert dropout_reason(Engine()) is None


def test_placeholders_live_on_the_device_of_the_pass_outputs() -> None:
    """The skipped rows' placeholders join the computed rows in one nested tensor: on a GPU the pass's outputs are
    CUDA tensors, and CPU placeholders beside them made ``torch.nested`` raise (the ERC shape of the old-pass-skip
    bench on an H200, 2026-11-27). The ``meta`` device stands in for CUDA here."""
    from types import SimpleNamespace

    from verl_ext.engine import old_from_update as ofu

    fields = ofu.pass_fields(0)
    engine = SimpleNamespace()
    state = ofu.OldFromUpdate([(0, 4), (1, 5), (2, 5)], frozenset({0}), {name: [None] * 3 for name in fields})
    setattr(engine, ofu._STATE_ATTR, state)
    output = {"model_output": {name: torch.zeros(2, 5, device="meta", dtype=torch.bfloat16) for name in fields}}
    ofu.keep_pass_outputs(engine, [4, 5, 5], [2, 3, 3], [torch.tensor([1, 2])], [output])
    for name in fields:
        placeholder = state.values[name][0]
        assert (placeholder.device.type, placeholder.dtype, placeholder.shape) == ("meta", torch.bfloat16, (4,))
    assert ofu.placeholder_output(engine, 3)["model_output"]["log_probs"].device.type == "meta"


def test_the_benchmark_times_both_config_shapes_with_and_without_the_skip() -> None:
    """``python -m recipe.bench old-pass-skip`` at a tiny shape on the CPU: one row per config shape, the old pass
    computing every row without the skip, none with it for the ATR shape (one mini-batch) and 7/8 of them for the
    ERC shape (8 mini-batches); the ratio is the two actor times' (docs/benchmarks.md records the full size)."""
    import json
    import subprocess
    import sys

    argv = ["--json", "--tokens", "256", "--sequences", "16", "--vocab", "512", "--hidden", "32", "--layers", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.bench", "old-pass-skip", *argv, "--rounds", "1"],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["shape"]: row for row in map(json.loads, proc.stdout.splitlines())}
    assert sorted(rows) == ["atr", "erc"]
    expected = {"atr": (1, 2, 0), "erc": (8, 1, 14)}  # mini-batches, epochs, old-pass rows with the skip
    for shape, row in rows.items():
        assert (row["mini_batches"], row["epochs"], row["old_pass_rows_with"]) == expected[shape], row
        assert row["old_pass_rows_without"] == 16, row
        assert min(row[f"{k}_{arm}"] for k in ("old_pass_s", "update_s") for arm in ("with", "without")) > 0, row
        assert row["actor_s_without"] == pytest.approx(row["old_pass_s_without"] + row["update_s_without"], abs=2e-4)
        assert row["actor_s_with_vs_without"] == pytest.approx(row["actor_s_with"] / row["actor_s_without"], abs=1e-3)
