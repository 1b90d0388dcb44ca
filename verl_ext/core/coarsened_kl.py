"""The math of ``kl_full``, ATR-GRPO Eq. 4's per-token trust region over pi_old's stored top-k: pi_old's k + 1
bucket log-masses (:func:`topk_rows`), pi_theta's on the same buckets (:func:`log_masses_rows`) and the KL between
them (:func:`coarsened_kl`), a lower bound of the full KL. The passes: :mod:`verl_ext.engine.topk_capture`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from verl_ext.config import KL_FULL_DIRECTIONS
from verl_ext.core.entropy import chunk_rows_for

KL_DIRECTIONS = KL_FULL_DIRECTIONS
Direction = Literal["forward", "reverse"]

#: The config key of k, named by every error about it.
TOP_K_KEY = "actor_rollout_ref.actor.policy_loss.kl_full_top_k"

BYTES_PER_ID = 4  # int32 ids: every vocabulary in use is < 2^31
BYTES_PER_LOG_MASS = 4  # float32


def stored_bytes_per_token(k: int) -> int:
    """Bytes the stored top-k adds per response token: k int32 ids + (k + 1) float32 log-masses."""
    return k * BYTES_PER_ID + (k + 1) * BYTES_PER_LOG_MASS


# ------------------------------------------------------------------------------------------------
# The math (pure functions, any device)
# ------------------------------------------------------------------------------------------------


def check_top_k(k: int, vocab: int, key: str = TOP_K_KEY, low: int = 1) -> int:
    """``k`` if ``low <= k <= vocab``, else a ValueError naming ``key`` and the vocabulary size: the one check of
    a top-k size against a vocabulary."""
    if isinstance(k, bool) or not isinstance(k, int) or not low <= k <= vocab:
        raise ValueError(f"{key}={k!r} must lie in [{low}, vocabulary size {vocab}]")
    return k


def tail_log_mass_(z: torch.Tensor) -> torch.Tensor:
    """``(rows, 1)``: the tail bucket's log-mass, the logsumexp of each row of ``z`` (logits with the bucket
    columns at ``-inf``; an all ``-inf`` row gives ``-inf``). Overwrites ``z``."""
    top = z.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # an empty tail: exp(-inf) = 0, log 0 = -inf
    return top + torch.log(z.sub_(top).exp_().sum(dim=-1, keepdim=True))


@torch.no_grad()
def log_masses_rows(chunk: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-masses of ``softmax(chunk)`` (``(rows, vocab)`` logits) on ``ids`` (``(rows, k)``, distinct per row):
    ``(rows, k + 1)`` float32, ``log p(ids)`` then the tail (``-inf`` when ``k`` = vocabulary), row by row."""
    z = chunk.detach().float()  # our own working copy (a view only if chunk is float32: cloned below)
    if z.data_ptr() == chunk.data_ptr():
        z = z.clone()
    index = ids.long()
    at_ids = z.gather(-1, index)
    # The tail: the complement's own logsumexp (no 1 - sum(top-k) cancellation), the one vocabulary pass.
    z.scatter_(-1, index, -math.inf)
    buckets = torch.cat([at_ids, tail_log_mass_(z)], dim=-1)
    return buckets - torch.logsumexp(buckets, dim=-1, keepdim=True)


@torch.no_grad()
def topk_rows(chunk: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pi_old's top-k of each row of ``chunk`` (``(rows, vocab)`` logits): ``(log_masses, ids)``,
    ``(rows, k + 1)`` float32 (:func:`log_masses_rows`) and ``(rows, k)`` int32."""
    check_top_k(k, chunk.shape[-1])
    ids = torch.topk(chunk.detach(), k, dim=-1, sorted=True).indices
    return log_masses_rows(chunk, ids), ids.to(torch.int32)


def _over_row_chunks(
    logits: torch.Tensor, rows: torch.Tensor, fn: Callable[[torch.Tensor, slice], tuple[torch.Tensor, ...]]
) -> list[tuple[torch.Tensor, ...]]:
    step = chunk_rows_for(logits)
    return [
        fn(logits[rows[start : start + step]], slice(start, start + step)) for start in range(0, rows.numel(), step)
    ]


@torch.no_grad()
def topk_of_rows(logits: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_rows` of ``logits[rows]``, chunked."""
    parts = _over_row_chunks(logits, rows, lambda chunk, _: topk_rows(chunk, k))
    if not parts:
        return logits.new_zeros((0, k + 1), dtype=torch.float32), torch.zeros(
            (0, k), dtype=torch.int32, device=logits.device
        )
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@torch.no_grad()
def log_masses_of_rows(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """:func:`log_masses_rows` of ``logits[rows]`` on ``ids`` (``(len(rows), k)``), chunked."""
    parts = _over_row_chunks(logits, rows, lambda chunk, span: (log_masses_rows(chunk, ids[span]),))
    if not parts:
        return logits.new_zeros((0, ids.shape[-1] + 1), dtype=torch.float32)
    return torch.cat([p[0] for p in parts])


def coarsened_kl(
    new_log_masses: torch.Tensor, old_log_masses: torch.Tensor, direction: Direction = "forward"
) -> torch.Tensor:
    """Per-token KL between pi_theta and pi_old on pi_old's k + 1 buckets (``(..., k + 1)`` log-masses), float64.

    ``forward``: KL(pi_theta || pi_old) = sum_b p_b (log p_b - log q_b) (ATR-GRPO Eq. 4); ``reverse``:
    KL(pi_old || pi_theta) (Truly PPO's trigger). A bucket without mass under the weighting policy adds 0.
    """
    if direction not in KL_DIRECTIONS:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.kl_full_direction={direction!r}: must be one of {KL_DIRECTIONS}"
        )
    new, old = new_log_masses.detach().double(), old_log_masses.detach().double()
    # renormalise in float64: removes each row's float32 logsumexp rounding, a constant shift of all
    # its log-masses that would otherwise enter the KL in full (it does not cancel between policies)
    new = new - torch.logsumexp(new, dim=-1, keepdim=True)
    old = old - torch.logsumexp(old, dim=-1, keepdim=True)
    weight_log, other_log = (new, old) if direction == "forward" else (old, new)
    weight = torch.exp(weight_log)
    terms = torch.where(weight > 0, weight * (weight_log - other_log), 0.0)
    return terms.sum(-1).clamp_min(0.0)  # >= 0 exactly; rounding of normalised inputs can dip below


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
    """Sums of the coarsened KL's metrics (mean and max, both tail masses), averaged by the caller over valid
    tokens except :data:`NOT_AVERAGED`."""
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
    """The KL3-vs-trust-region diagnostic: per budget delta, the valid tokens the mode clips but the full-KL rule
    (KL_t > delta on Eq. 5's pessimistic side) keeps (``mode_only``) and the converse (``full_only``); the
    coarsened KL summed over clipped and unclipped tokens."""
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
    values["kl_full_diag/kl_unclipped_mean"] = values.pop("kl_full_diag/kl_unclipped_sum") / max(
        n_valid - n_clipped, 1.0
    )
