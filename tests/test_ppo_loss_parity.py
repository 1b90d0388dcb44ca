"""The divclip actor loss is verl's ``ppo_loss`` plus metrics (issue 31, issue 36).

:func:`verl_ext.actor_loss.divclip_actor_loss` calls verl 0.9.1's ``verl.workers.utils.losses.ppo_loss``
and supplies the divclip registry entries what its signature lacks (both entropies, pi_old's top-k). It is
installed on the actor workers for every run, verl's own modes included. This module holds the two to the
same loss at the loss-function level, on micro-batches in verl's no-padding (nested) layout as the engine
hands them to the loss:

* **parity** (:func:`test_divclip_loss_is_ppo_loss`): for every verl mode registered in
  ``POLICY_LOSS_REGISTRY`` (the divclip entries excluded) and every case of :data:`CASES`, both losses run
  on the same micro-batch with the same ``ActorConfig`` -- once with verl's ``PolicyLossConfig``, once with
  ``DivClipPolicyLossConfig`` with no divclip knob set -- and give the same total loss, the same gradient
  with respect to the model's ``log_probs`` and ``entropy`` and the same metric values, bit for bit; the
  divclip modes against verl's ``ppo_loss`` with the paper's formula as its policy term
  (:func:`test_divclip_modes_run_inside_ppo_loss`: Eq. 5 from each constraint's definition, aggregated by
  verl's ``agg_loss``), to float32 rounding;
* **one divergence found and fixed** (:func:`test_the_gauge_measures_verls_clip_range_without_refusing_it`):
  the on-policy gauge validated the clip epsilons as the divclip modes need them and raised on verl
  modes with epsilons verl accepts (``clip_ratio_low >= 1``);
* **designed differences**, asserted explicitly: the divclip loss logs ``actor/divclip/path/seam``
  (the engine path, :func:`verl_ext.actor_loss.step_path_metrics`), on the update's on-policy
  mini-batch the on-policy gauge; and it aggregates metrics named
  ``*_min`` / ``*_max`` as MIN / MAX across micro-batches and ranks, where verl's ``ppo_loss`` averages
  every policy-loss metric.

What is covered elsewhere and not repeated here: ERC and dual-clip on verl's modes at the loss level
(``tests/test_verl_modes.py``), how MIN/MAX metrics reduce across micro-batches and ranks
(``test_verl_modes.py::test_extremes_aggregate_as_extremes_across_micro_batches_and_ranks``), the
divclip modes against verl's ``vanilla`` (``tests/test_losses.py::test_theorem_4_1_*``), rollout-correction
weights through the installed loss (``tests/test_rollout_correction.py``), and the loss inside verl's engine
(``tests/test_actor_loss_engine.py``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from tensordict import TensorDict
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import PolicyLossConfig
from verl.workers.utils import losses as verl_losses

from recipe.bench.harness import make_actor_config, make_rollout_batch

# verl_ext is imported inside the functions (as in the other loss tests): the plugin has registered the
# divclip modes with verl by now (tests/conftest.py imports verl).

PROMPT_LENS = [3, 5, 4, 6]
RESPONSE_LENS = [9, 4, 7, 6]
#: (row, first masked position) of the response mask: tokens the loss must skip inside a response
MASKED_TAILS = [(1, 3), (3, 2)]
VOCAB = 64
#: verl modes that need a config knob to run (no extra input)
MODE_KNOBS: dict[str, dict[str, Any]] = {"dro": {"dro_beta": 0.1}}
#: the modes the brief of issue 31 names; the parity test runs every registered verl mode
REQUIRED_MODES = {"vanilla", "gspo", "sapo", "clip_cov"}


def verl_modes() -> list[str]:
    """verl's own registered policy losses: the registry without the divclip entries."""
    from verl_ext.core.region import CONSTRAINTS
    from verl_ext.registry import ERC_ON_VERL_MODE

    return sorted(mode for mode in core_algos.POLICY_LOSS_REGISTRY if mode not in (*CONSTRAINTS, ERC_ON_VERL_MODE))


