"""The NLL term on correct responses (released ERC scripts, ``correct_nll_coef``) and its two
normalisations (``correct_nll_norm``): ``global`` (default, like the policy loss) and
``micro_batch`` (the released ERC code's token mean over each micro-batch's correct responses,
scaled by the micro-batch's share of the mini-batch's sequences)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recipe.bench.harness import make_actor_config

# verl_ext is imported inside the functions: the engine test's spawned rank re-imports this module
# and must select the cpu platform (recipe.bench.harness) before anything resolves verl's platform.

# a mini-batch of 6 responses of ragged length; rewards +1 (correct), -1 (wrong), -0.5 (no </think>)
LENGTHS = [5, 3, 7, 2, 6, 4]
REWARDS = [1.0, -1.0, 1.0, -0.5, -1.0, 1.0]
MICRO_BATCHES = [[0, 1, 2], [3, 4], [5]]  # the second holds no correct response


def _mini_batch(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    log_prob = (-4.0 * torch.rand(len(LENGTHS), width, generator=gen)).to(dtype).requires_grad_(True)
    mask = torch.arange(width)[None, :] < torch.tensor(LENGTHS)[:, None]
    rewards = torch.zeros(len(LENGTHS), width)
    for row, (length, reward) in enumerate(zip(LENGTHS, REWARDS, strict=False)):
        rewards[row, length - 1] = reward  # verl puts the sequence reward on the last response token
    return log_prob, rewards, mask


def _policy(norm: str) -> Any:
    from verl_ext.config import DivClipPolicyLossConfig

    return DivClipPolicyLossConfig(loss_mode="clip", correct_nll_coef=0.1, correct_nll_norm=norm)


def _summed_over_micro_batches(
    norm: str,
    log_prob: torch.Tensor,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    rows: list[list[int]],
    dp_size: int = 1,
    global_batch_size: int = len(LENGTHS),
    batch_num_tokens: int = sum(LENGTHS),
) -> torch.Tensor:
    """One rank's loss as verl's engine accumulates it: the per-micro-batch losses summed."""
    from verl_ext.actor_loss import _correct_response_nll

    config = make_actor_config(loss_agg_mode="token-mean")
    config.global_batch_info.update(
        dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size, loss_scale_factor=None
    )
    total = torch.zeros((), dtype=torch.float32)
    for idx in rows:
        nll, _fraction = _correct_response_nll(log_prob[idx], rewards[idx], mask[idx], _policy(norm), config)
        total = total + nll
    return total


def _reference_value(log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The released ERC code's term, written out: sum over micro-batches of
    (sequences in mb / sequences in mini-batch) * mean of -log p over mb's correct-response tokens."""
    total = torch.zeros((), dtype=torch.float64)
    for idx in MICRO_BATCHES:
        tokens = [-log_prob[r, t].double() for r in idx if REWARDS[r] == 1.0 for t in range(LENGTHS[r])]
        if tokens:
            total = total + len(idx) / len(LENGTHS) * torch.stack(tokens).mean()
    return total


def test_micro_batch_norm_is_the_released_codes() -> None:
    log_prob, rewards, mask = _mini_batch()
    ours = _summed_over_micro_batches("micro_batch", log_prob, rewards, mask, MICRO_BATCHES)
    want = _reference_value(log_prob, mask)
    assert ours.item() == pytest.approx(want.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(ours, log_prob)
    (want_grad,) = torch.autograd.grad(want, log_prob)
    torch.testing.assert_close(grad, want_grad.float(), rtol=1e-6, atol=1e-7)
    # only correct-response tokens get a gradient, and the empty micro-batch contributes exactly 0
    correct_tokens = mask & (torch.tensor(REWARDS) == 1.0)[:, None]
    assert bool((grad[~correct_tokens] == 0).all()) and bool((grad[correct_tokens] < 0).all())
    from verl_ext.actor_loss import _correct_response_nll

    config = make_actor_config(loss_agg_mode="token-mean")
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=sum(LENGTHS), global_batch_size=6, loss_scale_factor=None
    )
    empty, fraction = _correct_response_nll(
        log_prob[[3, 4]], rewards[[3, 4]], mask[[3, 4]], _policy("micro_batch"), config
    )
    assert empty.item() == 0.0 and fraction == 0.0 and empty.requires_grad


def test_global_norm_is_the_policy_loss_normalisation_and_split_invariant() -> None:
    log_prob, rewards, mask = _mini_batch()
    correct_tokens = mask & (torch.tensor(REWARDS) == 1.0)[:, None]
    want = (-log_prob.detach().double())[correct_tokens].sum() / sum(LENGTHS)  # all tokens in the divisor
    for rows in (MICRO_BATCHES, [[0], [1], [2], [3], [4], [5]], [list(range(6))]):
        ours = _summed_over_micro_batches("global", log_prob, rewards, mask, rows)
        assert ours.item() == pytest.approx(want.item(), rel=1e-6), rows
    # micro_batch depends on the split (the reference's property), global does not
    one = _summed_over_micro_batches("micro_batch", log_prob, rewards, mask, [list(range(6))])
    three = _summed_over_micro_batches("micro_batch", log_prob, rewards, mask, MICRO_BATCHES)
    assert one.item() != pytest.approx(three.item(), rel=1e-3)


