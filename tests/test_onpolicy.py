"""The on-policy invariant in every loss mode and every packing the configs produce, and the live gauge.

* The old-log-prob pass is packed as the update's first epoch (:mod:`verl_ext.engine.packing`, on by
  default: ``policy_loss.pack_old_log_prob_as_update``) for every mode: the divclip constraints,
  ``kl_full`` and the KL3-vs-trust-region diagnostic, verl's own modes through the divclip actor loss,
  ERC, and the vocabulary pass. Under verl's default bf16, with dynamic batching at 2:1 and other token
  budgets, fixed micro-batches of different sizes, one to four (shuffled) mini-batches, two epochs,
  1 and 2 threads, 2 data-parallel ranks and a 2-rank Ulysses group, and at learning rate 0 (so every
  first-epoch mini-batch is on-policy): every update micro-batch is one the old pass computed (asserted
  on the recorded packings: what the code guarantees), hence max |log w| = 0, no ratio clipped,
  ``ppo_kl`` = 0, ERC masks nothing, ``kl_full``'s KL is 0 and the diagnostic disagrees nowhere. verl's
  own packing (``pack_old_log_prob_as_update=false``) is the control: its micro-batches differ.
* ``actor/divclip/onpolicy/*`` comes from the first mini-batch of each update call only, changes no
  gradient, and reads what a perturbed pi_old adds; ``actor/divclip/path/*`` records, from the worker,
  which path each step took.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from recipe.bench.harness import (
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    full_params,
    make_actor_config,
    make_rollout_batch,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, param_delta, run_ranks, shard_for_rank
from verl_ext.engine.packing import first_epoch_mini_batches

PROMPT_LENS = [3, 5, 4, 6, 2, 7, 5, 3]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8, 11, 7]
GAUGE = "actor/divclip/onpolicy/"


class PackingRecorder:
    """The sample order of every micro-batch verl's engine prepares (dynamic batching returns it;
    fixed micro-batches are contiguous chunks, recorded by their sizes)."""

    def __init__(self) -> None:
        import verl.workers.engine.fsdp.transformer_impl as impl

        self.impl, self.original = impl, impl.prepare_micro_batches
        self.calls: list[list[list[int]]] = []

    def __enter__(self) -> PackingRecorder:
        def prepare(*args: Any, **kwargs: Any) -> Any:
            micro_batches, indices = self.original(*args, **kwargs)
            if indices is None:
                sizes = [len(mb) for mb in micro_batches]
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                indices = [list(range(s, s + n)) for s, n in zip(starts, sizes, strict=False)]
            self.calls.append([list(map(int, rows)) for rows in indices])
            return micro_batches, indices

        self.impl.prepare_micro_batches = prepare
        return self

    def __exit__(self, *exc: Any) -> None:
        self.impl.prepare_micro_batches = self.original


def token_groups(calls: list[list[list[int]]], rows_of_call: list[list[int]]) -> list[list[int]]:
    """Each micro-batch as the batch rows it holds (a call's positions mapped through its rows)."""
    return [[rows[p] for p in micro] for call, rows in zip(calls, rows_of_call, strict=False) for micro in call]


# ------------------------------------------------------------------------------------------------
# Every mode, every packing: exactly on-policy
# ------------------------------------------------------------------------------------------------

ERC = dict(erc_beta_low=0.05, erc_beta_high=0.05)
TOP_K = 8
MODES: dict[str, dict[str, Any]] = {
    # the divclip constraints
    **{
        mode: dict(loss_mode=mode)
        for mode in ("clip", "kl3", "kl1", "kl2", "is_kl3", "trgppo", "dcpo", "gppo", "seq_kl3")
    },
    "kl_full": dict(loss_mode="kl_full", kl_full_top_k=TOP_K),
    "kl3+diagnostic": dict(loss_mode="kl3", kl_full_diagnostic=True, kl_full_top_k=TOP_K),
    # verl's own modes through the divclip actor loss
    **{mode: dict(loss_mode=mode) for mode in ("vanilla", "gspo", "sapo", "clip_cov")},
    # ERC, and the vocabulary pass
    "erc": dict(loss_mode="clip", **ERC),
    "erc+gspo": dict(loss_mode="gspo", **ERC),
    "kl3+vocab_pass": dict(loss_mode="kl3", vocab_pass=True),
    "erc+vocab_pass": dict(loss_mode="clip", vocab_pass=True, **ERC),
    "kl_full+vocab_pass": dict(loss_mode="kl_full", kl_full_top_k=TOP_K, vocab_pass=True),
}
SELECTS_BY_COVARIANCE = {"clip_cov"}  # its pg_clipfrac counts covariance-selected tokens, not ratio clips

PACKINGS: dict[str, dict[str, Any]] = {
    # dynamic batching, the log-prob pass at twice the update's budget (the configs' 2:1)
    "dynamic 40/80, 2 shuffled mini-batches, 2 epochs": dict(budgets=(40, 80), mini_batch=4, shuffle=True, epochs=2),
    "dynamic 24/72, 1 mini-batch": dict(budgets=(24, 72), mini_batch=8),
    "dynamic 64/128, 4 shuffled mini-batches": dict(budgets=(64, 128), mini_batch=2, shuffle=True),
    # fixed micro-batches of different sizes for the two passes
    "fixed 2/4, 1 mini-batch": dict(micro=(2, 4), mini_batch=8),
    "fixed 1/8, 2 shuffled mini-batches": dict(micro=(1, 8), mini_batch=4, shuffle=True),
}
THREADS = (1, 2)


def worker_options(packing: dict[str, Any]) -> WorkerOptions:
    # lr 0: no optimizer step moves pi_theta, so every first-epoch mini-batch is on-policy; bf16 is
    # verl's default mixed precision (mixed_precision=None)
    fixed = dict(mixed_precision=None, optimizer="AdamW", lr=0.0)
    if "budgets" in packing:
        update_budget, infer_budget = packing["budgets"]
        return WorkerOptions(
            use_dynamic_bsz=True, max_token_len_per_gpu=update_budget, infer_max_token_len_per_gpu=infer_budget, **fixed
        )
    update_micro, infer_micro = packing["micro"]
    return WorkerOptions(micro_batch_size_per_gpu=update_micro, infer_micro_batch_size_per_gpu=infer_micro, **fixed)


def divclip_loss(mode: dict[str, Any], aligned: bool = True) -> Any:
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    policy = DivClipPolicyLossConfig(**mode, pack_old_log_prob_as_update=aligned)
    return build_actor_loss(make_actor_config(policy_loss=policy, clip_ratio_low=0.2, clip_ratio_high=0.28))


def on_policy_case(
    worker: Any,
    batch: Any,
    mode: dict[str, Any],
    packing: dict[str, Any],
    aligned: bool = True,
    dp_rank_broadcast: bool = False,
) -> dict[str, Any]:
    """Old-log-prob pass then one update call at lr 0 (the trainer's order); the recorded packings and the
    update's metrics (one value per mini-batch)."""
    from verl_ext.engine.packing import UpdatePacking
    from verl_ext.engine.topk_capture import OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS

    worker.set_loss_fn(divclip_loss(mode, aligned))
    topk = mode.get("kl_full_top_k", 0) if mode["loss_mode"] == "kl_full" or mode.get("kl_full_diagnostic") else 0
    packing_info = UpdatePacking(mini_batch_size=packing["mini_batch"], seed=11, shuffle=packing.get("shuffle", False))
    with PackingRecorder() as old_packing:
        old = compute_log_prob(worker, batch, packing=packing_info, old_topk=topk)
    if dp_rank_broadcast:  # a Ulysses group: rank 0 collects pi_old's pass and hands it on, as the driver does
        shared = [old]
        torch.distributed.broadcast_object_list(shared, src=0)
        old = shared[0]
    data = batch.clone()
    data["old_log_probs"], data["entropy"] = old["old_log_probs"], old["entropy"]
    if topk:
        data[OLD_TOPK_LOG_PROBS], data[OLD_TOPK_IDS] = old[OLD_TOPK_LOG_PROBS], old[OLD_TOPK_IDS]
    with PackingRecorder() as new_packing:
        metrics = update_actor(
            worker,
            data,
            calculate_entropy="erc_beta_low" in mode,
            mini_batch_size=packing["mini_batch"],
            epochs=packing.get("epochs", 1),
            shuffle=packing_info.shuffle,
            seed=packing_info.seed,
        )
    return {
        "old_calls": old_packing.calls,
        "new_calls": new_packing.calls,
        "metrics": {k: [float(v) for v in vals] for k, vals in metrics.items() if isinstance(vals, list)},
    }


def job_every_mode(rank: int, world_size: int, model_path: str) -> list[dict[str, Any]]:
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=5)
    results = []
    for threads in THREADS:
        torch.set_num_threads(threads)
        for packing_name, packing in PACKINGS.items():
            worker = build_actor_worker(model_path, worker_options(packing))  # lr 0: one worker serves every mode
            for mode_name, mode in MODES.items():
                results.append(
                    {
                        "threads": threads,
                        "packing": packing_name,
                        "mode": mode_name,
                        **on_policy_case(worker, batch, mode, packing),
                    }
                )
            control = on_policy_case(worker, batch, MODES["kl3"], packing, aligned=False)
            results.append({"threads": threads, "packing": packing_name, "mode": "kl3, verl's packing", **control})
    return results