def _string_options(function: Callable[..., Any], variable: str) -> set[str]:
    """The string constants ``function``'s source compares ``variable`` with (``==`` or ``in (...)``)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    options: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == variable:
            for comparator in node.comparators:
                options |= {
                    c.value for c in ast.walk(comparator) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    return options


def accepted_kl_loss_types() -> list[str]:
    """Every ``actor.kl_loss_type`` verl's ``kl_penalty`` computes: the names ``kl_penalty_forward``
    dispatches on that do not raise (``full`` does), each also with the straight-through ``+`` suffix."""
    probe = torch.zeros(1, 2)
    base = []
    for name in sorted(_string_options(core_algos.kl_penalty_forward, "kl_penalty")):
        try:
            core_algos.kl_penalty(probe, probe, name)
        except NotImplementedError:
            continue
        base.append(name)
    return base + [f"{name}+" for name in base]


def loss_agg_modes() -> list[str]:
    """Every ``loss_agg_mode`` verl's ``agg_loss`` implements."""
    return sorted(_string_options(core_algos.agg_loss, "loss_agg_mode"))


# ------------------------------------------------------------------------------------------------
# The cases: one per key (or value of a key) ppo_loss reads
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParityCase:
    """One micro-batch setting: ``ActorConfig`` overrides and what the micro-batch carries.

    ``batch_num_tokens`` / ``global_batch_size`` of ``"global"`` stand for the global mini-batch's
    figures at ``dp_size`` ranks, as verl's engine computes them: the local sequence count times
    ``dp_size``, and the local token count times ``dp_size`` plus 5 (the other ranks hold other lengths).
    """

    name: str
    actor: dict[str, Any] = field(default_factory=dict)
    entropy: bool = False
    rollout_is_weights: bool = False
    ref_log_prob: bool = False
    dp_size: int = 1
    batch_num_tokens: Optional[str] = None
    global_batch_size: Optional[str] = None
    on_policy_mark: bool = False

    @property
    def globally_normalised(self) -> bool:
        """verl's rule for summing the loss metrics over micro-batches instead of averaging them."""
        return (
            self.dp_size > 1
            or self.batch_num_tokens is not None
            or self.global_batch_size is not None
            or self.actor.get("loss_scale_factor") is not None
        )


#: the actor's clip epsilons unless a case sets its own (DAPO clip-higher)
CLIP_RATIOS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28)
GLOBAL = dict(dp_size=2, batch_num_tokens="global", global_batch_size="global")
KL = dict(use_kl_loss=True, kl_loss_coef=0.25)

CASES: list[ParityCase] = [
    ParityCase("baseline"),
    ParityCase("entropy_bonus", actor=dict(entropy_coeff=0.37), entropy=True),
    ParityCase("entropy_without_bonus", entropy=True),  # entropy_coeff = 0: reported, zero gradient
    *[
        ParityCase(f"kl_loss/{kind}", actor=dict(KL, kl_loss_type=kind), ref_log_prob=True)
        for kind in accepted_kl_loss_types()
    ],
    ParityCase("ref_log_prob_without_kl_loss", ref_log_prob=True),
    ParityCase("loss_scale_factor/token-mean", actor=dict(loss_scale_factor=64)),  # changes the metric aggregation
    ParityCase(
        "loss_scale_factor/seq-mean-token-sum-norm",
        actor=dict(loss_scale_factor=64, loss_agg_mode="seq-mean-token-sum-norm"),
    ),  # and the value
    *[
        ParityCase(
            f"loss_agg_mode/{agg}",
            actor=dict(KL, loss_agg_mode=agg, entropy_coeff=0.37),
            entropy=True,
            ref_log_prob=True,
        )
        for agg in loss_agg_modes()
    ],
    ParityCase("rollout_is_weights", rollout_is_weights=True),
    *[
        ParityCase(
            f"global_batch/dp2/{agg}",
            actor=dict(KL, loss_agg_mode=agg, entropy_coeff=0.37),
            entropy=True,
            ref_log_prob=True,
            **GLOBAL,
        )
        for agg in loss_agg_modes()
    ],
    ParityCase("global_batch/batch_num_tokens_only", batch_num_tokens="global"),
    ParityCase(
        "global_batch/global_batch_size_only",
        actor=dict(loss_agg_mode="seq-mean-token-mean"),
        global_batch_size="global",
    ),
    ParityCase(
        "everything",
        actor=dict(
            KL, kl_loss_type="k3+", entropy_coeff=0.37, loss_scale_factor=64, loss_agg_mode="seq-mean-token-sum-norm"
        ),
        entropy=True,
        rollout_is_weights=True,
        ref_log_prob=True,
        **GLOBAL,
    ),
    ParityCase("on_policy_mark", entropy=True, on_policy_mark=True),
    # verl's modes accept epsilons the divclip modes refuse (CISPO without lower truncation): the gauge of
    # the on-policy mini-batch must measure, not raise (it raised a ValueError before issue 31's fix)
    ParityCase("on_policy_mark/clip_ratio_low_1", actor=dict(clip_ratio_low=1.0), on_policy_mark=True),
]
CASE_NAMES = [case.name for case in CASES]


