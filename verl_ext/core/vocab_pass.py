"""The vocabulary pass: log pi(y_t) (ATR-GRPO Eq. 5's ratio), the entropy (ERC Eq. 6), ``kl_full``'s top-k and
bucket log-masses from the final hidden states, over blocks of tokens and fixed float32 vocabulary slices, never
materialising the ``tokens x vocabulary`` logits (numerics, TF32 and tests: docs/losses.md, "The vocabulary pass").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from verl_ext.core.coarsened_kl import check_top_k, tail_log_mass_
from verl_ext.core.entropy import EagerRows, chunk_bytes_for, merge_row_stats

__all__ = ["VocabPassOutput", "VocabPass", "vocab_pass", "bucket_log_masses", "tensor_core_matmuls", "tf32_matmuls"]


@dataclass
class VocabPassOutput:
    """Per-token results of :func:`vocab_pass`, float32: ``log_probs`` (log pi(y_t) at the temperature,
    differentiable), ``entropy`` (nats; differentiable with ``entropy_grad=True``), and without a graph
    ``top_log_probs`` (descending) with their int64 ``top_ids``, ``None`` when ``top_k == 0``."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    top_log_probs: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None


VOCAB_SLICE = 8192
"""Vocabulary columns per slice of the forward: fixed, so that each token's result is computed the
same way whatever the batch it is packed in (ERC's on-policy ratio needs both passes to agree)."""


HALF_DTYPES = (torch.bfloat16, torch.float16)


def tensor_core_matmuls(hidden: torch.Tensor, weight: torch.Tensor, requested: Optional[bool] = None) -> bool:
    """Whether the pass's float32 matmuls may run as TF32: on CUDA with half-precision operands (verl's bf16
    default), whose values TF32 holds exactly, so the logits equal float32's up to summation order.
    ``requested``: ``None`` decides so, ``False`` forces IEEE float32, ``True`` is honoured only there."""
    eligible = hidden.device.type == "cuda" and hidden.dtype in HALF_DTYPES and weight.dtype in HALF_DTYPES
    return eligible and requested is not False


@contextmanager
def tf32_matmuls(enabled: bool) -> Iterator[None]:
    """TF32 for cuBLAS's float32 matmuls inside the block only (``fp32_precision``, else the legacy
    ``allow_tf32``), restored on exit even on error, so verl's other matmuls keep the user's setting."""
    if not enabled:
        yield
        return
    matmul = torch.backends.cuda.matmul
    name, value = ("fp32_precision", "tf32") if hasattr(matmul, "fp32_precision") else ("allow_tf32", True)
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def _float32_logits_into(out: torch.Tensor, hidden32: torch.Tensor, weight_slice: torch.Tensor, tf32: bool) -> None:
    """``out = hidden32 @ weight_slice^T`` in float32 (bf16 products are exact in float32), on tensor cores
    with ``tf32`` (:func:`tensor_core_matmuls`)."""
    with tf32_matmuls(tf32):
        if out.is_contiguous():
            torch.mm(hidden32, weight_slice.float().t(), out=out)
        else:
            out.copy_(hidden32 @ weight_slice.float().t())


