"""On-policy exactness: the old-log-prob pass packed as the update, and a live gauge of the noise.

Before the first optimizer step of a training step, pi_theta *is* pi_old, so every importance ratio
should be exactly 1 and ERC's entropy ratio rho_t = (H_t + eps) / (H_old,t + eps) too. That holds
only if both passes compute each token's logits with the same arithmetic. A matrix product is not
batch-invariant: its rows change in their last bits with the number of tokens in the micro-batch (CPU
blocking; cuBLAS kernel and split-K choice by shape). Under verl's default bf16 the LM head rounds
the logits to bf16, where one ulp at |x| ~ 16-32 is 0.125, and a confident token's entropy
~ sum_v e^{-g_v}(1 + g_v) moves by ~13% per ulp of its top-logit gap -- more than ERC's whole band.
The ERC configs pack the two passes differently by design (``rollout.log_prob_max_token_len_per_gpu``
twice ``actor.ppo_max_token_len_per_gpu``, dynamic batching), so without care on-policy ERC masks
tokens because of the kernels, not the policy (measured: docs/benchmarks.md, "On-policy exactness").

This module makes the invariant hold by construction and shows it in every run:

* :func:`install_update_packing` wraps the LM-head engine's ``infer_batch``: on an engine whose
  loss uses the entropy as ERC's mask (:func:`verl_ext.entropy.entropy_path_of` is not ``VERL``)
  the old-log-prob pass splits its batch into the update's mini-batches of the *first epoch* --
  with verl's own iterator (``tu.make_iterator``: same ``ppo_mini_batch_size``, ``data_loader_seed``
  and ``shuffle``, seeded per data-parallel rank as ``train_mini_batch`` does) -- and packs each with
  the update's micro-batch settings (``ppo_max_token_len_per_gpu`` / ``ppo_micro_batch_size_per_gpu``,
  verl's own ``prepare_micro_batches``). Every micro-batch of the first update mini-batch then holds
  exactly the tokens, in the same order, that the old-log-prob pass computed together: identical
  shapes, identical kernels, bit-identical logits. The outputs are put back in the batch's order.
  Semantics are unchanged (rho is the paper's and the reference code's); the cost is the log-prob
  pass at the update's smaller token budget (measured in docs/benchmarks.md).
  The trainer passes the update's mini-batch settings as :data:`UPDATE_PACKING_KEY`
  (:meth:`UpdatePacking.from_actor_config`); without them the whole batch is one mini-batch in
  order, which is what a direct ``train_mini_batch`` with ``mini_batch_size = len(batch)`` does.
* :func:`install_on_policy_mark` wraps ``TrainingWorker.train_mini_batch`` / ``train_batch`` so that
  the first mini-batch of every call (the first epoch's first mini-batch: before any optimizer step
  of this training step) carries :data:`ON_POLICY_KEY`. The actor loss then logs
  :func:`on_policy_gauge`'s ``actor/divclip/onpolicy/*`` from it: the largest |log w| and |rho - 1|,
  the fraction of tokens outside the actor's ratio-clip range and the fraction ERC masks. On a
  user's cluster these read 0 when the clip rules measure the policy, not the kernels. The gauge is
  computed without gradient from detached values: it changes no update.

Imports :mod:`verl_ext.entropy` only (for the engine's entropy path).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from tensordict import TensorDict

from verl_ext.entropy import EntropyPath, entropy_path_of

logger = logging.getLogger(__name__)

UPDATE_PACKING_KEY = "divclip_update_packing"
"""Non-tensor key of the old-log-prob batch: the update's mini-batch settings (``UpdatePacking``)."""

ON_POLICY_KEY = "divclip_on_policy"
"""Non-tensor key set on the update mini-batch that runs before any optimizer step of the call."""

_INSTALLED_MARK = "_verl_ext_onpolicy_installed"
_MINI_BATCHES_SEEN = "_divclip_mini_batches_seen"
_PACK_AS_UPDATE_ATTR = "_divclip_pack_as_update"