@pytest.fixture(scope="module")
def confident_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # the head scale makes most tokens' entropy < 1e-3 nats and |top logit| large, as a trained reasoning
    # model's are: one bf16 ulp of a logit is then far outside every clip band
    return save_tiny_qwen3(
        Path(tmp_path_factory.mktemp("tiny_qwen3_onpolicy")), TinyQwen3Spec(), seed=0, head_scale=1000.0
    )


@pytest.fixture(scope="module")
def every_mode(confident_model: str) -> list[dict[str, Any]]:
    return run_ranks(job_every_mode, 1, confident_model)[0]


def first_epoch_mini_batches_of(packing: dict[str, Any]) -> int:
    return len(PROMPT_LENS) // packing["mini_batch"]


def assert_exactly_on_policy(result: dict[str, Any], mode: dict[str, Any], mini_batches: int) -> None:
    """Every first-epoch mini-batch at lr 0 is on-policy: ratios exactly 1, so nothing is clipped, masked or
    counted as divergence; the gauge (first mini-batch) reads 0; the path says the packing was aligned."""
    m = result["metrics"]
    first = lambda name: m[name][:mini_batches]  # noqa: E731  (later epochs are off-policy by definition)
    assert m[GAUGE + "log_ratio_abs_max"] == [0.0] and m[GAUGE + "ratio_clipfrac"] == [0.0], m
    assert all(v == 0.0 for v in first("actor/ppo_kl")), m["actor/ppo_kl"]
    if mode["loss_mode"] not in SELECTS_BY_COVARIANCE:
        assert all(v == 0.0 for v in first("actor/pg_clipfrac")), m["actor/pg_clipfrac"]
    if "erc_beta_low" in mode:
        assert m[GAUGE + "erc_masked_frac"] == [0.0] and m[GAUGE + "erc_ratio_dev_max"] == [0.0], m
        for side in ("upper", "lower"):
            assert all(v == 0.0 for v in first(f"actor/divclip/erc/clipfrac_{side}")), m
    if mode["loss_mode"] == "kl_full" or mode.get("kl_full_diagnostic"):
        assert all(v == 0.0 for v in first("actor/divclip/kl_full_max")), m["actor/divclip/kl_full_max"]
    if mode.get("kl_full_diagnostic"):
        for name in ("mode_only_frac", "full_only_frac"):
            assert all(v == 0.0 for v in first(f"actor/divclip/kl_full_diag/{name}")), m
    assert set(m["actor/divclip/path/pack_old_log_prob_as_update"]) == {1.0} and set(m["actor/divclip/path/seam"]) == {
        1.0
    }
    assert set(m["actor/divclip/path/vocab_pass"]) == {1.0 if mode.get("vocab_pass") else 0.0}
    assert set(m["actor/divclip/path/entropy_fp32"]) == {
        1.0 if mode.get("vocab_pass") or "erc_beta_low" in mode else 0.0
    }


