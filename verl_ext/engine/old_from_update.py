"""pi_old from the update's own first forward: the old-log-prob pass skipped where it would repeat it bit for bit.

With the pass packed as the update, the update's first mini-batch computes exactly what the pass would for its rows
(verl#3996): the pass skips them, the update hands its loss its own detached values as pi_old and keeps them for
the trainer's second ``_compute_old_log_prob`` (:func:`collect`). Not taken where not exact. docs/engine.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl_ext.engine.topk_capture import CAPTURE_KEY, OLD_TOPK_IDS, OLD_TOPK_LOG_PROBS

logger = logging.getLogger(__name__)

OLD_FROM_UPDATE_KEY = "divclip_old_log_prob_from_update"
"""Non-tensor key of the old-log-prob batch (set by the trainer): take the first mini-batch's pi_old from the
update's own forward (``policy_loss.old_log_prob_from_update``)."""

COLLECT_KEY = "divclip_collect_old_log_prob"
"""Non-tensor key of the trainer's call after the update: return the pass's values, the first mini-batch's
taken from the update, instead of computing anything."""

POLICY_KEY = "actor_rollout_ref.actor.policy_loss.old_log_prob_from_update"
FIELDS = ("log_probs", "entropy")  # what verl's old pass returns per row (calculate_entropy=True)
TOPK_FIELDS = (OLD_TOPK_LOG_PROBS, OLD_TOPK_IDS)  # and, asked for pi_old's top-k (CAPTURE_KEY), these
_STATE_ATTR = "_divclip_old_from_update"


def pass_fields(topk_k: int) -> tuple[str, ...]:
    """What the old pass returns per row: :data:`FIELDS`, and :data:`TOPK_FIELDS` when it stores a top-k."""
    return FIELDS + (TOPK_FIELDS if topk_k else ())


class OldFromUpdateError(RuntimeError):
    """The update did not supply pi_old for every row whose old pass was skipped (or the batches differ)."""


def dropout_reason(engine: Any) -> Optional[str]:
    """Why this engine's train-mode forward is not its eval-mode pass (dropout), or None."""
    module = getattr(engine, "module", None)
    if module is None:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            return f"module {name or type(sub).__name__} is a dropout with p={sub.p}"
    config = getattr(getattr(module, "config", None), "to_dict", None)
    for key, value in (config() if config is not None else {}).items():
        if "dropout" in key and isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return f"the model config's {key}={value}"
    return None


@dataclass
class OldFromUpdate:
    """One rank's pending pi_old: per row of the batch the old pass received, its full-sequence ``log_probs``
    and ``entropy``, and with :attr:`topk_k` its response-layout top-k (the pass's, or, for :attr:`from_update`
    rows, the update's once captured)."""

    fingerprints: list[tuple[int, int]]
    from_update: frozenset[int]
    values: dict[str, list[Optional[torch.Tensor]]]
    captured: set[int] = field(default_factory=set)
    mini_batch: int = 0  #: the update mini-batch (first epoch) that supplies pi_old of :attr:`from_update`
    loss_wants_entropy: bool = False  #: whether the update's loss itself asked for the entropy (calculate_entropy)
    forwards: int = 0  #: rows the old pass computed (the benchmark and tests count them)
    topk_k: int = 0  #: k of pi_old's top-k the pass was asked for (kl_full, its diagnostic); 0: none

    @property
    def fields(self) -> tuple[str, ...]:
        return pass_fields(self.topk_k)

    def skipped_share(self, rows: list[int]) -> float:
        """The share of an update micro-batch's rows whose pi_old is the update's own forward
        (``actor/divclip/path/old_log_prob_from_update``; 0 without the skip)."""
        return len(set(rows) & self.from_update) / len(rows) if rows else 0.0

    def capture(self, rows: list[int], model_output: dict[str, torch.Tensor]) -> None:
        missing = [f for f in self.fields if model_output.get(f, None) is None]
        if missing:
            raise OldFromUpdateError(f"{POLICY_KEY}: the update's first mini-batch returned no {missing}")
        for name in self.fields:
            for row, value in zip(rows, model_output[name].detach().unbind(), strict=False):
                self.values[name][row] = value.clone()
        self.captured.update(rows)

    def row(self, name: str, row: int) -> torch.Tensor:
        value = self.values[name][row]
        if row in self.from_update and row not in self.captured:
            raise OldFromUpdateError(
                f"{POLICY_KEY}: row {row}'s pi_old comes from the update's first mini-batch, which has not computed "
                "it (an update micro-batch holds it before that mini-batch ran)"
            )
        return value


SUPPLYING_MINI_BATCH = 0
"""Which first-epoch update mini-batch supplies its own pi_old: the first, the only one that runs before any
optimizer step. (tests/test_old_pass_skip.py's control sets 1 -- a mini-batch after an optimizer step -- and
watches the step change.)"""


