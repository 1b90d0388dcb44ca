"""pi_old's top-k for ``kl_full`` and its diagnostic: stored by the old-log-prob pass (asked with
:data:`CAPTURE_KEY`), evaluated under pi_theta in the update, both in verl's response layout, from verl's logits or
the vocabulary pass's LM-head input (the math: :mod:`verl_ext.core.coarsened_kl`). docs/losses.md.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Optional

import torch

from verl_ext.core.coarsened_kl import check_top_k, log_masses_of_rows, topk_of_rows
from verl_ext.core.vocab_pass import bucket_log_masses
from verl_ext.engine.guard import engine_attribute
from verl_ext.engine.swap import Swap

#: Batch fields (verl's response layout, nested): pi_old's k + 1 log-masses, its k top ids.
OLD_TOPK_LOG_PROBS = "divclip_old_topk_log_probs"
OLD_TOPK_IDS = "divclip_old_topk_ids"
#: Model-output field of the update pass: pi_theta's log-masses on pi_old's k + 1 buckets.
NEW_TOPK_LOG_PROBS = "divclip_topk_log_probs"
#: Non-tensor batch key that asks the old-log-prob pass for pi_old's top-k (its value: k).
CAPTURE_KEY = "divclip_old_topk_k"


def old_topk_request(policy: Any) -> int:
    """k to store for a run with policy-loss config ``policy`` (a mapping or dataclass), 0 for none:
    ``loss_mode=kl_full`` needs it, and any divclip mode with ``kl_full_diagnostic=True``."""
    get = policy.get if hasattr(policy, "get") else (lambda key, default=None: getattr(policy, key, default))
    wanted = get("loss_mode", None) == "kl_full" or bool(get("kl_full_diagnostic", False))
    return int(get("kl_full_top_k", 0)) if wanted else 0


@contextmanager
def capturing_old_topk(extra_info: MutableMapping[str, Any], k: int) -> Iterator[None]:
    """Set :data:`CAPTURE_KEY` = k (> 0) in a batch's ``extra_info`` for the old-log-prob pass only, so no later
    pass (the reference policy's, which may share the actor's engine under LoRA) overwrites pi_old's top-k."""
    if k <= 0:
        yield
        return
    extra_info[CAPTURE_KEY] = int(k)
    try:
        yield
    finally:
        extra_info.pop(CAPTURE_KEY, None)


def response_rows(micro_batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the packed logits that predict the response tokens, and the response offsets.

    Row ``e_b - r_b - 1 + t`` of sequence b (packed end ``e_b``, response length ``r_b``) predicts
    response token t (verl's one-token left shift, ``response_from_nested``)."""
    input_ids, response_mask = micro_batch["input_ids"], micro_batch["response_mask"]
    if not (getattr(input_ids, "is_nested", False) and getattr(response_mask, "is_nested", False)):
        raise ValueError("kl_full's top-k needs verl's no-padding layout (nested input_ids and response_mask)")
    # from lengths: a micro-batch's nested fields may be views whose offsets do not start at 0
    seq_ends = input_ids.offsets().diff().cumsum(0)
    response_lens = response_mask.offsets().diff()
    response_offsets = torch.cat([response_lens.new_zeros(1), response_lens.cumsum(0)])
    starts = seq_ends - response_lens - 1
    rows = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, response_lens, strict=False)]
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)), response_offsets


