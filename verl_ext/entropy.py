"""One accurate, graph-free per-token entropy for both of ERC's passes.

Entropy Ratio Clipping compares ``H(pi_theta, t)`` (update pass) with ``H(pi_old, t)`` (the v1
trainer's old-log-prob pass, kept as ``data["entropy"]``). On-policy the two must be *the same
number*, so ERC masks nothing. verl 0.9.1 computes the entropy in
``FSDPEngineWithLMHead.prepare_model_outputs`` with ``verl_F.entropy_from_logits``
(``logsumexp(x) - sum(softmax(x) * x)``) in the logits' dtype -- bf16 under verl's default mixed
precision -- and ``torch.compile``s it on GPU. That formula subtracts two numbers of size ~|x| to get
an entropy that, for a confident token, is 1e-3..1e-8 nats: in bf16 the difference is noise, often
exactly 0. Two passes that differ in anything (compile vs eager, another function) then disagree by
orders of magnitude and ERC masks on-policy tokens (measured: 68% on the CPU engine, 0.6% on an H100).

This module provides:

* :func:`entropy_fp32` -- the entropy in float32, without an autograd graph, written so that no term
  cancels: with ``z = x - max(x)`` (the arg-max exactly 0), ``S = sum(exp z) = 1 + r`` and
  ``r = sum_{z<0} exp z + (#ties - 1)``::

      H = log S - sum(exp(z) * z) / S = log1p(r) + sum(exp(z) * (-z)) / (1 + r)

  Every term is non-negative, so the relative error stays ~1e-6 down to H ~ 1e-30 (an fp64 reference
  is matched to 1e-4 relative for H >= 1e-6; tests/test_entropy_numerics.py).
* :func:`install_divclip_entropy` -- the hook. It wraps ``TrainingWorker.set_loss_fn`` so that a loss
  declaring :data:`ENTROPY_PATH_ATTR` = ``"divclip_fp32"`` (see :func:`entropy_as_mask`) marks *the
  engine* of that worker, and wraps ``FSDPEngineWithLMHead.forward_step`` so that every forward step
  of a marked engine -- the old-log-prob pass (``infer_batch``, no loss function) as well as the
  update -- computes the entropy with :func:`entropy_fp32`. Both of verl's call sites are covered
  (``engine.compute_entropy_from_logits`` on the remove-padding / Ulysses / chunked path,
  ``verl_F.entropy_from_logits`` on the padded path) for the duration of that one step. Because the
  entropy has no graph then, the step also gives flash-attn's cross-entropy its in-place backward
  back (verl turns it off whenever ``calculate_entropy`` is on) and makes verl's
  ``entropy_checkpointing`` a no-op (there is nothing to recompute).
* Runs without the mark (no ERC, or an entropy bonus that needs the gradient) keep verl's code bit
  for bit. With ``use_fused_kernels`` the entropy comes from verl's fused kernel in both passes
  (consistent, bf16); the hook then changes nothing and says so (:func:`entropy_path_of`).

On CUDA with the engine's ``use_torch_compile`` (verl's default) the same math is ``torch.compile``d
into one fused reduction (no logits-sized temporaries); elsewhere it runs eagerly over row chunks of
at most :data:`EAGER_CHUNK_BYTES` per float32 buffer. One engine always uses one of the two for both
passes.
"""

from __future__ import annotations

import enum
import functools
import logging
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)


class EntropyPath(str, enum.Enum):
    """Which function computes the per-token entropy in both passes of a run."""

    VERL = "verl"  # verl's entropy_from_logits (autograd, logits dtype, compiled on GPU by default)
    DIVCLIP_FP32 = "divclip_fp32"  # entropy_fp32: float32, no graph, same function in both passes
    FUSED_KERNEL = "fused_kernel"  # verl's fused linear-cross-entropy kernel (bf16) in both passes


ENTROPY_PATH_ATTR = "divclip_entropy_path"
"""Attribute a loss function sets to ``EntropyPath.DIVCLIP_FP32`` to declare that it uses the current
entropy only as a detached mask, so both passes may use :func:`entropy_fp32`."""

EAGER_CHUNK_BYTES: dict[str, int] = {"cpu": 16 << 20, "cuda": 256 << 20}
"""Size of one float32 ``rows x vocab`` buffer of the eager path, per device type. The eager path
holds two such buffers (the shifted logits and their exponentials), reused by every chunk. CPU: 16 MiB is
27 rows of Qwen's 151,936-token vocabulary (the peak-memory bench's 1.000x). CUDA: 256 MiB (441 rows)
keeps every reduction kernel's grid wide enough to fill the GPU (32-row chunks were 1.2-1.35x slower
than verl's compiled entropy on an H100)."""

COMPILED_CHUNK_ROWS = 8192
"""Rows per call of the compiled kernel: it materialises nothing logits-sized, so this only bounds
the size of any temporaries inductor might still choose to keep."""