def skipped_mini_batch(
    engine: Any, data: TensorDict, groups: list[torch.Tensor], fingerprints: list[tuple[int, int]]
) -> Optional[int]:
    """In the old pass: the first-epoch mini-batch whose forward the pass leaves to the update (None: none).
    Sets up the engine's pending state whenever :data:`OLD_FROM_UPDATE_KEY` is there (even when nothing is
    skipped: the collect then returns the pass's own values)."""
    from verl.utils import tensordict_utils as tu

    setattr(engine, _STATE_ATTR, None)
    if not tu.get_non_tensor_data(data=data, key=OLD_FROM_UPDATE_KEY, default=False):
        return None
    reason = dropout_reason(engine)
    sp = int(getattr(getattr(engine, "engine_config", None), "ulysses_sequence_parallel_size", 1) or 1)
    if reason is None and sp > 1:
        reason = f"a Ulysses group of {sp} (one rank returns the group's outputs)"
    if reason is not None:
        logger.warning("%s: not taken on this rank (%s): the old-log-prob pass runs whole", POLICY_KEY, reason)
    index = None if reason is not None or len(groups) <= SUPPLYING_MINI_BATCH else SUPPLYING_MINI_BATCH
    skipped = frozenset() if index is None else frozenset(int(r) for r in groups[index].tolist())
    topk_k = int(tu.get_non_tensor_data(data=data, key=CAPTURE_KEY, default=0) or 0)
    values: dict[str, list[Optional[torch.Tensor]]] = {name: [None] * len(data) for name in pass_fields(topk_k)}
    state = OldFromUpdate(fingerprints, skipped, values, forwards=len(data) - len(skipped), topk_k=topk_k)
    state.mini_batch = -1 if index is None else index
    setattr(engine, _STATE_ATTR, state)
    return index


def keep_pass_outputs(
    engine: Any, tokens: list[int], responses: list[int], groups: list[torch.Tensor], outputs: list[Any]
) -> None:
    """The pass's outputs, per row, into the pending state; the skipped rows get placeholders (NaN, top-k ids -1)
    shaped as the pass's rows, on the device and in the dtype of its outputs (one nested tensor holds both)."""
    state = state_of(engine)
    if state is None:
        return
    for rows, out in zip(groups, outputs, strict=False):
        for name in state.fields:
            if name not in out["model_output"]:
                raise OldFromUpdateError(f"{POLICY_KEY}: the old-log-prob pass returned no {name!r}")
            for row, value in zip(rows.tolist(), out["model_output"][name].unbind(), strict=False):
                state.values[name][row] = value
    # a placeholder row per field: per token (width None) or per response token x the top-k width; a field
    # without a row here raises KeyError rather than getting a guessed shape
    widths = {"log_probs": None, "entropy": None, OLD_TOPK_LOG_PROBS: state.topk_k + 1, OLD_TOPK_IDS: state.topk_k}
    for name in state.fields:
        computed = next((v for v in state.values[name] if v is not None), None)
        dtype = computed.dtype if computed is not None else (torch.int32 if name == OLD_TOPK_IDS else torch.float32)
        device = computed.device if computed is not None else None
        fill = -1 if name == OLD_TOPK_IDS else math.nan
        for row in state.from_update:
            width = widths[name]
            shape = (tokens[row],) if width is None else (responses[row], width)
            state.values[name][row] = torch.full(shape, fill, dtype=dtype, device=device)


def _batch_output(state: OldFromUpdate, size: int) -> dict[str, Any]:
    model_output = {
        name: torch.nested.as_nested_tensor([state.values[name][row] for row in range(size)], layout=torch.jagged)
        for name in state.fields
    }
    return {"model_output": model_output, "loss": [], "metrics": {}}


def placeholder_output(engine: Any, size: int) -> dict[str, Any]:
    """The pass's result for the whole batch from the pending state (placeholders where the update supplies)."""
    return _batch_output(getattr(engine, _STATE_ATTR), size)


def state_of(engine: Any) -> Optional[OldFromUpdate]:
    """The engine's state from its last old-log-prob pass with :data:`OLD_FROM_UPDATE_KEY` (None: none)."""
    return getattr(engine, _STATE_ATTR, None)


def pending(engine: Any) -> Optional[OldFromUpdate]:
    state = state_of(engine)
    return state if state is not None and state.from_update else None


def check_update_batch(engine: Any, fingerprints: list[tuple[int, int]], starts_on_policy: bool) -> None:
    """Before an update call: a pending state must be for this batch, and the update must start from pi_old."""
    state = pending(engine)
    if state is None:
        return
    if fingerprints != state.fingerprints:
        raise OldFromUpdateError(
            f"{POLICY_KEY}: the update's batch is not the one whose old-log-prob pass it completes"
        )
    if not starts_on_policy:
        raise OldFromUpdateError(
            f"{POLICY_KEY}: the update does not start from pi_old (bypass mode, or a later update of a Decoupled-PPO "
            "cycle), so its first forward is not pi_old: the trainer must not skip the pass there"
        )


