"""The actor loss installed with ``set_loss_fn``: verl's own ``ppo_loss``, with what its registry signature lacks
(both entropies, pi_old's top-k) supplied for one call, and a declaration of what its engine must do
(docs/upstream.md; docs/losses.md, "Where ERC gets its entropies"; docs/engine.md).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from tensordict import TensorDict
from verl.trainer.ppo.core_algos import agg_loss
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from verl_ext.config import CONFIG_TARGET, DivClipPolicyLossConfig, actor_clip_range
from verl_ext.config_rules.policy import check_entropy_as_mask
from verl_ext.core import key_reads
from verl_ext.core.coarsened_kl import TopKLogMasses
from verl_ext.core.erc import entropy_ratio, outside_band
from verl_ext.core.gauge import on_policy_gauge
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.surrogate import outside_trust_region
from verl_ext.engine.packing import is_on_policy
from verl_ext.engine.request import STEP_PATH_KEY, declare, entropy_as_mask
from verl_ext.engine.topk_capture import NEW_TOPK_LOG_PROBS, OLD_TOPK_LOG_PROBS
from verl_ext.registry import ERC_ON_VERL_MODE, LossInputs, resolve_policy_config, supplying
from verl_ext.token_dump import TokenDumpWriter
from verl_ext.verl_modes import VERL_MODE_READS

#: The key verl builds the actor config from (the recorder of verl keys read: verl_ext.core.key_reads).
ACTOR_KEY = "actor_rollout_ref.actor"


def divclip_actor_loss(
    config: ActorConfig, model_output: dict[str, Any], data: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss``, with what its policy-loss registry cannot pass supplied to the registered function,
    plus what is no loss term (docs/upstream.md). ``model_output``: ``log_probs`` (nested, no padding) and, with
    ``calculate_entropy``, ``entropy``; ``data``: the micro-batch, with pi_old's ``entropy`` when ERC is on."""
    mode = config.policy_loss.get("loss_mode", "vanilla")
    policy = divclip_policy_config(config)
    erc = policy is not None and policy.erc_enabled
    topk_stored = mode in CONSTRAINTS and policy.stores_old_topk
    needs_rewards = policy is not None and policy.correct_nll_coef > 0
    on_policy = is_on_policy(data)

    fields = ["response_mask", "old_log_probs"]
    if erc:
        fields.append(_require(data, "entropy", "ERC needs pi_old's per-token entropy (data['entropy'])"))
        if model_output.get("entropy") is None:
            raise ValueError(
                "ERC needs the current per-token entropy, but the engine returned none: set "
                "actor_rollout_ref.actor.calculate_entropy=True"
            )
    if topk_stored:
        _require(data, OLD_TOPK_LOG_PROBS, _TOPK_WHY.format(mode=mode))
        if NEW_TOPK_LOG_PROBS not in model_output:
            raise ValueError(
                f"{_TOPK_WHY.format(mode=mode)}, but the engine returned no {NEW_TOPK_LOG_PROBS!r}: the engine "
                "seam (verl_ext.engine.seam.install) is not installed in this process, or the engine is not one it "
                "covers"
            )
    if needs_rewards:
        # verl's v1 trainer stores the rule reward as rm_scores and writes token_level_rewards back
        # only with algorithm.use_kl_in_reward (then it holds the KL-penalised reward).
        reward_field = "token_level_rewards" if "token_level_rewards" in data else "rm_scores"
        fields.append(
            _require(data, reward_field, "policy_loss.correct_nll_coef > 0 needs token_level_rewards or rm_scores")
        )

    padded = data.select(*fields).to_padded_tensor() if (erc or on_policy or needs_rewards or topk_stored) else None
    log_prob = entropy = None
    if padded is not None:
        response_mask = padded["response_mask"].to(bool)
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        if erc:
            entropy = no_padding_2_padding(model_output["entropy"], data)
    if erc and config.entropy_coeff == 0:
        # ERC without a bonus uses the entropy only as a mask: verl's (no-op) bonus term gets it detached, so
        # no backward runs through it (with verl's fused kernels it would otherwise run for nothing)
        model_output = {**model_output, "entropy": model_output["entropy"].detach()}

    inputs = LossInputs(
        old_entropy=padded["entropy"] if erc else None,
        entropy=entropy,
        topk=TopKLogMasses(
            old=padded_response(data[OLD_TOPK_LOG_PROBS], response_mask.shape[-1]),
            new=padded_response(model_output[NEW_TOPK_LOG_PROBS], response_mask.shape[-1]),
        )
        if topk_stored
        else None,
    )
    loss_config = config
    if mode not in CONSTRAINTS and erc:  # verl's own mode: ERC_ON_VERL_MODE gates its policy term
        inputs = dataclasses.replace(inputs, verl_mode=mode, verl_config=config)
        loss_config = _with_policy_loss(config, loss_mode=ERC_ON_VERL_MODE)
    with supplying(inputs):
        policy_loss, metrics = ppo_loss(loss_config, model_output, data, dp_group)
    metrics = {name: _as_extreme(name, metric) for name, metric in metrics.items()}
    extra: dict[str, float] = step_path_metrics(data)

    if on_policy:
        # pi_theta == pi_old up to arithmetic here: the gauge shows what the kernels add (detached)
        # not validated: verl's modes accept epsilons the divclip modes refuse (CISPO's clip_ratio_low >= 1), and a
        # diagnostic must not make a loss raise where verl's ppo_loss runs
        clip_low, clip_high = actor_clip_range(config)
        outside = outside_mode_rule(
            mode, policy, padded["old_log_probs"], log_prob, response_mask, clip_low, clip_high, inputs.topk
        )
        extra.update(
            (f"actor/divclip/{name}", value)
            for name, value in on_policy_gauge(
                padded["old_log_probs"],
                log_prob,
                response_mask,
                clip_low,
                clip_high,
                old_entropy=inputs.old_entropy,
                entropy=entropy,
                erc_band=(policy.erc_beta_low, policy.erc_beta_high, policy.erc_eps) if erc else None,
                outside=outside,
            ).items()
        )
    if erc and policy.token_dump_path is not None:
        _dump_tokens(policy, data, padded["old_log_probs"], inputs.old_entropy, entropy, response_mask)
    metrics.update({name: Metric(value=value, aggregation=_aggregation_of(name)) for name, value in extra.items()})

    if needs_rewards:
        nll_loss, correct_fraction = _correct_response_nll(
            log_prob, padded[reward_field], response_mask, policy, config
        )
        policy_loss = policy_loss + policy.correct_nll_coef * nll_loss
        metrics["actor/divclip/correct_nll"] = Metric(value=nll_loss, aggregation=metrics["actor/pg_loss"].aggregation)
        metrics["actor/divclip/correct_fraction"] = Metric(value=correct_fraction, aggregation=AggregationType.MEAN)

    return policy_loss, metrics


