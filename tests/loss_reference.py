"""A deliberately naive reference for the divclip losses: one Python loop over tokens.

Each constraint is evaluated from its *definition* (the divergence against delta, the
DCPO/clip formulas in plain ``math``), never from the closed-form ratio bounds the
implementation uses, and Eq. 5's pessimistic min is taken with an explicit comparison.
Token-mean aggregation (:func:`reference_loss`), or the per-token matrix for any other
(:func:`reference_surrogate_matrix`). ``seq_kl3`` is built sequence by sequence
(:func:`reference_sequence_loss`): GSPO's s_i from the mean log-ratio of the row's valid
tokens, KL3(s_i) = s_i - 1 - log s_i against delta.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class RefKnobs:
    mode: str
    eps_low: float = 0.2
    eps_high: float = 0.28
    delta: float = 0.07
    dual_clip_c: Optional[float] = None
    gppo_beta_low: float = 1.0
    gppo_beta_high: float = 1.0
    dcpo_cap: float = 10.0
    erc_beta_low: Optional[float] = None
    erc_beta_high: Optional[float] = None
    erc_eps: float = 1e-8


def _bernoulli_kl(q: float, w: float) -> float:
    if q * w >= 1.0:
        return math.inf
    first = -q * math.log(w)
    second = 0.0 if q == 1.0 else (1 - q) * math.log((1 - q) / (1 - q * w))
    return first + second


def reference_bounds_dcpo(q: float, knobs: RefKnobs) -> tuple[float, float]:
    lower = 0.5 + 0.5 * math.sqrt(max(0.0, 1 - 4 * knobs.eps_low / q))
    upper = min(0.5 + 0.5 * math.sqrt(1 + 4 * knobs.eps_high / q), knobs.dcpo_cap)
    return lower, upper


def reference_inside(w: float, old_log_prob: float, knobs: RefKnobs) -> bool:
    in_clip = 1 - knobs.eps_low <= w <= 1 + knobs.eps_high
    mode, delta = knobs.mode, knobs.delta
    if mode in ("clip", "gppo"):
        return in_clip
    if mode == "kl3":
        return w - 1 - math.log(w) <= delta
    if mode == "kl1":
        return abs(-math.log(w)) <= delta
    if mode == "kl2":
        return 0.5 * math.log(w) ** 2 <= delta
    if mode == "is_kl3":
        return w * math.log(w) - w + 1 <= delta
    if mode == "trgppo":
        return in_clip or _bernoulli_kl(math.exp(old_log_prob), w) <= delta
    if mode == "dcpo":
        lower, upper = reference_bounds_dcpo(math.exp(old_log_prob), knobs)
        return lower <= w <= upper
    raise ValueError(mode)


def _dual_clip_and_erc(
    surrogate: torch.Tensor,
    ratio: float,
    adv: float,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor],
    entropy: Optional[torch.Tensor],
    index: tuple[int, int],
) -> torch.Tensor:
    """The options every mode shares, applied to one token's surrogate: dual-clip (A < 0 and
    w > c: the constant c A) and ERC (outside the entropy band: value kept, gradient gone)."""
    if knobs.dual_clip_c is not None and adv < 0 and ratio > knobs.dual_clip_c:
        surrogate = surrogate.new_tensor(knobs.dual_clip_c * adv)
    if knobs.erc_beta_low is not None:
        eps = knobs.erc_eps
        rho = (float(entropy[index]) + eps) / (float(old_entropy[index]) + eps)
        if not (1 - knobs.erc_beta_low < rho < 1 + knobs.erc_beta_high):
            surrogate = surrogate.detach()
    return surrogate


def reference_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Token-mean loss built token by token (log_prob may require grad)."""
    total = log_prob.new_zeros(())
    count = 0
    for _, surrogate in reference_terms(old_log_prob, log_prob, advantages, mask, knobs, old_entropy, entropy):
        count += 1
        total = total - surrogate
    return total / max(count, 1)