def substituting_loss(
    engine: Any, rows: list[int], loss_function: Callable[..., Any], first_mini_batch: bool, loss_wants_entropy: bool
) -> Callable[..., Any]:
    """The update micro-batch's loss, given pi_old for the rows the old pass skipped (docs/losses.md)."""
    from verl.workers.utils.padding import response_from_nested

    state = pending(engine)
    if state is None or loss_function is None:
        return loss_function
    if first_mini_batch and set(rows) - state.from_update:  # "first": the one that supplies (state.mini_batch)
        raise OldFromUpdateError(
            f"{POLICY_KEY}: the update's mini-batch {state.mini_batch} holds rows "
            f"{sorted(set(rows) - state.from_update)} that the old-log-prob pass computed, so its split is not the "
            "one the pass skipped"
        )
    if not first_mini_batch and not (set(rows) & state.from_update):
        return loss_function

    def loss(model_output: dict[str, Any], data: TensorDict, dp_group: Any = None) -> Any:
        if first_mini_batch:
            state.capture(rows, model_output)
        mask = data["response_mask"]
        # the top-k of later micro-batches was put in before their forward (substituted_topk)
        topk = ((t, t) for t in TOPK_FIELDS) if first_mini_batch else ()
        for name, target in (("log_probs", "old_log_probs"), ("entropy", "entropy"), *topk):
            if target not in data.keys() or name not in state.fields:
                continue
            full = torch.nested.as_nested_tensor([state.row(name, r) for r in rows], layout=torch.jagged)
            kept = (full if name in TOPK_FIELDS else response_from_nested(full, mask)).unbind()  # top-k: responses
            given = data[target].unbind()
            merged = [kept[i] if r in state.from_update else given[i] for i, r in enumerate(rows)]
            # the forward's dtype (bf16 log-probs under autocast), as the pass would have written them
            dtype = kept[0].dtype
            data[target] = torch.nested.as_nested_tensor(
                [m.to(device=g.device, dtype=dtype) for m, g in zip(merged, given, strict=False)], layout=torch.jagged
            )
        dropped = set(TOPK_FIELDS) | (set() if loss_wants_entropy else {"entropy"})  # pi_old's, not the loss's
        model_output = {k: v for k, v in model_output.items() if k not in dropped}
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)

    return loss


def supplies_topk(engine: Any, first_mini_batch: bool) -> int:
    """k of pi_old's top-k this update step takes from its own logits (the supplying mini-batch of a pass that
    stored a top-k), else 0."""
    state = pending(engine)
    return state.topk_k if state is not None and first_mini_batch else 0


def substituted_topk(engine: Any, rows: list[int], micro_batch: TensorDict, first_mini_batch: bool) -> None:
    """Before a later update micro-batch's forward: its rows whose pass was skipped get the kept top-k (ids and
    log-masses) in place of the placeholders, since the step evaluates pi_theta on those ids."""
    state = pending(engine)
    if state is None or not state.topk_k or first_mini_batch or not set(rows) & state.from_update:
        return
    for name in TOPK_FIELDS:
        given = micro_batch[name].unbind()
        merged = [
            state.row(name, r).to(given[i].device) if r in state.from_update else given[i] for i, r in enumerate(rows)
        ]
        micro_batch[name] = torch.nested.as_nested_tensor(merged, layout=torch.jagged)


def finish_update(engine: Any) -> None:
    """After the update call: every row whose pass was skipped must have been captured."""
    state = pending(engine)
    if state is not None and state.captured != set(state.from_update):
        missing = sorted(set(state.from_update) - state.captured)
        raise OldFromUpdateError(f"{POLICY_KEY}: the update's first mini-batch never computed rows {missing}")


def collect(engine: Any, fingerprints: list[tuple[int, int]]) -> dict[str, Any]:
    """The trainer's call after the update (its batch's ``fingerprints``): the pass's values for every row, then
    the state is dropped."""
    state = state_of(engine)
    setattr(engine, _STATE_ATTR, None)
    if state is None:
        raise OldFromUpdateError(f"{POLICY_KEY}: collected, but this rank ran no old-log-prob pass with the key")
    if fingerprints != state.fingerprints:
        raise OldFromUpdateError(f"{POLICY_KEY}: the collected batch is not the one whose old-log-prob pass ran")
    if state.captured != set(state.from_update):
        raise OldFromUpdateError(f"{POLICY_KEY}: collected before the update supplied every skipped row")
    return _batch_output(state, len(fingerprints))


def old_pass_rows(engine: Any) -> Optional[int]:
    """Rows the last old-log-prob pass with the key computed on this rank (None: no such pass pending)."""
    state = state_of(engine)
    return None if state is None else state.forwards