# ------------------------------------------------------------------------------------------------
# Micro-batches in verl's no-padding layout, and one run of a loss
# ------------------------------------------------------------------------------------------------


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def make_micro_batch(case: ParityCase, seed: int = 0) -> TensorDict:
    """The micro-batch as verl's engine hands it to the loss: nested per-response fields, the
    response mask with some masked tokens, and the global batch info as non-tensor data."""
    data = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, VOCAB, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    masks = [torch.ones(n, dtype=torch.int64) for n in RESPONSE_LENS]
    for row, start in MASKED_TAILS:
        masks[row][start:] = 0
    data["response_mask"], data["loss_mask"] = _nested(masks), _nested([m.clone() for m in masks])
    old = data["old_log_probs"].unbind()
    if case.rollout_is_weights:
        data["rollout_is_weights"] = _nested([0.5 + 1.5 * torch.rand(n, generator=gen) for n in RESPONSE_LENS])
    if case.ref_log_prob:
        data["ref_log_prob"] = _nested([lp + 0.4 * torch.randn(lp.shape, generator=gen) for lp in old])
    local_tokens, local_rows = sum(int(m.sum()) for m in masks), len(RESPONSE_LENS)
    tu.assign_non_tensor(
        data,
        dp_size=case.dp_size,
        batch_num_tokens=local_tokens * case.dp_size + 5 if case.batch_num_tokens == "global" else None,
        global_batch_size=local_rows * case.dp_size if case.global_batch_size == "global" else None,
    )
    if case.on_policy_mark:
        from verl_ext.engine.packing import ON_POLICY_KEY

        tu.assign_non_tensor(data, **{ON_POLICY_KEY: True})
    return data