class TopKStep:
    """What one forward step captures: from the logits verl hands to ``logprobs_from_logits``, or, as a
    :class:`~verl_ext.engine.vocab_pass_step.HeadObserver`, from the LM head's input under the vocabulary pass."""

    def __init__(
        self, micro_batch: Any, capture_k: int, old_ids: Optional[torch.Tensor], supplies_old: bool = False
    ) -> None:
        self.micro_batch = micro_batch
        self.capture_k = capture_k
        self.old_ids = old_ids
        #: an update step that is pi_old itself (``old_log_prob_from_update``): it captures the top-k as the pass
        #: would, then evaluates pi_theta on the ids it captured
        self.supplies_old = supplies_old
        self.outputs: dict[str, torch.Tensor] = {}
        self.served = False  # the step's logits (or LM-head input) were seen and the outputs computed

    def _rows(self, available: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.served:
            raise RuntimeError("kl_full: the step's logits (or LM-head input) were seen twice in one forward step")
        self.served = True
        rows, offsets = response_rows(self.micro_batch)
        if rows.numel() and int(rows.max()) >= available:
            raise ValueError(
                f"kl_full: the step's logits (or LM-head input) hold {available} rows, fewer than the packed sequence "
                "(Ulysses sequence parallelism shards them; kl_full needs ulysses_sequence_parallel_size=1)"
            )
        return rows.to(device), offsets.to(device)

    def _store(
        self, offsets: torch.Tensor, old: Optional[tuple[torch.Tensor, torch.Tensor]], new: Optional[torch.Tensor]
    ) -> None:
        if old is not None:
            self.outputs[OLD_TOPK_LOG_PROBS] = torch.nested.nested_tensor_from_jagged(old[0], offsets)
            self.outputs[OLD_TOPK_IDS] = torch.nested.nested_tensor_from_jagged(old[1], offsets)
        if new is not None:
            self.outputs[NEW_TOPK_LOG_PROBS] = torch.nested.nested_tensor_from_jagged(new, offsets)

    def on_logits(self, logits: torch.Tensor) -> None:
        rows, offsets = self._rows(logits.shape[0], logits.device)
        old = topk_of_rows(logits, rows, self.capture_k) if self.capture_k else None
        ids = old[1] if self.supplies_old and old is not None else self.old_ids
        new = None if ids is None else log_masses_of_rows(logits, rows, ids.to(logits.device))
        self._store(offsets, old, new)

    # -- the vocabulary pass's HeadObserver protocol ------------------------------------------------

    def requested_top_k(self, vocab: int) -> int:
        return check_top_k(self.capture_k, vocab) if self.capture_k else 0

    def on_head(
        self, hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, top_ids: Optional[torch.Tensor]
    ) -> None:
        rows, offsets = self._rows(hidden.shape[0], hidden.device)
        hidden_rows, temperature_rows = hidden[rows], temperature.reshape(-1)[rows]
        old = None
        if self.capture_k:
            assert top_ids is not None  # requested_top_k asked the pass for them
            ids = top_ids[rows, : self.capture_k]  # another observer may have asked for more
            old = (bucket_log_masses(hidden_rows, weight, ids, temperature_rows), ids.to(torch.int32))
        ids = old[1] if self.supplies_old and old is not None else self.old_ids
        new = None if ids is None else bucket_log_masses(hidden_rows, weight, ids.to(hidden.device), temperature_rows)
        if self.supplies_old and old is not None:
            old = (old[0].detach(), old[1])  # pi_old: what the pass would have stored, without the graph
        self._store(offsets, old, new)

    def model_outputs(self) -> dict[str, torch.Tensor]:
        if not self.served:
            raise RuntimeError("kl_full: the vocabulary pass's head never ran in this forward step")
        return dict(self.outputs)


def topk_step(micro_batch: Any, loss_function: Any, supply_k: int = 0) -> Optional[TopKStep]:
    """What this forward step does with pi_old's top-k: capture it (the old pass), evaluate pi_theta on the
    stored ids (the update), both (``supply_k``: an update step that supplies pi_old, old_log_prob_from_update),
    or nothing (``None``)."""
    from verl.utils import tensordict_utils as tu

    if supply_k:
        return TopKStep(micro_batch, supply_k, None, supplies_old=True)
    capture_k, old_ids = 0, None
    if loss_function is None:  # a forward-only pass without loss: the old-log-prob pass asks with CAPTURE_KEY
        capture_k = int(tu.get_non_tensor_data(data=micro_batch, key=CAPTURE_KEY, default=0) or 0)
    elif OLD_TOPK_IDS in micro_batch.keys():
        ids = micro_batch[OLD_TOPK_IDS]
        if not ids.is_nested:
            raise ValueError(
                f"{OLD_TOPK_IDS} must be in verl's nested response layout, got a {tuple(ids.shape)} tensor"
            )
        offsets = ids.offsets()
        old_ids = ids.values()[int(offsets[0]) : int(offsets[-1])]
    if not capture_k and old_ids is None:
        return None
    return TopKStep(micro_batch, capture_k, old_ids)


def topk_outputs_swap(engine: Any, step: TopKStep) -> Swap:
    """On verl's materialised-logits path: ``prepare_model_outputs`` returns verl's model output plus the
    step's top-k fields (the logits were seen by the seam's ``logprobs_from_logits``, before the loss)."""
    original_prepare = engine.prepare_model_outputs

    def prepare_model_outputs(*args: Any, **kwargs: Any) -> dict[str, Any]:
        model_output = original_prepare(*args, **kwargs)
        if not step.served:
            raise ValueError(
                "kl_full needs the materialised logits, and this forward step computed none (verl's fused "
                "kernels or distillation_only): set actor_rollout_ref.model.use_fused_kernels=False"
            )
        model_output.update(step.outputs)
        return model_output

    return Swap(engine, "prepare_model_outputs", prepare_model_outputs, "pi_old's top-k")


def refuse_ulysses(engine: Any) -> None:
    if engine_attribute(engine, "use_ulysses_sp"):
        raise ValueError(
            "kl_full's top-k is taken from the logits of whole packed sequences; Ulysses sequence parallelism "
            "shards them: set actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1"
        )