def _as_extreme(name: str, metric: Any) -> Any:
    """``*_min`` / ``*_max`` metrics stay extremes across micro-batches and ranks (verl's ``ppo_loss`` averages
    every policy-loss metric); everything else as ``ppo_loss`` aggregates it."""
    aggregation = _aggregation_of(name)
    if isinstance(metric, Metric) and aggregation != AggregationType.MEAN:
        metric.aggregation = aggregation
    return metric


def _with_policy_loss(config: ActorConfig, **changes: Any) -> ActorConfig:
    """A shallow view of the (frozen) actor config with ``policy_loss`` fields changed. Shallow on purpose:
    ``global_batch_info``, which ``ppo_loss`` fills per micro-batch, stays the config's own dict."""
    view = copy.copy(config)
    policy = copy.copy(config.policy_loss)
    for name, value in changes.items():
        object.__setattr__(policy, name, value)
    object.__setattr__(view, "policy_loss", policy)
    return view


PATH_METRIC = "actor/divclip/path/"


def step_path_metrics(data: TensorDict) -> dict[str, float]:
    """``actor/divclip/path/*`` of this micro-batch as the engine seam recorded them for its step
    (:data:`verl_ext.engine.request.STEP_PATH_KEY`): ``seam``, ``entropy_fp32``, ``vocab_pass``,
    ``pack_old_log_prob_as_update`` (each 1 when taken) and ``old_log_prob_from_update`` (the share of rows whose
    pi_old is the update's own forward). A step the seam never saw reports ``seam = 0``: measured, not claimed."""
    path = tu.get_non_tensor_data(data=data, key=STEP_PATH_KEY, default=None)
    if path is None:
        return {f"{PATH_METRIC}seam": 0.0}
    return {f"{PATH_METRIC}{name}": float(value) for name, value in dict(path).items()}