@pytest.mark.parametrize("norm", ["global", "micro_batch"])
def test_two_ranks_average_to_one_rank(norm: str) -> None:
    """FSDP averages gradients over data-parallel ranks; both normalisations scale by dp_size."""
    log_prob, rewards, mask = _mini_batch()
    single = _summed_over_micro_batches(norm, log_prob, rewards, mask, MICRO_BATCHES)
    rank0 = _summed_over_micro_batches(norm, log_prob, rewards, mask, MICRO_BATCHES[:1], dp_size=2)
    rank1 = _summed_over_micro_batches(norm, log_prob, rewards, mask, MICRO_BATCHES[1:], dp_size=2)
    assert ((rank0 + rank1) / 2).item() == pytest.approx(single.item(), rel=1e-6)


@pytest.mark.parametrize("norm", ["global", "micro_batch"])
def test_bf16_log_probs(norm: str) -> None:
    log_prob, rewards, mask = _mini_batch(torch.bfloat16)
    ours = _summed_over_micro_batches(norm, log_prob, rewards, mask, MICRO_BATCHES)
    reference = _summed_over_micro_batches(norm, log_prob.detach().float(), rewards, mask, MICRO_BATCHES)
    assert torch.isfinite(ours) and ours.item() == pytest.approx(reference.item(), rel=1e-2)
    (grad,) = torch.autograd.grad(ours, log_prob)
    assert grad.dtype == torch.bfloat16 and bool(torch.isfinite(grad.float()).all())


def test_bad_norm_names_the_key() -> None:
    from verl_ext.config import DivClipPolicyLossConfig

    with pytest.raises(
        ValueError, match=r"policy_loss\.correct_nll_norm must be one of \('global', 'micro_batch'\).*'reference'"
    ):
        DivClipPolicyLossConfig(loss_mode="clip", correct_nll_norm="reference")
    assert DivClipPolicyLossConfig(loss_mode="clip").correct_nll_norm == "global"


# ------------------------------------------------------------- inside verl's actor stack (TrainingWorker, FSDP2, CPU)

ENGINE_PROMPTS = [3, 5, 4, 6]
ENGINE_RESPONSES = [9, 4, 7, 6]
ENGINE_REWARDS = [1.0, -1.0, 1.0, -0.5]  # micro-batches of 2: [correct, wrong], [correct, no </think>]


def _engine_job(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from recipe.bench.harness import (
        TinyQwen3Spec,
        WorkerOptions,
        build_actor_worker,
        compute_log_prob,
        full_params,
        make_rollout_batch,
        update_actor,
    )
    from tests.helpers import EXACT_SGD, param_delta
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    batch = make_rollout_batch(
        ENGINE_PROMPTS,
        ENGINE_RESPONSES,
        TinyQwen3Spec().vocab_size,
        seed=5,
        advantages=[torch.zeros(r) for r in ENGINE_RESPONSES],
    )
    old = compute_log_prob(build_actor_worker(model_path, WorkerOptions(**EXACT_SGD)), batch)
    batch["old_log_probs"] = old["old_log_probs"]  # on-policy: the NLL is over the model's own log-probs
    scores = [torch.zeros(r) for r in ENGINE_RESPONSES]
    for row, reward in zip(scores, ENGINE_REWARDS, strict=False):
        row[-1] = reward
    # as verl's v1 trainer stores it: the rule reward as rm_scores, no token_level_rewards
    batch["rm_scores"] = torch.nested.as_nested_tensor(scores, layout=torch.jagged)
    out: dict[str, Any] = {"old": [t.clone() for t in old["old_log_probs"].unbind()]}
    for label, coef, norm in (("off", 0.0, "global"), ("global", 0.1, "global"), ("micro_batch", 0.1, "micro_batch")):
        config = make_actor_config(
            policy_loss=DivClipPolicyLossConfig(loss_mode="clip", correct_nll_coef=coef, correct_nll_norm=norm),
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
        )
        worker = build_actor_worker(model_path, WorkerOptions(**EXACT_SGD))
        worker.set_loss_fn(build_actor_loss(config))
        before = full_params(worker)
        metrics = update_actor(worker, batch, calculate_entropy=False)
        out[label] = {"metrics": metrics, "delta": param_delta(before, full_params(worker))}
    return out


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from recipe.bench.harness import TinyQwen3Spec, save_tiny_qwen3
    from tests.helpers import run_ranks

    model_path = save_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_nll"), TinyQwen3Spec(), seed=0)
    return run_ranks(_engine_job, 1, model_path)[0]


def _metric(metrics: dict[str, Any], key: str) -> float:
    value = metrics[key]
    return float(sum(value) if isinstance(value, list) else value)


def test_engine_nll_reads_rm_scores_and_matches_both_formulas(engine_run: dict[str, Any]) -> None:
    old = engine_run["old"]
    nll = [-lp.double() for lp in old]
    total_tokens = sum(ENGINE_RESPONSES)
    want_global = sum(nll[i].sum() for i in (0, 2)) / total_tokens
    want_micro = 2 / 4 * nll[0].mean() + 2 / 4 * nll[2].mean()  # one correct response per micro-batch
    assert _metric(engine_run["global"]["metrics"], "actor/divclip/correct_nll") == pytest.approx(
        want_global.item(), rel=1e-5
    )
    assert _metric(engine_run["micro_batch"]["metrics"], "actor/divclip/correct_nll") == pytest.approx(
        want_micro.item(), rel=1e-5
    )


def test_engine_nll_is_the_only_gradient_with_zero_advantages(engine_run: dict[str, Any]) -> None:
    assert all(bool((d == 0).all()) for d in engine_run["off"]["delta"].values())
    for label in ("global", "micro_batch"):
        assert any(bool((d != 0).any()) for d in engine_run[label]["delta"].values()), label