def model_output_values(data: TensorDict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Flat per-token values of the engine's output over every prompt + response token: log-probs
    whose response positions are pi_old's plus noise (ratios around 1, some clipped), and entropies."""
    gen = torch.Generator().manual_seed(seed + 2)
    total = sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    log_probs = -4.0 * torch.rand(total, generator=gen)
    start = 0
    for prompt, response, old in zip(PROMPT_LENS, RESPONSE_LENS, data["old_log_probs"].unbind(), strict=False):
        # the model's output at position t predicts token t + 1: the response sits one to the left
        log_probs[start + prompt - 1 : start + prompt - 1 + response] = old + 0.35 * torch.randn(
            response, generator=gen
        )
        start += prompt + response
    return {"log_probs": log_probs, "entropy": 0.2 + 3.0 * torch.rand(total, generator=gen)}


@dataclass
class LossRun:
    """What one call of a loss gives: the loss, its gradients and its metrics."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]
    metrics: dict[str, Any]


def run_loss(
    loss_fn: Callable[..., Any], config: Any, data: TensorDict, values: dict[str, torch.Tensor], with_entropy: bool
) -> LossRun:
    """``loss_fn(config, model_output, data)`` with leaf per-token values, as the engine calls it."""
    offsets = torch.tensor([0] + [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=False)]).cumsum(0)
    leaves = {
        name: value.clone().requires_grad_(True)
        for name, value in values.items()
        if name == "log_probs" or with_entropy
    }
    model_output = {
        name: torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets) for name, leaf in leaves.items()
    }
    torch.manual_seed(0)  # clip_cov draws a random subset of its candidates
    loss, metrics = loss_fn(config, model_output, data.clone())
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=False))
    return LossRun(loss.detach(), grads, metrics)


def actor_configs(mode: str, case: ParityCase) -> dict[str, Any]:
    """The one ``ActorConfig`` both losses get, with verl's policy-loss config and with the divclip one
    (no divclip knob set)."""
    from verl_ext.config import DivClipPolicyLossConfig

    knobs = MODE_KNOBS.get(mode, {})
    return {
        kind: make_actor_config(policy_loss=policy(loss_mode=mode, **knobs), **{**CLIP_RATIOS, **case.actor})
        for kind, policy in (("verl", PolicyLossConfig), ("divclip", DivClipPolicyLossConfig))
    }


# ------------------------------------------------------------------------------------------------
# The designed differences
# ------------------------------------------------------------------------------------------------


def divclip_only_metrics(case: ParityCase) -> set[str]:
    """Metrics only the divclip loss logs, by design: the engine path it measured (here ``seam = 0``:
    no seam stepped these hand-built micro-batches), on the update's on-policy mini-batch the on-policy
    gauge (docs/losses.md, "The gauge"). (The rollout-correction weights' mean of a divclip mode comes from
    its registered function, which ``ppo_loss`` calls in both.)"""
    gauge = {"actor/divclip/onpolicy/log_ratio_abs_max", "actor/divclip/onpolicy/ratio_clipfrac"}
    return {"actor/divclip/path/seam"} | (gauge if case.on_policy_mark else set())


def divclip_aggregation(name: str, verl_aggregation: AggregationType) -> AggregationType:
    """The divclip loss reduces extremes as extremes (``*_min`` MIN, ``*_max`` MAX: the logged value is
    the extreme over micro-batches and ranks, not a mean of per-micro-batch extremes); verl's
    ``ppo_loss`` gives every policy-loss metric MEAN. Everything else is verl's aggregation."""
    if name.endswith("_min"):
        return AggregationType.MIN
    if name.endswith("_max"):
        return AggregationType.MAX
    return verl_aggregation


def assert_same_run(verl_run: LossRun, ours: LossRun, case: ParityCase) -> None:
    """Bit-equal loss, gradients and metric values; metric sets and aggregations as designed."""
    assert torch.equal(ours.loss, verl_run.loss), (ours.loss.item(), verl_run.loss.item())
    assert ours.grads.keys() == verl_run.grads.keys()
    for name, grad in verl_run.grads.items():
        assert torch.equal(ours.grads[name], grad), f"d loss / d {name} differs"
    assert set(ours.metrics) - set(verl_run.metrics) == divclip_only_metrics(case)
    assert set(verl_run.metrics) <= set(ours.metrics), set(verl_run.metrics) - set(ours.metrics)
    for name, expected in verl_run.metrics.items():
        got = ours.metrics[name]
        if not isinstance(expected, Metric):  # kl_coef: a plain float in both
            assert type(got) is type(expected) and got == expected, name
            continue
        assert got.values == expected.values, name  # floats from .item(): bit equality
        assert got.aggregation == divclip_aggregation(name, expected.aggregation), name


# ------------------------------------------------------------------------------------------------
# Parity
# ------------------------------------------------------------------------------------------------


def test_the_parity_runs_every_verl_mode_and_option() -> None:
    """The derived lists are what the cases claim to cover (a verl that renames them fails here)."""
    from tests.test_verl_modes import VERL_MODES

    modes = set(verl_modes())
    assert REQUIRED_MODES | set(VERL_MODES) <= modes, (REQUIRED_MODES | set(VERL_MODES)) - modes
    assert {"low_var_kl", "k3", "kl", "k1", "abs", "mse", "k2", "k3+", "low_var_kl+"} <= set(accepted_kl_loss_types())
    assert set(loss_agg_modes()) == {
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    }
    assert len(set(CASE_NAMES)) == len(CASE_NAMES)


@pytest.mark.parametrize("case", CASES, ids=CASE_NAMES)
@pytest.mark.parametrize("mode", verl_modes())
def test_divclip_loss_is_ppo_loss(mode: str, case: ParityCase) -> None:
    from verl_ext.actor_loss import divclip_actor_loss

    data = make_micro_batch(case)
    values = model_output_values(data)
    for kind, config in actor_configs(mode, case).items():
        verl_run = run_loss(verl_losses.ppo_loss, config, data, values, case.entropy)
        ours = run_loss(divclip_actor_loss, config, data, values, case.entropy)
        assert torch.isfinite(verl_run.loss), kind
        assert_same_run(verl_run, ours, case)
        # the case exercises what it names: the loss metrics' aggregation follows the global batch info
        expected = AggregationType.SUM if case.globally_normalised else AggregationType.MEAN
        assert ours.metrics["actor/pg_loss"].aggregation == expected
        assert ("actor/entropy_loss" in ours.metrics) == case.entropy
        assert ("kl_loss" in ours.metrics) == bool(case.actor.get("use_kl_loss"))


#: the divclip modes ``ppo_loss`` can run from its own inputs (``kl_full`` needs pi_old's top-k from the engine)
DIVCLIP_PARITY_MODES = ("clip", "kl3", "kl1", "kl2", "is_kl3", "trgppo", "dcpo", "gppo", "seq_kl3")
#: the cases whose inputs reach the divclip registry entry itself (weights, aggregation, global batch, the scale
#: factor), or verl's terms beside it (KL, bonus)
DIVCLIP_PARITY_CASES = (
    "baseline",
    "entropy_bonus",
    "loss_scale_factor/seq-mean-token-sum-norm",
    "rollout_is_weights",
    "global_batch/global_batch_size_only",
    "everything",
    "on_policy_mark",
)


def paper_formula_entry(mode: str) -> Callable[..., tuple[torch.Tensor, dict[str, Any]]]:
    """A policy-loss registry entry computing divclip ``mode`` from the paper's formula: Eq. 5 token by token
    (:func:`tests.loss_reference.reference_surrogate_matrix`, each constraint from its definition), times the
    rollout-correction weights, aggregated by verl's own ``agg_loss`` with the global batch info ``ppo_loss``
    fills in (``loss_scale_factor`` included). No divclip code runs in it."""
    from tests.loss_reference import RefKnobs, reference_surrogate_matrix

    def policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode="token-mean",
        config=None,
        rollout_is_weights=None,
    ):
        knobs = RefKnobs(mode=mode, eps_low=config.clip_ratio_low, eps_high=config.clip_ratio_high)
        surrogate = reference_surrogate_matrix(old_log_prob, log_prob, advantages, response_mask, knobs)
        if rollout_is_weights is not None:
            surrogate = surrogate * rollout_is_weights
        loss = -core_algos.agg_loss(
            loss_mat=surrogate, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **config.global_batch_info
        )
        return loss, {}

    return policy_loss