def _forward_blocks(tokens: int, vocab: int, chunk_bytes: int) -> tuple[int, int]:
    """``(rows per block, slice width)`` of a forward sweep: the width is fixed (:data:`VOCAB_SLICE`); a block's
    float32 ``rows x slice`` buffer holds at most ``chunk_bytes`` (or one row)."""
    slice_width = min(vocab, VOCAB_SLICE)
    return max(1, min(tokens, chunk_bytes // (4 * slice_width))), slice_width


def _backward_slice(tokens: int, vocab: int, chunk_bytes: int) -> int:
    """Head rows per slice of the backward, which recomputes all tokens' logits one head slice at a time: the
    float32 ``tokens x slice`` logits hold at most ``chunk_bytes`` (or one row)."""
    return max(1, min(vocab, chunk_bytes // (4 * tokens)))


def _logit_slices(
    hidden32: torch.Tensor, weight: torch.Tensor, inv_t: torch.Tensor, buffer: torch.Tensor, tf32: bool
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """``(v0, v1, z)`` per vocabulary slice: one block's float32 logits ``hidden32 @ weight[v0:v1]^T / T`` in
    ``buffer``, overwritten by the next slice. Every forward sweep builds its logits here: the same numbers."""
    rows, width, vocab = hidden32.shape[0], buffer.shape[1], weight.shape[0]
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        z = buffer[:rows, : v1 - v0]
        _float32_logits_into(z, hidden32, weight[v0:v1], tf32)
        yield v0, v1, z.mul_(inv_t)


def _per_row(temperature: Union[float, torch.Tensor], rows: int, device: torch.device) -> torch.Tensor:
    """``1/T`` per token as a float32 ``(rows,)`` tensor (a scalar or one value per token)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach().to(device=device, dtype=torch.float32).reshape(-1)
        if t.numel() == 1:
            t = t.expand(rows)
        if t.numel() != rows:
            raise ValueError(f"temperature has {t.numel()} values for {rows} tokens (give a scalar or one per token)")
    else:
        t = torch.full((rows,), float(temperature), dtype=torch.float32, device=device)
    if not bool(torch.isfinite(t).all()) or bool((t <= 0).any()):
        raise ValueError("temperature must be finite and > 0 (actor_rollout_ref.rollout.temperature)")
    return t.reciprocal()


class VocabPass(torch.autograd.Function):
    """Autograd function behind :func:`vocab_pass` (the math: docs/losses.md, "The vocabulary pass")."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        inv_temperature: torch.Tensor,
        top_k: int,
        entropy_grad: bool,
        chunk_bytes: int,
        tf32: bool,
    ) -> tuple[torch.Tensor, ...]:
        tokens, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        rows, slice_width = _forward_blocks(tokens, vocab, chunk_bytes)
        log_probs = torch.empty(tokens, dtype=torch.float32, device=device)
        entropy = torch.empty(tokens, dtype=torch.float32, device=device)
        log_normaliser = torch.empty(tokens, dtype=torch.float32, device=device)
        top_lp = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
        top_ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
        if tokens:
            logits = torch.empty(rows, slice_width, dtype=torch.float32, device=device)
            reducer = EagerRows(rows, slice_width, device)
            with torch.autocast(device_type=device.type, enabled=False):
                for start in range(0, tokens, rows):  # a block of rows ...
                    stop = min(start + rows, tokens)
                    hidden32 = hidden[start:stop].float()
                    inv_t = inv_temperature[start:stop].unsqueeze(1)
                    block_labels = labels[start:stop]
                    stats = None
                    picked = torch.zeros(stop - start, dtype=torch.float32, device=device)
                    best = ids = None
                    # ... over vocabulary slices, merged exactly
                    for v0, v1, z in _logit_slices(hidden32, weight, inv_t, logits, tf32):
                        part = reducer.stats(z)
                        stats = part if stats is None else merge_row_stats(stats, part)
                        inside = (block_labels >= v0) & (block_labels < v1)
                        local = (block_labels - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)
                        picked = torch.where(inside, z.gather(1, local).squeeze(1), picked)
                        if top_k:
                            values, where = z.topk(min(top_k, v1 - v0), dim=1)
                            where = where + v0
                            if best is None:
                                best, ids = values, where
                            else:
                                joined = torch.cat([best, values], 1)
                                best, order = joined.topk(min(top_k, joined.shape[1]), dim=1)
                                ids = torch.cat([ids, where], 1).gather(1, order)
                    top, rest, spread = stats
                    log1p_rest = torch.log1p(rest)
                    entropy[start:stop] = log1p_rest + spread / (1.0 + rest)
                    log_normaliser[start:stop] = top + log1p_rest
                    log_probs[start:stop] = (picked - top) - log1p_rest
                    if top_k:
                        top_lp[start:stop] = (best[:, :top_k] - top.unsqueeze(1)) - log1p_rest.unsqueeze(1)
                        top_ids[start:stop] = ids[:, :top_k]
        ctx.entropy_grad = entropy_grad
        ctx.chunk_bytes = chunk_bytes
        ctx.tf32 = tf32
        if entropy_grad:  # dH/dz needs H
            ctx.save_for_backward(hidden, weight, labels, inv_temperature, log_normaliser, entropy)
            ctx.mark_non_differentiable(top_lp, top_ids)  # (one call: a second replaces the first)
        else:
            ctx.save_for_backward(hidden, weight, labels, inv_temperature, log_normaliser)
            ctx.mark_non_differentiable(entropy, top_lp, top_ids)
        return log_probs, entropy, top_lp, top_ids

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor], *_: Any
    ) -> tuple[Optional[torch.Tensor], ...]:
        hidden, weight, labels, inv_temperature, log_normaliser, *saved_entropy = ctx.saved_tensors
        entropy = saved_entropy[0] if saved_entropy else None
        tokens, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        if not ctx.entropy_grad:
            grad_entropy = None
        g_lp = None if grad_log_probs is None else grad_log_probs.float()
        g_h = None if grad_entropy is None else grad_entropy.float()
        grad_hidden32 = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=device)
        grad_weight = torch.zeros_like(weight)
        if tokens == 0 or (g_lp is None and g_h is None):
            return grad_hidden32.to(hidden.dtype), grad_weight, None, None, None, None, None, None
        slice_rows = _backward_slice(tokens, vocab, ctx.chunk_bytes)
        with torch.autocast(device_type=device.type, enabled=False):
            hidden32 = hidden.float()
            rows = torch.arange(tokens, device=device)
            for start in range(0, vocab, slice_rows):
                stop = min(start + slice_rows, vocab)
                weight32 = weight[start:stop].float()
                with tf32_matmuls(ctx.tf32):  # exact for half-precision values: the forward's logits
                    z = hidden32 @ weight32.t()  # (tokens, slice) logits, recomputed in float32
                z.mul_(inv_temperature.unsqueeze(1)).sub_(log_normaliser.unsqueeze(1))  # log pi
                p = torch.exp(z)
                if g_h is not None:  # dH/dz_j = -pi_j (log pi_j + H)
                    dz = z.add_(entropy.unsqueeze(1)).mul_(p).mul_(-g_h.unsqueeze(1))
                    if g_lp is not None:
                        dz.sub_(p.mul_(g_lp.unsqueeze(1)))
                else:  # d log pi_y / dz_j = onehot_j - pi_j
                    dz = p.mul_(-g_lp.unsqueeze(1))
                if g_lp is not None:
                    inside = (labels >= start) & (labels < stop)
                    dz[rows[inside], labels[inside] - start] += g_lp[inside]
                dz.mul_(inv_temperature.unsqueeze(1))  # z = x / T
                with tf32_matmuls(ctx.tf32):  # dz rounds to TF32: relative error <= 2^-11 per term
                    grad_weight[start:stop] = (dz.t() @ hidden32).to(weight.dtype)
                    grad_hidden32.addmm_(dz, weight32)
        return grad_hidden32.to(hidden.dtype), grad_weight, None, None, None, None, None, None


def vocab_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    *,
    top_k: int = 0,
    entropy_grad: bool = False,
    chunk_bytes: Optional[int] = None,
    tensor_cores: Optional[bool] = None,
) -> VocabPassOutput:
    """log pi(labels), entropy and optionally the top-k of ``softmax(hidden @ weight^T / T)``, chunked.

    Args:
        hidden: ``(..., hidden)`` final hidden states (after the last norm), any float dtype.
        weight: ``(vocab, hidden)`` LM-head weight (the unsharded parameter inside the head's forward).
        labels: ``(...)`` token ids whose log-probability is returned (verl's rolled input ids).
        temperature: A positive scalar, or one value per token.
        top_k: How many of the largest log-probabilities (and their ids) per token; 0: none.
        entropy_grad: Whether the entropy carries a gradient (an entropy bonus).
        chunk_bytes: Size of each float32 logits buffer; default :func:`chunk_bytes_for` the device.
        tensor_cores: As :func:`tensor_core_matmuls`'s ``requested``.

    Returns:
        :class:`VocabPassOutput` of shape ``labels.shape`` (top-k: ``labels.shape + (k,)``).
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} do not match")
    lead = hidden.shape[:-1]
    if tuple(labels.shape) != tuple(lead):
        raise ValueError(f"labels {tuple(labels.shape)} must have the hidden states' leading shape {tuple(lead)}")
    check_top_k(int(top_k), weight.shape[0], key="top_k", low=0)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).to(device=hidden.device, dtype=torch.int64)
    inv_t = _per_row(temperature, flat_hidden.shape[0], hidden.device)
    budget = int(chunk_bytes) if chunk_bytes is not None else chunk_bytes_for(hidden.device)
    if budget <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    log_probs, entropy, top_lp, top_ids = VocabPass.apply(
        flat_hidden,
        weight,
        flat_labels,
        inv_t,
        int(top_k),
        bool(entropy_grad),
        budget,
        tensor_core_matmuls(hidden, weight, tensor_cores),
    )
    k = int(top_k)
    return VocabPassOutput(
        log_probs=log_probs.reshape(lead),
        entropy=entropy.reshape(lead),
        top_log_probs=top_lp.reshape(*lead, k) if k else None,
        top_ids=top_ids.reshape(*lead, k) if k else None,
    )


@torch.no_grad()
def bucket_log_masses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    temperature: Union[float, torch.Tensor] = 1.0,
    *,
    chunk_bytes: Optional[int] = None,
    tensor_cores: Optional[bool] = None,
) -> torch.Tensor:
    """Log-masses of ``softmax(hidden @ weight^T / T)`` on ``k + 1`` buckets, without the logits tensor.

    ``ids``: ``(tokens, k)`` distinct ids per token, each its own bucket; the last bucket, the *tail*, holds
    every other id (as :func:`verl_ext.core.coarsened_kl.log_masses_rows`), summed directly as the logsumexp of
    each slice's non-bucket columns (no ``1 - sum(top-k)`` cancellation). The other arguments are
    :func:`vocab_pass`'s. Both passes call it on the same rows, so on-policy their results are bit-identical.

    Returns:
        ``(tokens, k + 1)`` float32 log-masses, normalised (tail ``-inf`` when ``k`` = vocabulary); no graph.
    """
    if weight.dim() != 2 or hidden.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} do not match")
    tokens, vocab = hidden.shape[0], weight.shape[0]
    if ids.dim() != 2 or ids.shape[0] != tokens:
        raise ValueError(f"ids {tuple(ids.shape)} must be (tokens={tokens}, k)")
    check_top_k(ids.shape[1], vocab, key="the number of bucket ids k")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"ids must lie in [0, vocab={vocab}), got [{int(ids.min())}, {int(ids.max())}] "
            "(pi_old's stored divclip_old_topk_ids from another model?)"
        )
    k = ids.shape[1]
    device = hidden.device
    inv_temperature = _per_row(temperature, tokens, device)
    budget = int(chunk_bytes) if chunk_bytes is not None else chunk_bytes_for(device)
    rows, slice_width = _forward_blocks(tokens, vocab, budget)
    n_slices = -(-vocab // slice_width)
    tf32 = tensor_core_matmuls(hidden, weight, tensor_cores)
    out = torch.empty(tokens, k + 1, dtype=torch.float32, device=device)
    if tokens == 0:
        return out
    logits = torch.empty(rows, slice_width, dtype=torch.float32, device=device)
    with torch.autocast(device_type=device.type, enabled=False):
        for start in range(0, tokens, rows):
            stop = min(start + rows, tokens)
            hidden32 = hidden[start:stop].float()
            inv_t = inv_temperature[start:stop].unsqueeze(1)
            block_ids = ids[start:stop].to(dtype=torch.int64)
            at_ids = torch.full((stop - start, k), -math.inf, dtype=torch.float32, device=device)
            slice_tails = torch.empty(stop - start, n_slices, dtype=torch.float32, device=device)
            for s, (v0, v1, z) in enumerate(_logit_slices(hidden32, weight, inv_t, logits, tf32)):
                inside = (block_ids >= v0) & (block_ids < v1)
                local = (block_ids - v0).clamp_(0, v1 - v0 - 1)
                at_ids = torch.where(inside, z.gather(1, local), at_ids)
                # the bucket ids leave the slice's tail: -inf at their columns; ids of other slices
                # point (clamped) at some column with +inf, which amin ignores -- order-independent
                z.scatter_reduce_(1, local, torch.where(inside, -math.inf, math.inf).to(z.dtype), reduce="amin")
                slice_tails[:, s] = tail_log_mass_(z).squeeze(1)  # every column a bucket: -inf
            buckets = torch.cat([at_ids, torch.logsumexp(slice_tails, dim=1, keepdim=True)], dim=1)
            out[start:stop] = buckets - torch.logsumexp(buckets, dim=1, keepdim=True)
    return out