CASE_IDS = [f"{threads}thr-{packing}-{mode}" for threads in THREADS for packing in PACKINGS for mode in MODES]


@pytest.mark.parametrize("index", range(len(CASE_IDS)), ids=CASE_IDS)
def test_every_mode_is_exactly_on_policy_in_every_packing(every_mode: list[dict[str, Any]], index: int) -> None:
    cases = [r for r in every_mode if r["mode"] in MODES]
    result = cases[index]
    assert f"{result['threads']}thr-{result['packing']}-{result['mode']}" == CASE_IDS[index]
    packing = PACKINGS[result["packing"]]
    # what the code guarantees: each first-epoch update micro-batch is one of the old pass's micro-batches
    old_groups = [micro for call in result["old_calls"] for micro in call]
    groups = [
        g.tolist()
        for g in first_epoch_mini_batches(len(PROMPT_LENS), packing["mini_batch"], 11, packing.get("shuffle", False))
    ]
    update_groups = token_groups(result["new_calls"][: len(groups)], groups)
    assert update_groups and all(group in token_groups(result["old_calls"], groups) for group in update_groups), result
    assert len(old_groups) == len(update_groups)
    # hence every ratio is exactly 1 before the first optimizer step (at lr 0: in every first-epoch mini-batch)
    assert_exactly_on_policy(result, MODES[result["mode"]], first_epoch_mini_batches_of(packing))


