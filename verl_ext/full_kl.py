"""The exact per-token trust region of ATR-GRPO Eq. 4 over pi_old's stored top-k, at bounded memory.

ATR-GRPO's framework starts from C_t = KL(pi_theta(.|s_t) || pi_old(.|s_t)) <= delta (Eq. 4; TRPO,
Truly PPO) and replaces it with the sample estimate KL3 because the full expectation over the
vocabulary is costly. The update pass already holds pi_theta's full distribution (the logits); what
it lacks is pi_old's, which the old-log-prob pass has and throws away. This module keeps a summary
of it and evaluates the KL on that summary:

* **Stored top-k.** In the old-log-prob pass each response token keeps pi_old's k most likely ids
  (int32) and k + 1 log-masses (float32): the k top-k log-probs and the log of the *tail bucket*,
  the mass of every other id. :func:`topk_rows` computes them from a row chunk of logits; the
  engine hook below feeds it the materialised logits. Under the vocabulary pass
  (``policy_loss.vocab_pass``) the ids come from the pass's own top-k and the log-masses from
  :func:`verl_ext.vocab_pass.bucket_log_masses`, the same k + 1 buckets computed from float32 logit
  slices: no ``tokens x vocabulary`` tensor in either pass.
* **pi_theta on the same buckets.** In the update pass :func:`log_masses_of_rows` (or, under the
  vocabulary pass, :func:`verl_ext.vocab_pass.bucket_log_masses`) evaluates pi_theta's
  log-probs at pi_old's ids and its log-mass on the complement (the same tail bucket), row chunk by
  row chunk, without a graph: the constraint is evaluated on detached quantities (Eq. 5).
* **Coarsened KL.** :func:`coarsened_kl` is the KL between the two (k + 1)-bucket distributions.
  Merging outcomes never increases a KL (data-processing inequality), so it is a lower bound of the
  full-vocabulary KL, equal to it when both tails are empty (k = vocabulary) -- and, since pi_old's
  top-k ids are fixed, it is exact whenever both policies put no mass in the tail.

Both passes compute the log-masses with the same function on the same inputs (the logits, or under
the vocabulary pass the hidden states and head weight), so on-policy -- identical packing -- the
coarsened KL is exactly 0 (no token clipped) whatever the dtype.

Wiring: the driver turns the capture on for the old-log-prob pass only
(:func:`capturing_old_topk`, a non-tensor key of the batch), the engine hook
(:func:`install_full_kl_hook`) adds :data:`OLD_TOPK_LOG_PROBS` / :data:`OLD_TOPK_IDS` to the
pass's model output -- verl writes every model-output key back to the batch -- and in the update
pass, when the micro-batch carries them, adds :data:`NEW_TOPK_LOG_PROBS` for the loss. Only
response tokens are kept, in verl's response layout (nested ``(batch, response_len, ...)``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, MutableMapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from verl_ext.config import KL_FULL_DIRECTIONS
from verl_ext.entropy import EAGER_CHUNK_BYTES

#: Batch fields (verl's response layout, nested): pi_old's k + 1 log-masses, its k top ids.
OLD_TOPK_LOG_PROBS = "divclip_old_topk_log_probs"
OLD_TOPK_IDS = "divclip_old_topk_ids"
#: Model-output field of the update pass: pi_theta's log-masses on pi_old's k + 1 buckets.
NEW_TOPK_LOG_PROBS = "divclip_topk_log_probs"
#: Non-tensor batch key that asks the old-log-prob pass for pi_old's top-k (its value: k).
CAPTURE_KEY = "divclip_old_topk_k"

KL_DIRECTIONS = KL_FULL_DIRECTIONS
Direction = Literal["forward", "reverse"]

BYTES_PER_ID = 4  # int32 ids: every vocabulary in use is < 2^31
BYTES_PER_LOG_MASS = 4  # float32


def stored_bytes_per_token(k: int) -> int:
    """Bytes the stored top-k adds per response token: k int32 ids + (k + 1) float32 log-masses."""
    return k * BYTES_PER_ID + (k + 1) * BYTES_PER_LOG_MASS


# ------------------------------------------------------------------------------------------------
# The math (pure functions, any device)
# ------------------------------------------------------------------------------------------------


def _chunk_rows(logits: torch.Tensor) -> int:
    """Rows per chunk: one float32 ``rows x vocab`` working copy of the entropy path's eager size."""
    budget = EAGER_CHUNK_BYTES.get(logits.device.type, EAGER_CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * max(1, logits.shape[-1])))


