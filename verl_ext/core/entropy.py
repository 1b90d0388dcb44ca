"""The per-token entropy of a softmax in float32, cancellation-free and graph-free, for ERC's on-policy ratio
(verl's ``logsumexp(x) - sum(softmax(x) * x)`` in bf16 is noise for a confident token): H = log1p(r) +
sum(exp(z) * (-z)) / (1 + r), z = x - max(x), r = sum_{z<0} exp z + (#ties - 1), every term non-negative,
mergeable over vocabulary slices (docs/losses.md, "One function for both passes").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional

import torch

EAGER_CHUNK_BYTES: dict[str, int] = {"cpu": 16 << 20, "cuda": 256 << 20}
"""Size of one float32 ``rows x vocab`` working buffer, per device type: the eager entropy, the
coarsened KL's row chunks and the vocabulary pass's blocks are all sized by :func:`chunk_bytes_for`.
The eager entropy holds two such buffers (the shifted logits and their exponentials), reused by every
chunk. CPU: 16 MiB is 27 rows of Qwen's 151,936-token vocabulary (the peak-memory bench's 1.000x).
CUDA: 256 MiB (441 rows) keeps every reduction kernel's grid wide enough to fill the GPU (32-row chunks
were 1.2-1.35x slower than verl's compiled entropy on an H100)."""

COMPILED_CHUNK_ROWS = 8192
"""Rows per call of the compiled kernel: it materialises nothing logits-sized, so this only bounds
the size of any temporaries inductor might still choose to keep."""

_NEG_FLOOR = -200.0  # exp(-200) == 0 in float32: clamping there changes no finite result, and makes
# -inf logits (masked vocabulary) contribute exp(z) * z = 0 instead of 0 * -inf = nan.


def chunk_bytes_for(device: torch.device) -> int:
    """Bytes of one float32 working buffer on ``device`` (:data:`EAGER_CHUNK_BYTES`; other devices: CPU's)."""
    return EAGER_CHUNK_BYTES.get(device.type, EAGER_CHUNK_BYTES["cpu"])


def chunk_rows_for(logits: torch.Tensor) -> int:
    """Rows of ``logits`` (``(..., vocab)``) per float32 working buffer of :func:`chunk_bytes_for` bytes."""
    return max(1, chunk_bytes_for(logits.device) // (4 * max(1, logits.shape[-1])))


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Cancellation-free entropy of each row of ``logits`` (2-D), float32. Pure, compile-friendly."""
    z = logits.float()
    z = (z - z.amax(dim=-1, keepdim=True)).clamp_min(_NEG_FLOOR)
    at_max = z == 0
    e = torch.exp(z)
    spread = -(e * z).sum(dim=-1)
    rest = torch.where(at_max, 0.0, e).sum(dim=-1) + (at_max.sum(dim=-1) - 1)
    return torch.log1p(rest) + spread / (1.0 + rest)


class EagerRows:
    """:func:`_entropy_rows`' formula for the eager path, over two float32 ``rows x vocab`` buffers reused by
    every chunk (fresh ones cost a page fault per 4 KiB on CPU, more than the arithmetic). Ties: ``exp(z)`` is
    zeroed at the arg-max only, so the other maxima keep their 1 in ``r``."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.shifted = torch.empty(rows, vocab, dtype=torch.float32, device=device)
        self.exps = torch.empty(rows, vocab, dtype=torch.float32, device=device)

    def __call__(self, chunk: torch.Tensor) -> torch.Tensor:
        return self.entropy_and_normaliser(chunk)[0]

    def entropy_and_normaliser(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(H, max, log1p(r))`` of each row: the entropy and the two parts of the log-normaliser
        ``logsumexp(x) = max + log1p(r)``, so ``log p_j = (x_j - max) - log1p(r)`` without cancellation
        for the arg-max."""
        top, rest, spread = self.stats(chunk)
        log1p_rest = torch.log1p(rest)
        return log1p_rest + spread / (1.0 + rest), top, log1p_rest

    def stats(self, chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three sums of each row, ``(max, r, s)`` with ``z = x - max``, ``r = sum_{j != argmax} exp(z_j)``,
        ``s = sum_j exp(z_j) (-z_j)``: ``H = log1p(r) + s / (1 + r)`` (slices merge: :func:`merge_row_stats`)."""
        n = chunk.shape[0]
        z, e = self.shifted[:n, : chunk.shape[1]], self.exps[:n, : chunk.shape[1]]
        z.copy_(chunk)  # a copy: never touch the logits
        top, arg_top = z.max(dim=-1, keepdim=True)
        z.sub_(top).clamp_min_(_NEG_FLOOR)
        torch.exp(z, out=e)
        spread = z.mul_(e).sum(dim=-1).neg_()
        rest = e.scatter_(-1, arg_top, 0.0).sum(dim=-1)
        return top.squeeze(-1), rest, spread


def merge_row_stats(
    first: tuple[torch.Tensor, torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(max, r, s)`` of rows whose vocabulary is the union of two parts' (:meth:`EagerRows.stats`): with
    ``d = |max_1 - max_2|``, ``r = r_big + (1 + r_small) e^-d`` and ``s = s_big + e^-d (s_small + d (1 + r_small))``,
    every term non-negative (no cancellation); equal maxima count as a tie (``+1`` in ``r``)."""
    (top1, rest1, spread1), (top2, rest2, spread2) = first, second
    second_bigger = top2 > top1
    gap = (top1 - top2).abs()
    scale = torch.exp(-gap)
    rest_big, rest_small = torch.where(second_bigger, rest2, rest1), torch.where(second_bigger, rest1, rest2)
    spread_big, spread_small = (
        torch.where(second_bigger, spread2, spread1),
        torch.where(second_bigger, spread1, spread2),
    )
    rest = rest_big + (1.0 + rest_small) * scale
    spread = spread_big + scale * (spread_small + gap * (1.0 + rest_small))
    return torch.maximum(top1, top2), rest, spread


@torch.no_grad()
def entropy_fp32(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Shannon entropy of ``softmax(logits)`` (``(..., vocab)``, any float dtype) over the last dim: ``(...)``
    float32, no graph, eager. Chunks of :data:`EAGER_CHUNK_BYTES`, or verl's smaller ``chunk_size``; a row's
    result never depends on the chunking or the other rows, so differently packed passes agree bit for bit."""
    rows = chunk_rows_for(logits)
    if chunk_size is not None:
        if int(chunk_size) <= 0:
            raise ValueError(
                f"chunk_size must be positive (actor_rollout_ref.actor.fsdp_config.entropy_from_logits_chunk_size), "
                f"got {chunk_size}"
            )
        rows = min(rows, int(chunk_size))
    rows = min(rows, max(1, logits.numel() // max(1, logits.shape[-1])))
    return _chunked(logits, rows, EagerRows(rows, logits.shape[-1], logits.device))


@functools.cache
def _compiled_entropy_rows() -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.compile(_entropy_rows, dynamic=True)


@torch.no_grad()
def entropy_fp32_compiled(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """:func:`entropy_fp32`'s formula ``torch.compile``d into fused reductions (CUDA; verl's default
    ``use_torch_compile``). ``chunk_size`` is accepted for verl's call form and ignored: the kernel
    keeps nothing logits-sized."""
    del chunk_size
    return _chunked(logits, COMPILED_CHUNK_ROWS, _compiled_entropy_rows())


def _chunked(logits: torch.Tensor, rows: int, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    lead_shape = logits.shape[:-1]
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if flat.shape[0] <= rows:
        return kernel(flat).reshape(lead_shape)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = kernel(flat[start : start + rows])
    return out.reshape(lead_shape)