@pytest.mark.parametrize("packing", list(PACKINGS))
def test_verls_own_packing_is_the_control(every_mode: list[dict[str, Any]], packing: str) -> None:
    """With ``pack_old_log_prob_as_update=false`` the old pass is packed by its own budget, so the passes'
    micro-batches differ (what the code decides), and the path says the update found no packing of the old pass as
    the update."""
    for threads in THREADS:
        result = control_case(every_mode, packing, threads)
        old_sizes = sorted(len(micro) for call in result["old_calls"] for micro in call)
        new_sizes = sorted(len(micro) for call in result["new_calls"] for micro in call)
        assert old_sizes != new_sizes or len(result["old_calls"]) != len(result["new_calls"])
        m = result["metrics"]
        assert math.isfinite(m[GAUGE + "log_ratio_abs_max"][0]) and set(
            m["actor/divclip/path/pack_old_log_prob_as_update"]
        ) == {0.0}


def control_case(every_mode: list[dict[str, Any]], packing: str, threads: int) -> dict[str, Any]:
    return next(
        r
        for r in every_mode
        if r["mode"] == "kl3, verl's packing" and r["packing"] == packing and r["threads"] == threads
    )


@pytest.mark.parametrize("threads", THREADS)
def test_verls_own_packing_shows_the_noise_the_alignment_removes(
    every_mode: list[dict[str, Any]], threads: int
) -> None:
    """The control's effect: under verl's packing the kernels move on-policy log-ratios away from 0 (the gauge
    reads > 0) in some of the configs' packings, where the aligned arm of the same packings reads exactly 0
    (test_every_mode_is_exactly_on_policy_in_every_packing). Which packings show it depends on the machine's
    kernels (a bf16 rounding boundary crossed by a product's last bits), so the claim is: at least one."""
    noisy = {
        packing: control_case(every_mode, packing, threads)["metrics"][GAUGE + "log_ratio_abs_max"][0]
        for packing in PACKINGS
    }
    assert max(noisy.values()) > 0, noisy
    for packing in PACKINGS:
        aligned = next(
            r for r in every_mode if r["mode"] == "kl3" and r["packing"] == packing and r["threads"] == threads
        )
        assert aligned["metrics"][GAUGE + "log_ratio_abs_max"] == [0.0]