@dataclass(frozen=True)
class UpdatePacking:
    """How ``TrainingWorker.train_mini_batch`` will split the batch (its first epoch).

    Args:
        mini_batch_size: sequences per mini-batch over all data-parallel ranks
            (``actor.ppo_mini_batch_size * rollout.n``, as the v1 trainer passes it).
        seed: ``actor.data_loader_seed`` (each rank adds its data-parallel rank, like verl).
        shuffle: ``actor.shuffle``.
    """

    mini_batch_size: int
    seed: int
    shuffle: bool

    @classmethod
    def from_actor_config(cls, actor: Mapping[str, Any], rollout_n: int) -> "UpdatePacking":
        """From ``actor_rollout_ref.actor`` and ``rollout.n``, exactly as ``_update_actor`` reads them."""
        return cls(
            mini_batch_size=int(actor["ppo_mini_batch_size"]) * int(rollout_n),
            seed=int(actor["data_loader_seed"]),
            shuffle=bool(actor["shuffle"]),
        )

    def as_extra_info(self) -> dict[str, dict[str, Any]]:
        return {UPDATE_PACKING_KEY: asdict(self)}


def first_epoch_mini_batches(size: int, mini_batch_size_per_gpu: int, seed: int, shuffle: bool) -> list[torch.Tensor]:
    """The row indices of each mini-batch of ``train_mini_batch``'s first epoch, drawn by verl's own
    ``tu.make_iterator`` (the same DataLoader, generator and seed), so they match by construction."""
    from verl.utils import tensordict_utils as tu

    if mini_batch_size_per_gpu <= 0 or size % mini_batch_size_per_gpu:
        raise ValueError(
            f"the update splits {size} sequences per rank into mini-batches of {mini_batch_size_per_gpu}, which does "
            "not divide them (actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n / data-parallel size)"
        )
    rows = TensorDict({"row": torch.arange(size)}, batch_size=[size])
    iterator = tu.make_iterator(
        rows, mini_batch_size=mini_batch_size_per_gpu, epochs=1, seed=seed, dataloader_kwargs={"shuffle": shuffle}
    )
    return [mini_batch["row"] for mini_batch in iterator]


def packs_as_update(engine: Any) -> bool:
    """Whether ``engine``'s old-log-prob pass packs as its update: when ERC's entropy path is marked,
    unless :func:`set_pack_as_update` turned it off (the benchmark's control arm)."""
    return entropy_path_of(engine) is not EntropyPath.VERL and getattr(engine, _PACK_AS_UPDATE_ATTR, True)


def set_pack_as_update(engine: Any, enabled: bool) -> None:
    """Turn the aligned packing of ``engine`` on or off. Off is verl's own packing of the
    old-log-prob pass (its own token budget): only ``python -m recipe.bench onpolicy`` uses it, to
    measure what the alignment removes."""
    setattr(engine, _PACK_AS_UPDATE_ATTR, bool(enabled))


def _infer_as_update(engine: Any, data: TensorDict, loss_function: Any, infer: Callable[..., Any]) -> Any:
    from verl.utils import tensordict_utils as tu

    size = len(data)
    packing = tu.get_non_tensor_data(data=data, key=UPDATE_PACKING_KEY, default=None)
    if packing is None:  # a direct caller: one mini-batch, in order (train_mini_batch(mini_batch_size=len))
        groups = [torch.arange(size)]
    else:
        dp_size, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
        groups = first_epoch_mini_batches(
            size, int(packing["mini_batch_size"]) // dp_size, int(packing["seed"]) + dp_rank, bool(packing["shuffle"])
        )
    config = engine.engine_config
    outputs = []
    for rows in groups:
        part = tu.index_select_tensor_dict(data, rows)
        tu.assign_non_tensor(
            part, max_token_len_per_gpu=config.max_token_len_per_gpu, micro_batch_size_per_gpu=config.micro_batch_size_per_gpu
        )
        outputs.append(infer(engine, part, loss_function))
    if len(outputs) == 1 and packing is None:
        return outputs[0]
    if any(out is None for out in outputs):
        return None

    order = torch.cat(groups).tolist()
    model_output: dict[str, torch.Tensor] = {}
    for key in outputs[0]["model_output"]:
        pieces = [row for out in outputs for row in out["model_output"][key].unbind()]
        placed: list[Optional[torch.Tensor]] = [None] * size
        for position, row in zip(order, pieces):
            placed[position] = row
        model_output[key] = torch.nested.as_nested_tensor(placed, layout=torch.jagged)
    metrics: dict[str, list[Any]] = {}
    for out in outputs:
        for key, value in out.get("metrics", {}).items():
            metrics.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return {"model_output": model_output, "loss": [loss for out in outputs for loss in out["loss"]], "metrics": metrics}