DIVCLIP_CASES = [c for c in CASES if c.name in DIVCLIP_PARITY_CASES]


@pytest.mark.parametrize("case", DIVCLIP_CASES, ids=[c.name for c in DIVCLIP_CASES])
@pytest.mark.parametrize("mode", DIVCLIP_PARITY_MODES)
def test_divclip_modes_run_inside_ppo_loss(mode: str, case: ParityCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """A divclip mode through the installed loss is verl's ``ppo_loss`` with the paper's formula as its policy
    term: the same loss and gradients (to float32 rounding) as verl's ``ppo_loss`` called with a registry entry
    that computes Eq. 5 from each constraint's definition and aggregates with verl's ``agg_loss``
    (:func:`paper_formula_entry`); verl's own terms (KL loss, entropy bonus) report the same values; the
    metrics the registered function adds are there."""
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.region import CONSTRAINTS

    assert set(DIVCLIP_PARITY_MODES) == set(CONSTRAINTS) - {"kl_full"}
    reference_mode = f"test_paper_formula_{mode}"
    monkeypatch.setitem(core_algos.POLICY_LOSS_REGISTRY, reference_mode, paper_formula_entry(mode))
    data = make_micro_batch(case)
    values = model_output_values(data)
    config = make_actor_config(policy_loss=DivClipPolicyLossConfig(loss_mode=mode), **{**CLIP_RATIOS, **case.actor})
    reference_config = make_actor_config(
        policy_loss=PolicyLossConfig(loss_mode=reference_mode), **{**CLIP_RATIOS, **case.actor}
    )
    reference = run_loss(verl_losses.ppo_loss, reference_config, data, values, case.entropy)
    ours = run_loss(divclip_actor_loss, config, data, values, case.entropy)
    assert torch.isfinite(reference.loss) and "actor/divclip/kl3_mean" in ours.metrics
    torch.testing.assert_close(ours.loss, reference.loss, rtol=1e-5, atol=1e-7)
    assert ours.grads.keys() == reference.grads.keys()
    for name, grad in reference.grads.items():
        torch.testing.assert_close(ours.grads[name], grad, rtol=1e-5, atol=1e-8, msg=f"d loss / d {name}")
    assert (ours.grads["log_probs"] != 0).any()
    assert ours.metrics["actor/pg_loss"].values == pytest.approx(reference.metrics["actor/pg_loss"].values, rel=1e-5)
    for name in ("actor/entropy_loss", "kl_loss"):
        assert (name in ours.metrics) == (name in reference.metrics)
        if name in ours.metrics:
            assert ours.metrics[name].values == reference.metrics[name].values, name
    assert ("actor/divclip/rollout_is_weight_mean" in ours.metrics) == case.rollout_is_weights


def test_the_options_change_the_loss() -> None:
    """The parity cases are not vacuous: each option moves verl's loss or gradient on this micro-batch."""
    baseline = next(case for case in CASES if case.name == "baseline")

    def run(case: ParityCase) -> LossRun:
        data = make_micro_batch(case)
        return run_loss(
            verl_losses.ppo_loss, actor_configs("vanilla", case)["verl"], data, model_output_values(data), case.entropy
        )

    reference = run(baseline)
    for case in CASES:
        if case.name in (
            "baseline",
            "ref_log_prob_without_kl_loss",
            "entropy_without_bonus",
            "on_policy_mark",
            "loss_scale_factor/token-mean",
        ):
            continue  # the same loss as the baseline by construction (metrics or no-op options only)
        other = run(case)
        changed = not torch.equal(other.loss, reference.loss) or not torch.equal(
            other.grads["log_probs"], reference.grads["log_probs"]
        )
        assert changed, case.name
    entropy_run = run(next(case for case in CASES if case.name == "entropy_bonus"))
    assert (entropy_run.grads["entropy"] != 0).any()


def test_kl_loss_without_ref_log_prob_fails_in_both() -> None:
    """``use_kl_loss`` on a micro-batch without ``ref_log_prob``: verl raises a KeyError, and so does
    the divclip loss (neither silently drops the KL term)."""
    from verl_ext.actor_loss import divclip_actor_loss

    case = ParityCase("kl_without_ref", actor=dict(KL))
    data = make_micro_batch(case)
    for config in actor_configs("vanilla", case).values():
        for loss_fn in (verl_losses.ppo_loss, divclip_actor_loss):
            with pytest.raises(KeyError, match="ref_log_prob"):
                run_loss(loss_fn, config, data, model_output_values(data), with_entropy=False)


def test_the_gauge_measures_verls_clip_range_without_refusing_it() -> None:
    """Issue 31's divergence: on the on-policy mini-batch the divclip loss validated the actor's clip
    epsilons as the divclip modes need them (``clip_ratio_low`` in [0, 1)) and raised for a verl mode
    that verl runs, e.g. CISPO with ``clip_ratio_low = 1`` (no lower truncation). Now the gauge reads the
    range as verl's losses do: the lower bound 1 - 1 = 0 counts no token, the upper bound 1.28 does."""
    from verl_ext.actor_loss import divclip_actor_loss

    case = next(case for case in CASES if case.name == "on_policy_mark/clip_ratio_low_1")
    data = make_micro_batch(case)
    values = model_output_values(data)
    ours = run_loss(divclip_actor_loss, actor_configs("cispo", case)["verl"], data, values, False)
    log_ratio = values["log_probs"].new_zeros(0)
    start = 0
    for prompt, response, old, mask in zip(
        PROMPT_LENS, RESPONSE_LENS, data["old_log_probs"].unbind(), data["response_mask"].unbind(), strict=False
    ):
        new = values["log_probs"][start + prompt - 1 : start + prompt - 1 + response]
        log_ratio = torch.cat([log_ratio, (new - old)[mask.bool()]])
        start += prompt + response
    above = float((log_ratio.exp() > 1.28).float().mean())
    assert 0 < above < 1
    assert ours.metrics["actor/divclip/onpolicy/ratio_clipfrac"].values == [pytest.approx(above)]


def test_extreme_metrics_aggregate_as_extremes_by_design() -> None:
    """The one designed difference in shared metrics: verl's ``bypass_mode`` logs per-micro-batch
    extremes (``rollout_corr/rollout_is_max``, ``..._min``, ...) that verl's ``ppo_loss`` averages over
    micro-batches and ranks; the divclip loss keeps them extremes (MIN/MAX), as it does for its own
    ``erc/ratio_min|max`` and ``kl3_max``, so the logged max is the batch's max. Same values, per
    micro-batch; only the reduction differs (the reduction itself is tested in
    ``test_verl_modes.py::test_extremes_aggregate_as_extremes_across_micro_batches_and_ranks``)."""
    from verl_ext.actor_loss import divclip_actor_loss

    case = CASES[0]
    data = make_micro_batch(case)
    config = actor_configs("bypass_mode", case)["verl"]
    verl_run = run_loss(verl_losses.ppo_loss, config, data, model_output_values(data), False)
    ours = run_loss(divclip_actor_loss, config, data, model_output_values(data), False)
    extremes = {name for name in verl_run.metrics if name.endswith(("_min", "_max"))}
    assert {"rollout_corr/rollout_is_max", "rollout_corr/rollout_is_min"} <= extremes
    for name in extremes:
        assert verl_run.metrics[name].aggregation == AggregationType.MEAN
        assert ours.metrics[name].aggregation == (AggregationType.MIN if name.endswith("_min") else AggregationType.MAX)
        assert ours.metrics[name].values == verl_run.metrics[name].values


def test_verl_modes_get_the_policy_loss_inputs_ppo_loss_hands_them() -> None:
    """The keyword arguments of ``ppo_loss``'s registry call are the ones ``verl_policy_loss`` passes:
    a verl that hands its policy losses a new input fails here, naming it."""
    from verl_ext import verl_modes

    def registry_call_keywords(function: Callable[..., Any], callee: str) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == callee]
        assert len(calls) == 1, callee
        return {keyword.arg for keyword in calls[0].keywords}

    verl_keywords = registry_call_keywords(verl_losses.ppo_loss, "policy_loss_fn")
    ours = registry_call_keywords(verl_modes.verl_policy_loss, "get_policy_loss_fn(mode)")
    assert (
        verl_keywords
        == ours
        == {"old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "config", "rollout_is_weights"}
    )