# ------------------------------------------------------------------------------------------------
# The packing is observed where it is used: the update compares itself with the old pass's record
# ------------------------------------------------------------------------------------------------


def job_observed_packing(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """One worker at bf16 with dynamic batching (2:1): the old pass packed for one update split, then updates
    that run that split, another split, another shuffle, other rows, or no recorded pass at all."""
    from verl_ext.engine.packing import UPDATE_FOLLOWS_OLD_PASS_KEY, PackingMismatchError, UpdatePacking

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=5)
    worker = build_actor_worker(
        model_path, worker_options(PACKINGS["dynamic 40/80, 2 shuffled mini-batches, 2 epochs"])
    )
    worker.set_loss_fn(divclip_loss(MODES["kl3"]))

    def case(
        old_packing: Optional[UpdatePacking],
        update: dict[str, Any],
        data: Any = None,
        follows: bool = True,
        updates: int = 1,
    ) -> Any:
        old = compute_log_prob(worker, batch, packing=old_packing)
        trained = (batch if data is None else data).clone()
        trained["old_log_probs"], trained["entropy"] = old["old_log_probs"], old["entropy"]
        try:
            for _ in range(updates):  # each record serves one update call
                metrics = update_actor(
                    worker,
                    trained,
                    calculate_entropy=False,
                    extra_info={UPDATE_FOLLOWS_OLD_PASS_KEY: follows},
                    **update,
                )
        except PackingMismatchError as error:
            return str(error)
        return sorted(set(float(v) for v in metrics["actor/divclip/path/pack_old_log_prob_as_update"]))

    split = UpdatePacking(mini_batch_size=4, seed=11, shuffle=True)
    reversed_rows = tu_index(batch, list(reversed(range(len(PROMPT_LENS)))))
    return {
        "matched": case(split, dict(mini_batch_size=4, seed=11, shuffle=True, epochs=2)),
        "other split": case(split, dict(mini_batch_size=8, seed=11, shuffle=True)),
        "other shuffle": case(split, dict(mini_batch_size=4, seed=12, shuffle=True)),
        "other rows": case(split, dict(mini_batch_size=4, seed=11, shuffle=True), data=reversed_rows),
        "split not handed to the pass": case(None, dict(mini_batch_size=4, seed=11, shuffle=True)),
        "a second update on one record": case(split, dict(mini_batch_size=4, seed=11, shuffle=True), updates=2),
        "no pass recorded, direct caller": case(None, dict(mini_batch_size=8), follows=False),
    }


def tu_index(batch: Any, rows: list[int]) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.index_select_tensor_dict(batch, torch.tensor(rows))


def test_the_update_checks_its_packing_against_the_old_pass_record(confident_model: str) -> None:
    """The old pass records what it packed, per rank; the update compares its first-epoch mini-batches and
    micro-batches with it and raises naming both on any difference; ``path/pack_old_log_prob_as_update`` is 1 only when
    every first-epoch micro-batch matched -- not because the packing was asked for."""
    found = run_ranks(job_observed_packing, 1, confident_model)[0]
    assert found["matched"] == [1.0]
    assert "splits its first epoch into 1 mini-batch(es) and the old-log-prob pass packed 2" in found["other split"]
    assert "update mini-batch 0, micro-batch 0 holds rows" in found["other shuffle"]
    assert "where the old-log-prob pass packed rows" in found["other shuffle"]
    assert "the update received 8 rows and the old-log-prob pass 8, first different at row 0" in found["other rows"]
    # the trainer's split did not reach the pass (a verl change): the pass packed one in-order mini-batch, no record
    assert "holds no record of it" in found["split not handed to the pass"]
    assert "holds no record of it" in found["a second update on one record"]
    assert found["no pass recorded, direct caller"] == [0.0]  # nothing aligned was observed: reported as 0


