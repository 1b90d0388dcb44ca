"""ERC's on-policy invariant under every packing the configs produce, and the live noise gauge.

* The old-log-prob pass of an ERC run is packed as the update's first epoch
  (:mod:`verl_ext.onpolicy`): with dynamic batching at the configs' 2:1 token budgets (and other
  ratios), fixed micro-batches of other sizes, several mini-batches, shuffling, two epochs, seeds
  and 1 or 2 threads, under verl's default bf16, every micro-batch of the first update mini-batch
  holds the tokens the old-log-prob pass computed together (asserted on the recorded packings:
  the code guarantees it), so every ERC ratio lies in [0.99, 1.01] and ERC masks nothing.
* ``actor/divclip/onpolicy/*`` comes from the first mini-batch of each update call only, changes no
  gradient, and reads what a perturbed pi_old adds.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from recipe.bench.harness import (
    EXACT_SGD,
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    full_params,
    make_actor_config,
    make_rollout_batch,
    param_delta,
    run_ranks,
    save_tiny_qwen3,
    update_actor,
)

PROMPT_LENS = [3, 5, 4, 6, 2, 7, 5, 3]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8, 11, 7]
GAUGE = "actor/divclip/onpolicy/"


def erc_loss(**overrides: Any) -> Any:
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
    return build_actor_loss(make_actor_config(policy_loss=policy, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                              clip_ratio_c=10.0, **overrides))


class PackingRecorder:
    """The sample order of every micro-batch verl's engine prepares (dynamic batching returns it;
    fixed micro-batches are contiguous chunks, recorded by their sizes)."""

    def __init__(self) -> None:
        import verl.workers.engine.fsdp.transformer_impl as impl

        self.impl, self.original = impl, impl.prepare_micro_batches
        self.calls: list[list[list[int]]] = []

    def __enter__(self) -> "PackingRecorder":
        def prepare(*args: Any, **kwargs: Any) -> Any:
            micro_batches, indices = self.original(*args, **kwargs)
            if indices is None:
                sizes = [len(mb) for mb in micro_batches]
                starts = [sum(sizes[:i]) for i in range(len(sizes))]
                indices = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
            self.calls.append([list(map(int, rows)) for rows in indices])
            return micro_batches, indices

        self.impl.prepare_micro_batches = prepare
        return self

    def __exit__(self, *exc: Any) -> None:
        self.impl.prepare_micro_batches = self.original


def token_groups(calls: list[list[list[int]]], rows_of_call: list[list[int]]) -> list[list[int]]:
    """Each micro-batch as the batch rows it holds (a call's positions mapped through its rows)."""
    return [[rows[p] for p in micro] for call, rows in zip(calls, rows_of_call) for micro in call]


CASES: list[dict[str, Any]] = [
    # the ERC configs: dynamic batching, the log-prob pass at twice the update's budget
    *[dict(budgets=b, seed=seed, threads=threads) for b in ((40, 64), (40, 80), (24, 48), (64, 128))
      for seed in (4, 7) for threads in (1, 2)],
    # several mini-batches, shuffled, two epochs
    dict(budgets=(40, 80), seed=5, threads=2, mini_batch=4, shuffle=True, epochs=2),
    dict(budgets=(24, 48), seed=7, threads=1, mini_batch=2, shuffle=False, epochs=1),
    # fixed micro-batches of different sizes for the two passes
    dict(micro=(2, 4), seed=4, threads=2),
    dict(micro=(1, 8), seed=5, threads=1, mini_batch=4, shuffle=True, epochs=2),
]


def job_packings(rank: int, world_size: int, model_path: str) -> list[dict[str, Any]]:
    import verl_ext.actor_loss  # noqa: F401  (installs the hooks before set_loss_fn is looked up, as unpickling does on a worker)
    from verl_ext.onpolicy import UpdatePacking, first_epoch_mini_batches

    results = []
    for case in CASES:
        torch.set_num_threads(case["threads"])
        if "budgets" in case:
            update_budget, infer_budget = case["budgets"]
            options = WorkerOptions(mixed_precision=None, use_dynamic_bsz=True, max_token_len_per_gpu=update_budget,
                                    infer_max_token_len_per_gpu=infer_budget, **EXACT_SGD)
        else:
            update_micro, infer_micro = case["micro"]
            options = WorkerOptions(mixed_precision=None, micro_batch_size_per_gpu=update_micro,
                                    infer_micro_batch_size_per_gpu=infer_micro, **EXACT_SGD)
        worker = build_actor_worker(model_path, options)
        worker.set_loss_fn(erc_loss())
        batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=case["seed"])
        size = len(PROMPT_LENS)
        mini = case.get("mini_batch", size)
        packing = UpdatePacking(mini_batch_size=mini, seed=11, shuffle=case.get("shuffle", False))
        with PackingRecorder() as old_packing:
            old = compute_log_prob(worker, batch, packing=packing)
        data = batch.clone()
        data["old_log_probs"], data["entropy"] = old["old_log_probs"], old["entropy"]
        with PackingRecorder() as new_packing:
            m = update_actor(worker, data, calculate_entropy=True, mini_batch_size=mini, epochs=case.get("epochs", 1),
                             shuffle=packing.shuffle, seed=packing.seed)
        groups = [g.tolist() for g in first_epoch_mini_batches(size, mini, packing.seed, packing.shuffle)]
        first_update = token_groups(new_packing.calls[:1], groups[:1])
        results.append({
            "case": case,
            "old_groups": token_groups(old_packing.calls, groups),
            "first_update_groups": first_update,
            "old_entropy": old["entropy"].values(),
            "metrics": {k: [float(v) for v in vals] for k, vals in m.items() if isinstance(vals, list)},
        })
    return results