_INSTALLED_MARK = "_verl_ext_divclip_entropy_installed"
_ENGINE_PATH_ATTR = "_divclip_entropy_path"
_ENGINE_FN_ATTR = "_divclip_entropy_fn"
_NEG_FLOOR = -200.0  # exp(-200) == 0 in float32: clamping there changes no finite result, and makes
# -inf logits (masked vocabulary) contribute exp(z) * z = 0 instead of 0 * -inf = nan.


def _entropy_rows(logits: torch.Tensor) -> torch.Tensor:
    """Cancellation-free entropy of each row of ``logits`` (2-D), float32. Pure, compile-friendly."""
    z = logits.float()
    z = (z - z.amax(dim=-1, keepdim=True)).clamp_min(_NEG_FLOOR)
    at_max = z == 0
    e = torch.exp(z)
    spread = -(e * z).sum(dim=-1)
    rest = torch.where(at_max, 0.0, e).sum(dim=-1) + (at_max.sum(dim=-1) - 1)
    return torch.log1p(rest) + spread / (1.0 + rest)


class _EagerRows:
    """:func:`_entropy_rows`' formula for the eager path, over two float32 ``rows x vocab`` buffers
    allocated once per call and reused by every chunk (fresh buffers per chunk cost a page fault per
    4 KiB on CPU, more than the arithmetic). The tie term is taken by zeroing ``exp(z)`` at the
    arg-max instead of counting ``z == 0``: the other maxima keep ``exp(0) = 1`` in ``r``, the same sum."""

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
        """The formula's three non-negative-term sums of each row, ``(max, r, s)`` with ``z = x - max``,
        ``r = sum_{j != argmax} exp(z_j)`` and ``s = sum_j exp(z_j) (-z_j)``: ``H = log1p(r) + s / (1 + r)``.
        Rows split over vocabulary slices merge exactly (:func:`merge_row_stats`; the vocabulary pass,
        :mod:`verl_ext.vocab_pass`)."""
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
    """``(max, r, s)`` of rows whose vocabulary is the union of two parts' (:meth:`_EagerRows.stats`).

    With ``d = |max_1 - max_2|`` and the part holding the larger max called "big": ``r = r_big +
    (1 + r_small) e^-d`` and ``s = s_big + e^-d (s_small + d (1 + r_small))`` -- every term still
    non-negative, so merging keeps the formula cancellation-free. Equal maxima count as a tie (``+1``
    in ``r``), as in the single-pass formula."""
    (top1, rest1, spread1), (top2, rest2, spread2) = first, second
    second_bigger = top2 > top1
    gap = (top1 - top2).abs()
    scale = torch.exp(-gap)
    rest_big, rest_small = torch.where(second_bigger, rest2, rest1), torch.where(second_bigger, rest1, rest2)
    spread_big, spread_small = torch.where(second_bigger, spread2, spread1), torch.where(second_bigger, spread1, spread2)
    rest = rest_big + (1.0 + rest_small) * scale
    spread = spread_big + scale * (spread_small + gap * (1.0 + rest_small))
    return torch.maximum(top1, top2), rest, spread