def test_an_update_that_bypasses_the_mini_batch_hook_fails_instead_of_passing_unobserved() -> None:
    """If verl stopped routing an update's mini-batches through ``TrainingWorker.train_batch`` (where the
    observer counts them), the observer would compare nothing: a micro-batch before any mini-batch, or an
    update that ends with recorded mini-batches never started, raises."""
    from verl_ext.engine.packing import PackingMismatchError, PackingRecord, UpdateObserver

    record = PackingRecord([(5, 1), (6, 2)], mini_batches=[[], []])  # two first-epoch mini-batches
    early = UpdateObserver(record, first_epoch=2)
    early.start(record.fingerprints)
    with pytest.raises(PackingMismatchError, match="ran before any of the update's mini-batches started"):
        early.observe(None)
    short = UpdateObserver(record, first_epoch=2)
    short.start(record.fingerprints)
    short.start_mini_batch()
    with pytest.raises(PackingMismatchError, match="the update ran 1 of its first epoch's 2 mini-batch"):
        short.finish()
    complete = UpdateObserver(record, first_epoch=2)
    complete.start(record.fingerprints)
    for _ in range(3):  # a second epoch's mini-batch is not compared
        complete.start_mini_batch()
    complete.finish()


DP_MODES = ("kl3", "gspo", "erc", "kl_full", "erc+vocab_pass")
ULYSSES_MODES = ("kl3", "gspo", "erc", "erc+vocab_pass")  # kl_full needs unsharded sequences (refused with Ulysses)
TWO_RANK_PACKING = PACKINGS["dynamic 40/80, 2 shuffled mini-batches, 2 epochs"]


def job_two_ranks(rank: int, world_size: int, model_path: str, ulysses: bool) -> list[dict[str, Any]]:
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=5)
    options = worker_options(TWO_RANK_PACKING)
    if ulysses:  # one sequence-parallel group: each rank holds the whole batch (data-parallel size 1)
        options = WorkerOptions(**{**options.__dict__, "ulysses_sequence_parallel_size": world_size})
    else:
        batch = shard_for_rank(batch, rank, world_size)
    worker = build_actor_worker(model_path, options)
    results = []
    for name in ULYSSES_MODES if ulysses else DP_MODES:  # the mini-batch size is global, as the trainer passes it
        results.append(
            {"mode": name, **on_policy_case(worker, batch, MODES[name], TWO_RANK_PACKING, dp_rank_broadcast=ulysses)}
        )
    return results


@pytest.mark.parametrize("ulysses", [False, True], ids=["2 data-parallel ranks", "2-rank Ulysses group"])
def test_two_ranks_are_exactly_on_policy(confident_model: str, ulysses: bool) -> None:
    ranks = run_ranks(job_two_ranks, 2, confident_model, ulysses)
    for rank, results in enumerate(ranks):
        for result in results:
            if not result["metrics"]:  # a Ulysses peer: verl returns the group's metrics from one rank
                assert ulysses and rank == 1
                continue
            assert_exactly_on_policy(result, MODES[result["mode"]], first_epoch_mini_batches_of(TWO_RANK_PACKING))


def test_mini_batches_come_from_verls_iterator() -> None:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_ext.engine.packing import first_epoch_mini_batches

    rows = TensorDict({"x": torch.arange(12) * 10}, batch_size=[12])
    expected = [
        mb["x"] // 10 for mb in tu.make_iterator(rows, 3, epochs=1, seed=7, dataloader_kwargs={"shuffle": True})
    ]
    got = first_epoch_mini_batches(12, 3, seed=7, shuffle=True)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    assert sorted(torch.cat(got).tolist()) == list(range(12)) and got[0].tolist() != [0, 1, 2]
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        first_epoch_mini_batches(10, 4, seed=0, shuffle=False)