def reference_surrogate_matrix(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The per-token surrogate of Eq. 5 (before the sign and the aggregation) as a ``log_prob``-shaped
    matrix, 0 on masked tokens: for any aggregation (verl's ``agg_loss``) of the reference."""
    terms = dict(reference_terms(old_log_prob, log_prob, advantages, mask, knobs, old_entropy, entropy))
    zero = log_prob.new_zeros(())
    rows, cols = log_prob.shape
    return torch.stack([torch.stack([terms.get((i, j), zero) for j in range(cols)]) for i in range(rows)])


def reference_terms(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> Iterator[tuple[tuple[int, int], torch.Tensor]]:
    """``((i, j), surrogate)`` of every valid token, row by row: Eq. 5's term w A or its replacement."""
    if knobs.mode == "seq_kl3":
        yield from reference_sequence_terms(old_log_prob, log_prob, advantages, mask, knobs, old_entropy, entropy)
        return
    rows, cols = log_prob.shape
    for i in range(rows):
        for j in range(cols):
            if not bool(mask[i, j]):
                continue
            old = float(old_log_prob[i, j])
            adv = float(advantages[i, j])
            x = torch.clamp(log_prob[i, j] - old, -20.0, 20.0)
            w = torch.exp(x)
            wv = w.item()
            if reference_inside(wv, old, knobs):
                surrogate = w * adv
            elif knobs.mode == "gppo" and ((wv > 1 and adv > 0) or (wv < 1 and adv < 0)):
                bound, beta = (
                    (1 + knobs.eps_high, knobs.gppo_beta_high) if wv > 1 else (1 - knobs.eps_low, knobs.gppo_beta_low)
                )
                surrogate = bound * adv + beta * bound * adv * (w / wv - 1)
            else:
                # Eq. 5: min(w A, 1 * A) with the replacement a constant.
                surrogate = w * adv if wv * adv <= adv else w.new_tensor(adv)
            yield (i, j), _dual_clip_and_erc(surrogate, wv, adv, knobs, old_entropy, entropy, (i, j))


def reference_sequence_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Sequence-level KL3 (ATR-GRPO Sec. 6.5), token-mean (:func:`reference_sequence_terms`)."""
    knobs = dataclasses.replace(knobs, mode="seq_kl3")
    return reference_loss(old_log_prob, log_prob, advantages, mask, knobs, old_entropy, entropy)


def reference_sequence_terms(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    knobs: RefKnobs,
    old_entropy: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
) -> Iterator[tuple[tuple[int, int], torch.Tensor]]:
    """Sequence-level KL3 (ATR-GRPO Sec. 6.5), one sequence at a time.

    Every valid token of row i uses the ratio s_i = exp(mean of its row's clamped log-ratios)
    in GSPO-token form: value s_i, derivative s_i with respect to the token's own log-prob.
    A row whose KL3(s_i) exceeds delta has its ratio replaced by the constant 1 inside
    min(s A, 1 A), decided per token by the sign of A_t.
    """
    rows, cols = log_prob.shape
    for i in range(rows):
        valid = [j for j in range(cols) if bool(mask[i, j])]
        if not valid:
            continue
        xs = {j: torch.clamp(log_prob[i, j] - float(old_log_prob[i, j]), -20.0, 20.0) for j in valid}
        log_s = sum(x.item() for x in xs.values()) / len(valid)
        s = math.exp(log_s)
        inside = s - 1 - log_s <= knobs.delta
        for j in valid:
            adv = float(advantages[i, j])
            ratio = s * torch.exp(xs[j] - xs[j].item())  # value s, d/dlog pi_t = s
            if inside or s * adv <= adv:
                surrogate = ratio * adv
            else:
                surrogate = ratio.new_tensor(adv)  # min(s A, 1 A) = 1 A, a constant
            yield (i, j), _dual_clip_and_erc(surrogate, s, adv, knobs, old_entropy, entropy, (i, j))


def bucket_log_masses_fp64(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of ``logits`` on ``ids`` (each its own bucket) plus the logsumexp of every other id (the
    tail): ``(rows, k + 1)``, the reference of :func:`verl_ext.core.coarsened_kl.log_masses_rows` and
    :func:`verl_ext.core.vocab_pass.bucket_log_masses`."""
    log_p = torch.log_softmax(logits.double(), dim=-1)
    index = ids.long()
    tail = torch.logsumexp(log_p.scatter(-1, index, -math.inf), dim=-1, keepdim=True)
    return torch.cat([log_p.gather(-1, index), tail], dim=-1)