@pytest.fixture(scope="module")
def confident_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # the head scale makes most tokens' entropy < 1e-3 nats, as a trained reasoning model's are
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_onpolicy")), TinyQwen3Spec(), seed=0, head_scale=1000.0)


@pytest.fixture(scope="module")
def packings(confident_model: str) -> list[dict[str, Any]]:
    return run_ranks(job_packings, 1, confident_model)[0]


def test_the_model_is_confident(packings: list[dict[str, Any]]) -> None:
    shares = [float((r["old_entropy"] < 1e-3).float().mean()) for r in packings]
    assert min(shares) >= 0.6, shares  # 70-84% across the seeds


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c) for c in CASES])
def test_old_log_prob_pass_is_packed_as_the_first_update_mini_batch(packings: list[dict[str, Any]], index: int) -> None:
    result = packings[index]
    # what the code guarantees: the first update mini-batch's micro-batches are old-log-prob micro-batches
    assert result["first_update_groups"], result["case"]
    assert all(group in result["old_groups"] for group in result["first_update_groups"]), result
    # hence, on-policy, ERC measures the policy: every ratio in [0.99, 1.01], nothing masked
    m = result["metrics"]
    assert 0.99 <= min(m["actor/divclip/erc/ratio_min"][:1]) and max(m["actor/divclip/erc/ratio_max"][:1]) <= 1.01, m
    assert m[GAUGE + "erc_ratio_dev_max"] and max(m[GAUGE + "erc_ratio_dev_max"]) <= 0.01, m
    assert m[GAUGE + "erc_masked_frac"] == [0.0] and m[GAUGE + "ratio_clipfrac"] == [0.0], m


@pytest.mark.parametrize("index", [i for i, c in enumerate(CASES) if c.get("epochs", 1) > 1 or c.get("mini_batch")])
def test_gauge_comes_from_the_first_mini_batch_only(packings: list[dict[str, Any]], index: int) -> None:
    case, m = packings[index]["case"], packings[index]["metrics"]
    mini_batches = len(PROMPT_LENS) // case["mini_batch"] * case.get("epochs", 1)
    assert len(m["actor/pg_loss"]) == mini_batches > 1
    for name in ("log_ratio_abs_max", "ratio_clipfrac", "erc_ratio_dev_max", "erc_masked_frac"):
        assert len(m[GAUGE + name]) == 1, (name, m[GAUGE + name])


def test_mini_batches_come_from_verls_iterator() -> None:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_ext.onpolicy import first_epoch_mini_batches

    rows = TensorDict({"x": torch.arange(12) * 10}, batch_size=[12])
    expected = [mb["x"] // 10 for mb in tu.make_iterator(rows, 3, epochs=1, seed=7, dataloader_kwargs={"shuffle": True})]
    got = first_epoch_mini_batches(12, 3, seed=7, shuffle=True)
    assert [g.tolist() for g in got] == [e.tolist() for e in expected]
    assert sorted(torch.cat(got).tolist()) == list(range(12)) and got[0].tolist() != [0, 1, 2]
    with pytest.raises(ValueError, match="ppo_mini_batch_size"):
        first_epoch_mini_batches(10, 4, seed=0, shuffle=False)


def test_update_packing_reads_the_trainer_keys() -> None:
    from verl_ext.onpolicy import UPDATE_PACKING_KEY, UpdatePacking

    actor = {"ppo_mini_batch_size": 32, "data_loader_seed": 1, "shuffle": False}
    packing = UpdatePacking.from_actor_config(actor, rollout_n=8)
    assert packing == UpdatePacking(mini_batch_size=256, seed=1, shuffle=False)
    assert packing.as_extra_info() == {UPDATE_PACKING_KEY: {"mini_batch_size": 256, "seed": 1, "shuffle": False}}


def test_gauge_reads_what_a_perturbed_old_policy_adds() -> None:
    from verl_ext.onpolicy import on_policy_gauge

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
    from verl_ext.config import DivClipPolicyLossConfig

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, TinyQwen3Spec().vocab_size, seed=3)
    out: dict[str, Any] = {}
    for mode in ("erc", "kl3"):
        deltas, metrics = [], []
        for gauge_on in (True, False):
            worker = build_actor_worker(model_path, WorkerOptions(mixed_precision=None, **EXACT_SGD))
            if mode == "erc":
                worker.set_loss_fn(erc_loss())
            else:
                worker.set_loss_fn(actor_loss.build_actor_loss(make_actor_config(
                    policy_loss=DivClipPolicyLossConfig(loss_mode="kl3", delta=0.07))))
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