@torch.no_grad()
def entropy_fp32(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Shannon entropy of ``softmax(logits)`` over the last dim: float32, no autograd graph, eager.

    Accepts ``(..., vocab)`` in any float dtype and returns ``(...)`` float32 with
    ``requires_grad=False``. Rows are processed in chunks of at most :data:`EAGER_CHUNK_BYTES` per
    float32 buffer; ``chunk_size`` (verl's ``entropy_from_logits_chunk_size``, sized for its autograd
    path) only applies when smaller. The result of a row never depends on the chunking or on the
    other rows, so two passes that pack tokens differently (dynamic batching) agree bit for bit.
    """
    rows = _eager_chunk_rows(logits)
    if chunk_size is not None:
        if int(chunk_size) <= 0:
            raise ValueError(
                f"chunk_size must be positive (actor_rollout_ref.actor.fsdp_config.entropy_from_logits_chunk_size), "
                f"got {chunk_size}"
            )
        rows = min(rows, int(chunk_size))
    rows = min(rows, max(1, logits.numel() // max(1, logits.shape[-1])))
    return _chunked(logits, rows, _EagerRows(rows, logits.shape[-1], logits.device))


@functools.lru_cache(maxsize=None)
def _compiled_entropy_rows() -> Callable[[torch.Tensor], torch.Tensor]:
    return torch.compile(_entropy_rows, dynamic=True)


@torch.no_grad()
def entropy_fp32_compiled(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """:func:`entropy_fp32`'s formula ``torch.compile``d into fused reductions (CUDA; verl's default
    ``use_torch_compile``). ``chunk_size`` is accepted for verl's call form and ignored: the kernel
    keeps nothing logits-sized."""
    del chunk_size
    return _chunked(logits, COMPILED_CHUNK_ROWS, _compiled_entropy_rows())


def _eager_chunk_rows(logits: torch.Tensor) -> int:
    budget = EAGER_CHUNK_BYTES.get(logits.device.type, EAGER_CHUNK_BYTES["cpu"])
    return max(1, budget // (4 * max(1, logits.shape[-1])))


def _chunked(logits: torch.Tensor, rows: int, kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    lead_shape = logits.shape[:-1]
    flat = logits.detach().reshape(-1, logits.shape[-1])
    if flat.shape[0] <= rows:
        return kernel(flat).reshape(lead_shape)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        out[start : start + rows] = kernel(flat[start : start + rows])
    return out.reshape(lead_shape)


# ------------------------------------------------------------------------------------------------
# Declaring and selecting the path
# ------------------------------------------------------------------------------------------------


def entropy_as_mask(loss_function: Callable[..., Any], *, entropy_coeff: float) -> Callable[..., Any]:
    """Declare that ``loss_function`` uses the current entropy only as a (detached) mask.

    Returns a ``functools.partial`` (picklable, so it survives Ray's ``set_loss_fn``) carrying
    ``divclip_entropy_path = "divclip_fp32"``. ``entropy_coeff`` is the actor's
    ``actor_rollout_ref.actor.entropy_coeff``: a non-zero bonus differentiates the entropy, so this
    raises instead of silently dropping that gradient.
    """
    if entropy_coeff != 0:
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff={entropy_coeff} adds an entropy bonus, which needs the "
            "entropy gradient; the detached entropy path (verl_ext.entropy.entropy_as_mask) is only valid "
            "with entropy_coeff=0. Leave the loss function unwrapped to keep verl's autograd entropy."
        )
    wrapped = functools.partial(loss_function)
    setattr(wrapped, ENTROPY_PATH_ATTR, EntropyPath.DIVCLIP_FP32.value)
    return wrapped


def loss_entropy_path(loss_function: Optional[Callable[..., Any]]) -> EntropyPath:
    """The entropy path ``loss_function`` asks for (``VERL`` unless it opted in)."""
    return EntropyPath(getattr(loss_function, ENTROPY_PATH_ATTR, EntropyPath.VERL.value))


def resolve_entropy_path(requested: EntropyPath, *, use_fused_kernels: bool) -> EntropyPath:
    """The path a run really takes: with verl's fused kernels the entropy comes from the kernel in
    both passes whatever the loss asks for."""
    if requested is EntropyPath.DIVCLIP_FP32 and use_fused_kernels:
        return EntropyPath.FUSED_KERNEL
    return requested


def describe_entropy_path(path: EntropyPath) -> str:
    """One log line's worth: which function computes H(pi_old) and H(pi_theta)."""
    return {
        EntropyPath.VERL: "verl's entropy_from_logits (autograd, logits dtype)",
        EntropyPath.DIVCLIP_FP32: "divclip entropy_fp32 in both passes (float32, no graph, cancellation-free)",
        EntropyPath.FUSED_KERNEL: (
            "verl's fused-kernel entropy in both passes (bf16, consistent); the divclip fp32 path is inactive "
            "because use_fused_kernels=True"
        ),
    }[path]


def entropy_path_of(engine: Any) -> EntropyPath:
    """The path an engine's forward steps use (set by ``TrainingWorker.set_loss_fn``)."""
    return EntropyPath(getattr(engine, _ENGINE_PATH_ATTR, EntropyPath.VERL.value))


def mark_engine(engine: Any, path: EntropyPath) -> None:
    """Make every forward step of ``engine`` use ``path`` (both passes). Called by the wrapped
    ``TrainingWorker.set_loss_fn``; tests and benches may call it directly."""
    use_fused = bool(getattr(getattr(engine, "engine_config", None), "use_fused_kernels", False))
    path = resolve_entropy_path(path, use_fused_kernels=use_fused)
    changed = getattr(engine, _ENGINE_PATH_ATTR, EntropyPath.VERL.value) != path.value
    setattr(engine, _ENGINE_PATH_ATTR, path.value)
    setattr(engine, _ENGINE_FN_ATTR, _entropy_fn_for(engine) if path is EntropyPath.DIVCLIP_FP32 else None)
    if changed:  # a loss re-installed every step (adaptive delta) logs once
        logger.info("divclip: per-token entropy = %s", describe_entropy_path(path))


def _entropy_fn_for(engine: Any) -> Callable[..., torch.Tensor]:
    config = getattr(engine, "engine_config", None)
    compile_on = bool(getattr(config, "use_torch_compile", False))
    return entropy_fp32_compiled if compile_on and torch.cuda.is_available() else entropy_fp32


# ------------------------------------------------------------------------------------------------
# The hook into verl's engine
# ------------------------------------------------------------------------------------------------


def _logprobs_inplace_backward(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """verl's ``logprobs_from_logits`` with flash-attn's in-place backward: safe when nothing else
    (no entropy graph) needs the logits in backward."""

    @functools.wraps(original)
    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
        del inplace_backward
        return original(logits=logits, labels=labels, inplace_backward=True)

    return logprobs_from_logits


def _plain_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Stand-in for ``torch.utils.checkpoint.checkpoint`` around the graph-free entropy: there is
    nothing to recompute (and checkpointing a function without graph breaks the backward)."""
    kwargs.pop("use_reentrant", None)
    kwargs.pop("preserve_rng_state", None)
    return function(*args, **kwargs)


@contextmanager
def _divclip_entropy_swapped(engine: Any, entropy_fn: Callable[..., torch.Tensor]) -> Iterator[None]:
    """Point verl's entropy call sites at ``entropy_fn`` for one forward step, restoring them on exit."""
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl

    with ExitStack() as stack:
        stack.enter_context(_attribute(engine, "compute_entropy_from_logits", entropy_fn))
        stack.enter_context(_attribute(verl_F, "entropy_from_logits", entropy_fn))
        stack.enter_context(_attribute(impl, "logprobs_from_logits", _logprobs_inplace_backward(impl.logprobs_from_logits)))
        if bool(getattr(engine.engine_config, "entropy_checkpointing", False)):
            stack.enter_context(_attribute(impl.torch.utils.checkpoint, "checkpoint", _checkpoint_unless_entropy(entropy_fn)))
        yield


def _checkpoint_unless_entropy(entropy_fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    import torch.utils.checkpoint as ckpt

    original = ckpt.checkpoint

    @functools.wraps(original)
    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if function is entropy_fn:
            return _plain_call(function, *args, **kwargs)
        return original(function, *args, **kwargs)

    return checkpoint


@contextmanager
def _attribute(owner: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``owner.name = value`` for the block; restore (or delete an instance attribute) after."""
    instance_dict = vars(owner) if not isinstance(owner, type) else None
    had = name in vars(owner)
    saved = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, saved)
        elif instance_dict is not None:
            delattr(owner, name)


def _wrap_forward_step(forward_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward_step)
    def forward_step_with_divclip_entropy(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        entropy_fn = getattr(self, _ENGINE_FN_ATTR, None)
        if entropy_fn is None and loss_entropy_path(loss_function) is EntropyPath.DIVCLIP_FP32:
            mark_engine(self, EntropyPath.DIVCLIP_FP32)  # an engine driven without TrainingWorker
            entropy_fn = getattr(self, _ENGINE_FN_ATTR, None)
        if entropy_fn is None:
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)
        with _divclip_entropy_swapped(self, entropy_fn):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)

    setattr(forward_step_with_divclip_entropy, _INSTALLED_MARK, True)
    return forward_step_with_divclip_entropy


def _wrap_set_loss_fn(set_loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(set_loss_fn)  # keeps verl's @register dispatch attributes
    def set_loss_fn_marking_engine(self: Any, loss_fn: Any) -> Any:
        result = set_loss_fn(self, loss_fn)
        engine = getattr(self, "engine", None)
        if engine is not None:
            mark_engine(engine, loss_entropy_path(loss_fn))
        return result

    setattr(set_loss_fn_marking_engine, _INSTALLED_MARK, True)
    return set_loss_fn_marking_engine


def install_divclip_entropy(engine: Any = None) -> None:
    """Install the hook (idempotent; inert until a loss opts in with :func:`entropy_as_mask`).

    Without argument: wraps ``FSDPEngineWithLMHead.forward_step`` and ``TrainingWorker.set_loss_fn``
    (classes), so engines built by verl's workers get it. With an engine instance: wraps that
    instance's ``forward_step`` only (the ``TrainingWorker`` wrap is installed as well).
    """
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker

    if not getattr(TrainingWorker.set_loss_fn, _INSTALLED_MARK, False):
        TrainingWorker.set_loss_fn = _wrap_set_loss_fn(TrainingWorker.set_loss_fn)
    target: Any = FSDPEngineWithLMHead if engine is None else engine
    if getattr(target.forward_step, _INSTALLED_MARK, False):
        return
    if isinstance(target, type):
        target.forward_step = _wrap_forward_step(target.forward_step)
    else:  # bind to this instance only: other engines of the class are left untouched
        target.forward_step = _wrap_forward_step(type(target).forward_step).__get__(target, type(target))


install_detached_entropy = install_divclip_entropy
"""Former name (kept for callers of the first release)."""

detached_entropy_from_logits = entropy_fp32
"""Former name (kept for callers of the first release)."""