def padded_response(nested: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(batch, max_len, C)`` from a nested ``(batch, j, C)`` field, zero-padded. By hand: ``to_padded_tensor``
    of a 3-D jagged tensor without ``max_seqlen`` metadata pads to the total token count."""
    values, lengths = nested.values(), nested.offsets().diff()
    start = int(nested.offsets()[0])
    out = values.new_zeros((len(lengths), max_len, values.shape[-1]))
    for row, length in enumerate(lengths.tolist()):
        out[row, :length] = values[start : start + length]
        start += length
    return out


def outside_mode_rule(
    mode: str,
    policy: Optional[DivClipPolicyLossConfig],
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    topk: Optional[TopKLogMasses] = None,
) -> Optional[torch.Tensor]:
    """The tokens ``mode``'s own clip rule puts outside its trust region, for the gauge's ``ratio_clipfrac``: a
    divclip constraint's, a verl mode's declared rule (:data:`verl_ext.verl_modes.VERL_MODE_READS`; all inside
    for a mode without a clip), or None (the actor's clip interval) for an undeclared verl mode."""
    if mode in CONSTRAINTS:
        return outside_trust_region(
            mode,
            old_log_prob,
            log_prob,
            response_mask,
            policy=policy,
            clip_ratio_low=clip_low,
            clip_ratio_high=clip_high,
            topk=topk,
        )
    declared = VERL_MODE_READS.get(mode)
    if declared is None:
        return None
    mask = response_mask.bool()
    if declared.outside is None:
        return torch.zeros_like(mask)
    old = old_log_prob.detach().float()
    # unclamped, as verl decides: its +-20 clamp of log w (vanilla, cispo, ...) moves no token across a bound,
    # and GSPO's sequence mean and DPPO's probabilities are taken from the unclamped log-probs
    log_ratio = log_prob.detach().float() - old
    return declared.outside(log_ratio, old, mask, clip_low, clip_high) & mask


def _aggregation_of(metric_name: str) -> AggregationType:
    """Extremes stay extremes across micro-batches and ranks (``erc/ratio_min``, ``kl3_max``, ...);
    everything else is a per-micro-batch mean, averaged."""
    if metric_name.endswith("_min"):
        return AggregationType.MIN
    if metric_name.endswith("_max"):
        return AggregationType.MAX
    return AggregationType.MEAN


def _correct_response_nll(
    log_prob: torch.Tensor,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    policy: DivClipPolicyLossConfig,
    config: ActorConfig,
) -> tuple[torch.Tensor, float]:
    """NLL over the tokens of correct responses (released ERC scripts), normalised by ``correct_nll_norm``:
    ``"global"`` as the policy loss (with ``token-mean``: by every response token of the mini-batch);
    ``"micro_batch"`` the correct tokens' mean in this micro-batch (0 without any) times its share of the
    mini-batch's sequences, ``n_micro / (global_batch_size / dp_size)`` (docs/losses.md has the formula)."""
    correct = token_level_rewards.sum(-1) == policy.correct_reward
    mask = response_mask & correct.unsqueeze(-1)
    batch_info = config.global_batch_info
    if policy.correct_nll_norm == "micro_batch":
        if not mask.any():
            nll = (log_prob * mask).sum()  # zero, on the graph
        else:
            nll = agg_loss(
                loss_mat=-log_prob,
                loss_mask=mask,
                loss_agg_mode=config.loss_agg_mode,
                loss_scale_factor=batch_info.get("loss_scale_factor"),
            )
        global_batch_size = batch_info.get("global_batch_size")
        if global_batch_size:
            nll = nll * (log_prob.shape[0] * batch_info.get("dp_size", 1) / global_batch_size)
    else:
        nll = agg_loss(loss_mat=-log_prob, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **batch_info)
    return nll, correct.float().mean().item()


_DUMP_WRITERS: dict[str, TokenDumpWriter] = {}
_UPDATE_CALLS = [0]


def _dump_tokens(
    policy: DivClipPolicyLossConfig,
    data: TensorDict,
    old_log_prob: torch.Tensor,
    old_entropy: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
) -> None:
    """Opt-in per-token dump (ERC Figure 3). The step is verl's ``global_steps`` when the batch
    carries it, else this process's count of loss calls (documented in docs/evaluation.md)."""
    writer = _DUMP_WRITERS.get(policy.token_dump_path)
    if writer is None:
        writer = TokenDumpWriter(policy.token_dump_path, policy.token_dump_every_n_steps, policy.token_dump_max_tokens)
        _DUMP_WRITERS[policy.token_dump_path] = writer
    _UPDATE_CALLS[0] += 1
    step = tu.get_non_tensor_data(data=data, key="global_steps", default=None)
    step = int(step) if step is not None else _UPDATE_CALLS[0]
    if not writer.wants(step):
        return
    rho = entropy_ratio(old_entropy, entropy, response_mask, policy.erc_eps)
    clipped = outside_band(rho, policy.erc_beta_low, policy.erc_beta_high)
    writer.maybe_dump(step, old_log_prob.float(), rho, clipped, response_mask)


_TOPK_WHY = (
    "loss_mode={mode!r} with policy_loss.loss_mode=kl_full or kl_full_diagnostic=True needs pi_old's top-k, "
    "stored by the old-log-prob pass of recipe.trainer.DivClipTrainer"
)


def _require(data: TensorDict, key: str, why: str) -> str:
    if key not in data:
        raise KeyError(f"{why}, but the micro-batch has no '{key}' (fields: {sorted(data.keys())})")
    return key


def build_actor_loss(actor_config: ActorConfig) -> Callable[..., Any]:
    """The loss to install with ``actor_rollout_ref_wg.set_loss_fn``: a picklable partial carrying what its engine
    must do (:mod:`verl_ext.engine.request`): with ERC, the one float32 graph-free entropy in both passes (so
    ``entropy_coeff != 0``, which needs its gradient, raises); the vocabulary pass; and the old-log-prob pass
    packed as the update (always with verl's plain policy-loss config). Unpickled, it installs the seam."""
    key_reads.bind(actor_config, ACTOR_KEY)
    loss = functools.partial(divclip_actor_loss, config=actor_config)
    policy = divclip_policy_config(actor_config)
    if policy is not None and policy.erc_enabled:
        check_entropy_as_mask(entropy_coeff=actor_config.entropy_coeff)  # raises on an entropy bonus
        loss = entropy_as_mask(loss)
    loss = declare(
        loss,
        vocab_pass=policy is not None and policy.vocab_pass,  # both passes of this engine: no logits tensor
        pack_old_log_prob_as_update=policy is None or policy.pack_old_log_prob_as_update,  # on-policy ratios exactly 1
    )
    actor_loss = ActorLoss(loss.func, *loss.args, **loss.keywords)
    vars(actor_loss).update(vars(loss))  # the engine request
    return actor_loss


class ActorLoss(functools.partial):
    """The actor loss as it travels: a ``functools.partial`` whose unpickling in the worker ``set_loss_fn`` sends it
    to installs the engine seam (:func:`verl_ext.engine.seam.install`, idempotent), so the seam is in exactly the
    processes that run the loss: building or importing it installs nothing."""

    def __setstate__(self, state: Any) -> None:
        from verl_ext.engine import seam

        seam.install()
        super().__setstate__(state)


def divclip_policy_config(config: ActorConfig) -> Optional[DivClipPolicyLossConfig]:
    """The actor's ``DivClipPolicyLossConfig`` (required by the divclip modes; for verl's when selected with the
    divclip ``_target_``), checked against the mode registry, so building the loss and every call of it refuse a
    config that does not fit its mode."""
    mode = config.policy_loss.get("loss_mode", "vanilla")
    if mode in CONSTRAINTS:
        return resolve_policy_config(config)
    policy = config.policy_loss
    is_divclip = isinstance(policy, DivClipPolicyLossConfig) or (
        isinstance(policy, Mapping) and policy.get("_target_") == CONFIG_TARGET
    )
    return resolve_policy_config(config) if is_divclip else None