@torch.no_grad()
def log_masses_rows(chunk: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-masses of ``softmax(chunk)`` on the buckets ``ids`` (each its own bucket) plus the tail.

    Args:
        chunk: ``(rows, vocab)`` logits, any float dtype.
        ids: ``(rows, k)`` distinct ids per row (any integer dtype).

    Returns:
        ``(rows, k + 1)`` float32: ``log p(ids)`` then ``log p(every other id)`` (``-inf`` when
        ``k`` = vocabulary). Each row's result depends on that row only.
    """
    z = chunk.detach().float()  # our own working copy (a view only if chunk is float32: cloned below)
    if z.data_ptr() == chunk.data_ptr():
        z = z.clone()
    index = ids.long()
    at_ids = z.gather(-1, index)
    # The tail bucket: the complement's own logsumexp (no 1 - sum(top-k) cancellation), in place on the
    # working copy -- the one pass over the vocabulary; the normaliser then comes from k + 1 numbers.
    z.scatter_(-1, index, -math.inf)
    top = z.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # an empty tail (k = vocabulary): exp(-inf) = 0
    tail = top + torch.log(z.sub_(top).exp_().sum(dim=-1, keepdim=True))
    buckets = torch.cat([at_ids, tail], dim=-1)
    return buckets - torch.logsumexp(buckets, dim=-1, keepdim=True)


@torch.no_grad()
def topk_rows(chunk: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old's top-k of each row of ``chunk`` (``(rows, vocab)`` logits): ``(log_masses, ids)``,
    ``(rows, k + 1)`` float32 (see :func:`log_masses_rows`) and ``(rows, k)`` int32.

    The producer on materialised logits (the vocabulary pass has its own:
    :func:`verl_ext.vocab_pass.bucket_log_masses` on the pass's top-k ids)."""
    if not 1 <= k <= chunk.shape[-1]:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.kl_full_top_k={k} must lie in [1, vocabulary size "
            f"{chunk.shape[-1]}]"
        )
    ids = torch.topk(chunk.detach(), k, dim=-1, sorted=True).indices
    return log_masses_rows(chunk, ids), ids.to(torch.int32)


def _over_row_chunks(
    logits: torch.Tensor, rows: torch.Tensor, fn: Callable[[torch.Tensor, slice], tuple[torch.Tensor, ...]]
) -> list[tuple[torch.Tensor, ...]]:
    step = _chunk_rows(logits)
    return [fn(logits[rows[start : start + step]], slice(start, start + step)) for start in range(0, rows.numel(), step)]


@torch.no_grad()
def topk_of_rows(logits: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_rows` of ``logits[rows]``, in chunks of :data:`verl_ext.entropy.EAGER_CHUNK_BYTES` of float32."""
    parts = _over_row_chunks(logits, rows, lambda chunk, _: topk_rows(chunk, k))
    if not parts:
        return logits.new_zeros((0, k + 1), dtype=torch.float32), torch.zeros((0, k), dtype=torch.int32, device=logits.device)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def log_masses_of_rows(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`log_masses_rows` of ``logits[rows]`` on ``ids`` (``(len(rows), k)``), chunked."""
    parts = _over_row_chunks(logits, rows, lambda chunk, span: (log_masses_rows(chunk, ids[span]),))
    if not parts:
        return logits.new_zeros((0, ids.shape[-1] + 1), dtype=torch.float32)
    return torch.cat([p[0] for p in parts])


def coarsened_kl(new_log_masses: torch.Tensor, old_log_masses: torch.Tensor, direction: Direction = "forward") -> torch.Tensor:
    """Per-token KL between pi_theta and pi_old on pi_old's k + 1 buckets (top-k ids + tail), float64.

    ``forward``: KL(pi_theta || pi_old) = sum_b p_b (log p_b - log q_b) (ATR-GRPO Eq. 4);
    ``reverse``: KL(pi_old || pi_theta) (Truly PPO's trigger). A lower bound of the full-vocabulary
    KL, equal to it when the tail is empty. Buckets without mass under the weighting policy
    contribute 0 (also when the other policy has none there: ``0 log 0 = 0``).

    Args:
        new_log_masses, old_log_masses: ``(..., k + 1)`` log-masses of pi_theta and pi_old.
    """
    if direction not in KL_DIRECTIONS:
        raise ValueError(f"actor_rollout_ref.actor.policy_loss.kl_full_direction={direction!r}: must be one of {KL_DIRECTIONS}")
    new, old = new_log_masses.detach().double(), old_log_masses.detach().double()
    # renormalise in float64: removes each row's float32 logsumexp rounding, a constant shift of all
    # its log-masses that would otherwise enter the KL in full (it does not cancel between policies)
    new = new - torch.logsumexp(new, dim=-1, keepdim=True)
    old = old - torch.logsumexp(old, dim=-1, keepdim=True)
    weight_log, other_log = (new, old) if direction == "forward" else (old, new)
    weight = torch.exp(weight_log)
    terms = torch.where(weight > 0, weight * (weight_log - other_log), 0.0)
    return terms.sum(-1).clamp_min(0.0)  # >= 0 exactly; rounding of normalised inputs can dip below


def padded_response(nested: torch.Tensor, max_len: int) -> torch.Tensor:
    """``(batch, max_len, C)`` from a nested ``(batch, j, C)`` field (zeros beyond each row's length).

    Done by hand: ``to_padded_tensor`` of a 3-D jagged tensor built without ``max_seqlen`` metadata
    pads to the total token count instead of the longest row."""
    values, lengths = nested.values(), nested.offsets().diff()
    start = int(nested.offsets()[0])
    out = values.new_zeros((len(lengths), max_len, values.shape[-1]))
    for row, length in enumerate(lengths.tolist()):
        out[row, :length] = values[start : start + length]
        start += length
    return out


@dataclass(frozen=True)
class TopKLogMasses:
    """pi_old's stored k + 1 log-masses and pi_theta's on the same buckets, ``(batch, T, k + 1)``."""

    old: torch.Tensor
    new: torch.Tensor

    def kl(self, direction: Direction) -> torch.Tensor:
        return coarsened_kl(self.new, self.old, direction)

    def tail_masses(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tail-bucket masses (pi_old, pi_theta): how much of each policy the coarsening merged."""
        return torch.exp(self.old[..., -1].double()), torch.exp(self.new[..., -1].double())


# ------------------------------------------------------------------------------------------------
# Metrics of the constraint and of the KL3-vs-trust-region diagnostic
# ------------------------------------------------------------------------------------------------


def full_kl_sums(kl: torch.Tensor, topk: TopKLogMasses, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for the metrics of the coarsened KL (the caller averages them over valid tokens, except
    :data:`NOT_AVERAGED`): its mean and max over valid tokens, and both policies' tail masses."""
    tail_old, tail_new = topk.tail_masses()
    valid_kl = torch.where(mask, kl, 0.0)
    return {
        "kl_full_mean": valid_kl.sum(),
        "kl_full_max": valid_kl.max() if kl.numel() else kl.new_zeros(()),
        "kl_full_tail_old": torch.where(mask, tail_old, 0.0).sum(),
        "kl_full_tail_new": torch.where(mask, tail_new, 0.0).sum(),
    }


def diagnostic_sums(
    kl: torch.Tensor,
    mask: torch.Tensor,
    clipped: torch.Tensor,
    pessimistic_side: torch.Tensor,
    deltas: dict[str, float],
) -> dict[str, torch.Tensor]:
    """The KL3-vs-trust-region diagnostic: for each named budget delta, the counts of valid tokens the
    mode clips but the full-KL rule (KL_t > delta on Eq. 5's pessimistic side) keeps (``mode_only``),
    and the converse (``full_only``); the coarsened KL summed over clipped and unclipped tokens."""
    sums: dict[str, torch.Tensor] = {}
    mode_clipped = clipped & mask
    for name, delta in deltas.items():
        full_clipped = (kl > delta) & pessimistic_side & mask
        sums[f"kl_full_diag/mode_only_frac{name}"] = torch.count_nonzero(mode_clipped & ~full_clipped)
        sums[f"kl_full_diag/full_only_frac{name}"] = torch.count_nonzero(full_clipped & ~mode_clipped)
    sums["kl_full_diag/n_clipped"] = torch.count_nonzero(mode_clipped)
    sums["kl_full_diag/kl_clipped_sum"] = torch.where(mode_clipped, kl, 0.0).sum()
    sums["kl_full_diag/kl_unclipped_sum"] = torch.where(mask & ~mode_clipped, kl, 0.0).sum()
    return sums


NOT_AVERAGED = frozenset({"kl_full_max", "kl_full_diag/kl_clipped_mean", "kl_full_diag/kl_unclipped_mean"})
"""Metric names that are final as :func:`finish_full_kl_metrics` leaves them (not per-valid-token means)."""


def finish_full_kl_metrics(values: dict[str, float], n_valid: float) -> None:
    """Turn the diagnostic's clipped/unclipped KL sums into means over their own tokens (in place)."""
    if "kl_full_diag/n_clipped" not in values:
        return
    n_clipped = values.pop("kl_full_diag/n_clipped")
    values["kl_full_diag/kl_clipped_mean"] = values.pop("kl_full_diag/kl_clipped_sum") / max(n_clipped, 1.0)
    values["kl_full_diag/kl_unclipped_mean"] = values.pop("kl_full_diag/kl_unclipped_sum") / max(n_valid - n_clipped, 1.0)


# ------------------------------------------------------------------------------------------------
# The driver side: ask the old-log-prob pass for the top-k
# ------------------------------------------------------------------------------------------------


def old_topk_request(policy: Any) -> int:
    """k to store for a run with policy-loss config ``policy`` (a mapping or dataclass), 0 for none:
    ``loss_mode=kl_full`` needs it, and any divclip mode with ``kl_full_diagnostic=True``."""
    get = policy.get if hasattr(policy, "get") else (lambda key, default=None: getattr(policy, key, default))
    wanted = get("loss_mode", None) == "kl_full" or bool(get("kl_full_diagnostic", False))
    return int(get("kl_full_top_k", 0)) if wanted else 0


@contextmanager
def capturing_old_topk(extra_info: MutableMapping[str, Any], k: int) -> Iterator[None]:
    """Set :data:`CAPTURE_KEY` = k in a batch's ``extra_info`` for the block (the old-log-prob pass)
    and remove it after, so no later pass (the reference policy's, which may share the actor's
    engine under LoRA) overwrites pi_old's top-k. ``k = 0``: nothing to capture, nothing set."""
    if k <= 0:
        yield
        return
    extra_info[CAPTURE_KEY] = int(k)
    try:
        yield
    finally:
        extra_info.pop(CAPTURE_KEY, None)


# ------------------------------------------------------------------------------------------------
# The engine hook
# ------------------------------------------------------------------------------------------------

_INSTALLED_MARK = "_verl_ext_full_kl_installed"


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
    rows = [torch.arange(int(s), int(s) + int(n)) for s, n in zip(starts, response_lens)]
    return (torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)), response_offsets


class _Step:
    """What one forward step captures: from the logits verl hands to ``logprobs_from_logits``
    (materialised path), or from the LM head's input under the vocabulary pass (a
    :class:`verl_ext.vocab_pass_engine.HeadObserver`: pi_old's ids come from the pass's top-k, the
    log-masses from :func:`verl_ext.vocab_pass.bucket_log_masses` on the response rows)."""

    def __init__(self, micro_batch: Any, capture_k: int, old_ids: Optional[torch.Tensor]) -> None:
        self.micro_batch = micro_batch
        self.capture_k = capture_k
        self.old_ids = old_ids
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

    def _store(self, offsets: torch.Tensor, old: Optional[tuple[torch.Tensor, torch.Tensor]], new: Optional[torch.Tensor]) -> None:
        if old is not None:
            self.outputs[OLD_TOPK_LOG_PROBS] = torch.nested.nested_tensor_from_jagged(old[0], offsets)
            self.outputs[OLD_TOPK_IDS] = torch.nested.nested_tensor_from_jagged(old[1], offsets)
        if new is not None:
            self.outputs[NEW_TOPK_LOG_PROBS] = torch.nested.nested_tensor_from_jagged(new, offsets)

    def on_logits(self, logits: torch.Tensor) -> None:
        rows, offsets = self._rows(logits.shape[0], logits.device)
        old = topk_of_rows(logits, rows, self.capture_k) if self.capture_k else None
        new = None if self.old_ids is None else log_masses_of_rows(logits, rows, self.old_ids.to(logits.device))
        self._store(offsets, old, new)

    # -- the vocabulary pass's HeadObserver protocol ------------------------------------------------

    def requested_top_k(self, vocab: int) -> int:
        if self.capture_k > vocab:
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.kl_full_top_k={self.capture_k} must lie in [1, vocabulary size {vocab}]"
            )
        return self.capture_k

    def on_head(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, top_ids: Optional[torch.Tensor]) -> None:
        from verl_ext.vocab_pass import bucket_log_masses

        rows, offsets = self._rows(hidden.shape[0], hidden.device)
        hidden_rows, temperature_rows = hidden[rows], temperature.reshape(-1)[rows]
        old = None
        if self.capture_k:
            assert top_ids is not None  # requested_top_k asked the pass for them
            ids = top_ids[rows, : self.capture_k]  # another observer may have asked for more
            old = (bucket_log_masses(hidden_rows, weight, ids, temperature_rows), ids.to(torch.int32))
        new = None
        if self.old_ids is not None:
            new = bucket_log_masses(hidden_rows, weight, self.old_ids.to(hidden.device), temperature_rows)
        self._store(offsets, old, new)

    def model_outputs(self) -> dict[str, torch.Tensor]:
        if not self.served:
            raise RuntimeError("kl_full: the vocabulary pass's head never ran in this forward step")
        return dict(self.outputs)


def _step_request(micro_batch: Any, loss_function: Any) -> tuple[int, Optional[torch.Tensor]]:
    """(k to capture, pi_old's stored ids to evaluate pi_theta on) for this forward step."""
    from verl.utils import tensordict_utils as tu

    capture_k = 0
    if loss_function is None:  # a forward-only pass without loss: the old-log-prob pass asks with CAPTURE_KEY
        capture_k = int(tu.get_non_tensor_data(data=micro_batch, key=CAPTURE_KEY, default=0) or 0)
    old_ids = None
    if loss_function is not None and OLD_TOPK_IDS in micro_batch.keys():
        ids = micro_batch[OLD_TOPK_IDS]
        if not ids.is_nested:
            raise ValueError(f"{OLD_TOPK_IDS} must be in verl's nested response layout, got a {tuple(ids.shape)} tensor")
        offsets = ids.offsets()
        old_ids = ids.values()[int(offsets[0]) : int(offsets[-1])]
    return capture_k, old_ids


def _wrap_forward_step(forward_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward_step)
    def forward_step_with_full_kl(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        capture_k, old_ids = _step_request(micro_batch, loss_function)
        if not capture_k and old_ids is None:
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)
        step = _Step(micro_batch, capture_k, old_ids)
        with _step_hooks(self, step, _vocab_pass_serves(self, loss_function)):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)

    setattr(forward_step_with_full_kl, _INSTALLED_MARK, True)
    return forward_step_with_full_kl


def _vocab_pass_serves(engine: Any, loss_function: Any) -> bool:
    """Whether this step runs through the vocabulary pass (no logits tensor to read): the pass's own
    routing rule, so the two hooks cannot disagree."""
    from verl_ext.vocab_pass_engine import step_uses_vocab_pass

    return step_uses_vocab_pass(engine, loss_function)


@contextmanager
def _step_hooks(engine: Any, step: _Step, vocab_pass: bool) -> Iterator[None]:
    """For one forward step: see the logits verl passes to ``logprobs_from_logits`` and add the
    step's outputs to the model output ``prepare_model_outputs`` returns (before the loss runs).
    Under the vocabulary pass the step observes the LM head's input instead, and the pass's own
    ``prepare_model_outputs`` adds the outputs."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    from verl_ext.entropy import _attribute

    if getattr(engine, "use_ulysses_sp", False):
        raise ValueError(
            "kl_full's top-k is taken from the logits of whole packed sequences; Ulysses sequence parallelism "
            "shards them: set actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1"
        )
    if vocab_pass:
        from verl_ext.vocab_pass_engine import observing_head

        with observing_head(engine, step):
            yield
        if not step.served:  # e.g. the pass's own hook (install_vocab_pass) is missing in this process
            raise RuntimeError("kl_full: the vocabulary pass's head never ran in this forward step "
                               "(is verl_ext.vocab_pass_engine.install_vocab_pass installed in this process?)")
        return
    original_logprobs = impl.logprobs_from_logits

    @functools.wraps(original_logprobs)
    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        step.on_logits(logits)
        return original_logprobs(logits, labels, *args, **kwargs)

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

    with ExitStack() as stack:
        stack.enter_context(_attribute(impl, "logprobs_from_logits", logprobs_from_logits))
        stack.enter_context(_attribute(engine, "prepare_model_outputs", prepare_model_outputs))
        yield


def install_full_kl_hook() -> None:
    """Wrap ``FSDPEngineWithLMHead.forward_step`` (idempotent). Inert unless a forward step's batch
    asks for the capture (:data:`CAPTURE_KEY`) or carries pi_old's stored ids (:data:`OLD_TOPK_IDS`)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    # functools.wraps copies the wrapped function's __dict__, so each hook's mark survives the other's wrap
    if getattr(FSDPEngineWithLMHead.forward_step, _INSTALLED_MARK, False):
        return
    FSDPEngineWithLMHead.forward_step = _wrap_forward_step(FSDPEngineWithLMHead.forward_step)
