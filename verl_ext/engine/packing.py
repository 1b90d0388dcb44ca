"""On-policy exactness: the old-log-prob pass packed as the update, and the mark of the on-policy mini-batch.

Before the first optimizer step of a training step, pi_theta *is* pi_old, so every importance ratio
should be exactly 1 (and ERC's entropy ratio too). That holds only if both passes compute each token's
logits with the same arithmetic. A matrix product is not batch-invariant: its rows change in their last
bits with the number of tokens in the micro-batch (CPU blocking; cuBLAS kernel and split-K choice by
shape). Under verl's default bf16 the LM head rounds the logits to bf16, where one ulp at |x| ~ 16-32 is
0.125: the configs' 2:1 log-prob/update token budgets then give on-policy ratios of e^{+-0.25} -- tokens
clipped by ``clip``, ``kl3`` or GSPO's sequence band, and masked by ERC, because of the kernels, not the
policy (verl#6280; measured in docs/benchmarks.md, "On-policy exactness").

:func:`infer_as_update` makes the invariant hold by construction, for every loss mode: the seam calls it
for the old-log-prob pass of an engine whose loss asked for ``pack_as_update``
(``policy_loss.pack_old_log_prob_as_update``, on by default). It splits the batch into the update's
mini-batches of the *first epoch* -- with verl's own iterator (``tu.make_iterator``: same
``ppo_mini_batch_size``, ``data_loader_seed`` and ``shuffle``, seeded per data-parallel rank as
``train_mini_batch`` does) -- and packs each with the update's micro-batch settings
(``ppo_max_token_len_per_gpu`` / ``ppo_micro_batch_size_per_gpu``, through verl's own
``prepare_micro_batches``). Every micro-batch of every first-epoch update mini-batch then holds exactly
the tokens, in the same order, that the old-log-prob pass computed together: identical shapes,
identical kernels, bit-identical logits before the first optimizer step (and, at learning rate 0, in
every first-epoch mini-batch). The outputs are put back in the batch's order. The cost is the log-prob
pass at the update's smaller token budget (measured in docs/benchmarks.md). The trainer passes the
update's mini-batch settings as :data:`UPDATE_PACKING_KEY` (:meth:`UpdatePacking.from_actor_config`);
without them the whole batch is one mini-batch in order, which is what a direct ``train_mini_batch``
with ``mini_batch_size = len(batch)`` does.

:func:`marking_on_policy` / :func:`marking_first_mini_batch` (installed by the seam on
``TrainingWorker.train_mini_batch`` / ``train_batch``) give the first mini-batch of every update call --
before any optimizer step of this training step -- :data:`ON_POLICY_KEY`; the actor loss then logs the
on-policy gauge (:func:`verl_ext.core.gauge.on_policy_gauge`) from it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from tensordict import TensorDict


logger = logging.getLogger(__name__)

UPDATE_PACKING_KEY = "divclip_update_packing"
"""Non-tensor key of the old-log-prob batch: the update's mini-batch settings (``UpdatePacking``)."""

ON_POLICY_KEY = "divclip_on_policy"
"""Non-tensor key set on the update mini-batch that runs before any optimizer step of the call."""

_MINI_BATCHES_SEEN = "_divclip_mini_batches_seen"


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


def infer_as_update(engine: Any, data: TensorDict, loss_function: Any, infer: Callable[..., Any]) -> Any:
    """verl's ``infer_batch`` (``infer``) run once per first-epoch update mini-batch of ``data``, each packed
    with the update's micro-batch settings; the outputs are reassembled in ``data``'s order (module
    docstring)."""
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


def is_on_policy(data: TensorDict) -> bool:
    """Whether this (micro-)batch belongs to the update's first mini-batch, before any optimizer step."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=data, key=ON_POLICY_KEY, default=False))


def marking_on_policy(train_mini_batch: Callable[..., Any], worker: Any, data: TensorDict) -> Any:
    """``TrainingWorker.train_mini_batch`` counting the mini-batches it runs (see :func:`marking_first_mini_batch`)."""
    setattr(worker, _MINI_BATCHES_SEEN, 0)
    try:
        return train_mini_batch(worker, data)
    finally:
        setattr(worker, _MINI_BATCHES_SEEN, None)


def marking_first_mini_batch(train_batch: Callable[..., Any], worker: Any, data: TensorDict) -> Any:
    """``TrainingWorker.train_batch``: inside a ``train_mini_batch`` call, the first mini-batch carries
    ``ON_POLICY_KEY = True`` (the others ``False``); a direct call carries nothing."""
    from verl.utils import tensordict_utils as tu

    seen = getattr(worker, _MINI_BATCHES_SEEN, None)
    if seen is not None:
        tu.assign_non_tensor(data, **{ON_POLICY_KEY: seen == 0})
        setattr(worker, _MINI_BATCHES_SEEN, seen + 1)
    return train_batch(worker, data)