def install_update_packing(engine_class: Any = None) -> None:
    """Wrap ``FSDPEngineWithLMHead.infer_batch`` (idempotent): marked engines pack the old-log-prob
    pass as their update (module docstring); other engines run verl's code unchanged."""
    if engine_class is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as engine_class
    if getattr(engine_class.infer_batch, _INSTALLED_MARK, False):
        return
    original = engine_class.infer_batch

    @functools.wraps(original)
    def infer_batch_packed_as_update(self: Any, data: TensorDict, loss_function: Any = None) -> Any:
        if not packs_as_update(self):
            return original(self, data, loss_function)
        return _infer_as_update(self, data, loss_function, original)

    setattr(infer_batch_packed_as_update, _INSTALLED_MARK, True)
    engine_class.infer_batch = infer_batch_packed_as_update


def install_on_policy_mark() -> None:
    """Wrap ``TrainingWorker.train_mini_batch`` / ``train_batch`` (idempotent) so that the first
    mini-batch of each ``train_mini_batch`` call carries ``ON_POLICY_KEY = True``."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker

    if getattr(TrainingWorker.train_batch, _INSTALLED_MARK, False):
        return
    train_mini_batch, train_batch = TrainingWorker.train_mini_batch, TrainingWorker.train_batch

    @functools.wraps(train_mini_batch)  # keeps verl's @register dispatch attributes
    def train_mini_batch_marking_first(self: Any, data: TensorDict) -> Any:
        setattr(self, _MINI_BATCHES_SEEN, 0)
        try:
            return train_mini_batch(self, data)
        finally:
            setattr(self, _MINI_BATCHES_SEEN, None)

    @functools.wraps(train_batch)
    def train_batch_marking_first(self: Any, data: TensorDict) -> Any:
        seen = getattr(self, _MINI_BATCHES_SEEN, None)
        if seen is not None:
            tu.assign_non_tensor(data, **{ON_POLICY_KEY: seen == 0})
            setattr(self, _MINI_BATCHES_SEEN, seen + 1)
        return train_batch(self, data)

    for wrapped in (train_mini_batch_marking_first, train_batch_marking_first):
        setattr(wrapped, _INSTALLED_MARK, True)
    TrainingWorker.train_mini_batch = train_mini_batch_marking_first
    TrainingWorker.train_batch = train_batch_marking_first


def is_on_policy(data: TensorDict) -> bool:
    """Whether this (micro-)batch belongs to the update's first mini-batch, before any optimizer step."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=data, key=ON_POLICY_KEY, default=False))


@torch.no_grad()
def on_policy_gauge(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    erc_band: Optional[tuple[float, float, float]] = None,
) -> dict[str, float]:
    """``onpolicy/*`` metrics of an on-policy micro-batch (all detached; padding excluded).

    * ``log_ratio_abs_max``: max |log pi_theta - log pi_old| (exactly 0 when both passes agree);
    * ``ratio_clipfrac``: valid tokens with w outside (1 - eps_low, 1 + eps_high), the actor's clip range;
    * with both entropies: ``erc_ratio_dev_max`` = max |rho - 1|, rho = (H + eps) / (H_old + eps);
    * with ``erc_band = (beta_low, beta_high, eps)``: ``erc_masked_frac``, valid tokens with rho outside
      (1 - beta_low, 1 + beta_high) -- the ones ERC would drop.
    """
    valid = response_mask.bool()
    n_valid = max(int(valid.sum()), 1)
    log_ratio = torch.where(valid, log_prob.detach().float() - old_log_prob.detach().float(), 0.0)
    ratio = log_ratio.exp()
    out = {
        "onpolicy/log_ratio_abs_max": float(log_ratio.abs().max()) if valid.any() else 0.0,
        "onpolicy/ratio_clipfrac": float(((ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)).sum()) / n_valid,
    }
    if old_entropy is not None and entropy is not None:
        eps = erc_band[2] if erc_band is not None else 1e-8
        rho = torch.where(valid, (entropy.detach().float() + eps) / (old_entropy.detach().float() + eps), 1.0)
        out["onpolicy/erc_ratio_dev_max"] = float((rho - 1.0).abs().max())
        if erc_band is not None:
            beta_low, beta_high, _ = erc_band
            masked = (rho <= 1.0 - beta_low) | (rho >= 1.0 + beta_high)
            out["onpolicy/erc_masked_frac"] = float(masked.sum()) / n_valid
    return out