def test_update_packing_reads_the_trainer_keys() -> None:
    from verl_ext.engine.packing import UPDATE_PACKING_KEY, UpdatePacking

    actor = {"ppo_mini_batch_size": 32, "data_loader_seed": 1, "shuffle": False}
    packing = UpdatePacking.from_actor_config(actor, rollout_n=8)
    assert packing == UpdatePacking(mini_batch_size=256, seed=1, shuffle=False)
    assert packing.as_extra_info() == {UPDATE_PACKING_KEY: {"mini_batch_size": 256, "seed": 1, "shuffle": False}}


def test_gauge_reads_what_a_perturbed_old_policy_adds() -> None:
    from verl_ext.core.gauge import on_policy_gauge

    log_prob = torch.full((2, 4), -1.0)
    old = log_prob.clone()
    old[0, 1] -= 0.5  # w = e^0.5 = 1.65: outside (0.8, 1.28)
    old[1, 3] += 3.0  # padding: ignored
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    entropy = torch.full((2, 4), 0.2)
    old_entropy = entropy.clone()
    old_entropy[1, 0] = 0.1  # rho ~ 2: ERC would mask it
    g = on_policy_gauge(old, log_prob, mask, 0.2, 0.28, old_entropy, entropy, erc_band=(0.05, 0.05, 1e-8))
    assert g["onpolicy/log_ratio_abs_max"] == pytest.approx(0.5)
    assert g["onpolicy/ratio_clipfrac"] == pytest.approx(1 / 7)
    assert g["onpolicy/erc_ratio_dev_max"] == pytest.approx(1.0, rel=1e-5)
    assert g["onpolicy/erc_masked_frac"] == pytest.approx(1 / 7)
    no_erc = on_policy_gauge(old, log_prob, mask, 0.2, 0.28)
    assert set(no_erc) == {"onpolicy/log_ratio_abs_max", "onpolicy/ratio_clipfrac"}
    assert math.isfinite(no_erc["onpolicy/log_ratio_abs_max"])


def job_gauge_changes_no_gradient(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    import verl_ext.actor_loss as actor_loss

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=3)
    out: dict[str, Any] = {}
    for mode in ("erc", "kl3"):
        deltas, metrics = [], []
        for gauge_on in (True, False):
            worker = build_actor_worker(model_path, WorkerOptions(mixed_precision=None, **EXACT_SGD))
            worker.set_loss_fn(divclip_loss(MODES[mode]))
            old = compute_log_prob(worker, batch)
            data = batch.clone()
            data["old_log_probs"], data["entropy"] = old["old_log_probs"], old["entropy"]
            before = full_params(worker)
            original = actor_loss.is_on_policy
            if not gauge_on:
                actor_loss.is_on_policy = lambda _data: False
            try:
                metrics.append(update_actor(worker, data, calculate_entropy=mode == "erc"))
            finally:
                actor_loss.is_on_policy = original
            deltas.append(param_delta(before, full_params(worker)))
        out[mode] = {"deltas": deltas, "metrics": metrics}
    return out


def test_gauge_changes_no_gradient_in_any_mode(confident_model: str) -> None:
    result = run_ranks(job_gauge_changes_no_gradient, 1, confident_model)[0]
    for mode, r in result.items():
        with_gauge, without = r["deltas"]
        assert all(torch.equal(with_gauge[k], without[k]) for k in with_gauge), mode
        assert any((d != 0).any() for d in with_gauge.values()), mode
        assert GAUGE + "log_ratio_abs_max" in r["metrics"][0] and GAUGE + "log_ratio_abs_max" not in r["metrics"][1]
    assert GAUGE + "erc_masked_frac" not in result["kl3"]["metrics"][0]  # no ERC band without ERC
