"""Detached (no-graph) current-policy entropy for losses that use the entropy only as a mask.

Why: in verl 0.9.1 the actor update asks the engine for the current entropy H(pi_theta) whenever
``calculate_entropy`` is on, and ``FSDPEngineWithLMHead.prepare_model_outputs`` computes it *with
autograd* from the full ``(tokens, vocab)`` logits::

    entropy_rmpad = self.compute_entropy_from_logits(logits_rmpad[, chunk_size=...])  # remove-padding path
    entropy = verl_F.entropy_from_logits(logits)                                       # padded path

(``verl/workers/engine/fsdp/transformer_impl.py``; the functions are
``verl.utils.torch_functional.entropy_from_logits[_with_chunking]``). Autograd keeps the softmax and
its intermediates for the backward pass, several logits-sized tensors at peak. Entropy Ratio Clipping
(ERC) only needs ``H(pi_theta)/H(pi_old)`` to decide which tokens lose their gradient: a detached
mask. For that use the graph is pure waste.

The hook (smallest we found): the engine already routes the remove-padding entropy through an
*instance attribute*, ``engine.compute_entropy_from_logits``. :func:`install_detached_entropy` wraps
``forward_step`` so that, for a micro-batch whose loss function declares it uses the entropy only as
a mask, that attribute (and, for the padded path, ``verl_F.entropy_from_logits``) is swapped for
:func:`detached_entropy_from_logits` for the duration of that one forward step, then restored.
Everything else (temperature scaling, Ulysses gather, nested layout) stays verl's code.

How it is enabled — two explicit steps, both needed:

1. ``install_detached_entropy()`` in the worker process (no argument: patches the class
   ``FSDPEngineWithLMHead`` so engines built by verl's ``TrainingWorker`` get it; or pass one engine
   instance). Idempotent, and inert on its own.
2. The loss function opts in: ``loss_fn = entropy_as_mask(loss_fn, entropy_coeff=cfg.entropy_coeff)``.
   This sets ``loss_fn.entropy_requires_grad = False`` and refuses (``ValueError`` naming
   ``actor_rollout_ref.actor.entropy_coeff``) when an entropy bonus needs the gradient.

Any loss without the attribute (e.g. verl's ``ppo_loss``) keeps verl's exact behaviour, so an
entropy bonus (``entropy_coeff != 0``) still gets its gradient.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch

ENTROPY_REQUIRES_GRAD_ATTR = "entropy_requires_grad"
"""Attribute a loss function sets to ``False`` to declare it uses the current entropy only as a mask."""

DEFAULT_CHUNK_ROWS = 32
"""Rows of logits processed at once by the detached path. The temporaries are about three
``rows x vocab`` fp32 buffers (the float copy, ``logsumexp``'s internal ``exp``, the probabilities):
~58 MB for Qwen's 151,936-token vocabulary, and 128 Python iterations for 4096 tokens. verl's
``entropy_from_logits_chunk_size`` (2048 by default) is sized for its autograd path and would cost
several GB here, so it only applies when smaller."""

_INSTALLED_MARK = "_verl_ext_detached_entropy_installed"


@torch.no_grad()
def detached_entropy_from_logits(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Shannon entropy of ``softmax(logits)`` over the last dim, without building an autograd graph.

    Same quantity as verl's ``entropy_from_logits`` (``logsumexp(x) - sum(softmax(x) * x)``), written
    as ``-sum(p * log p)`` with ``log p = x - logsumexp(x)`` computed in place in float32 over row
    chunks, so the only temporaries are two ``chunk x vocab`` buffers. ``chunk_size`` is accepted for
    call compatibility with verl's ``entropy_from_logits_with_chunking`` but the row count is
    :data:`DEFAULT_CHUNK_ROWS` unless a smaller value is passed. Accepts ``(..., vocab)``; returns
    ``(...)`` in float32 with ``requires_grad=False``.
    """
    rows = min(int(chunk_size), DEFAULT_CHUNK_ROWS) if chunk_size else DEFAULT_CHUNK_ROWS
    if rows <= 0:
        raise ValueError(f"chunk_size must be positive (engine config entropy_from_logits_chunk_size), got {rows}")
    lead_shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        log_p = flat[start : start + rows].to(torch.float32, copy=True)  # copy: never touch the logits
        log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
        p = log_p.exp()
        out[start : start + rows] = -(p.mul_(log_p)).sum(dim=-1)
    return out.reshape(lead_shape)


def entropy_requires_grad(loss_function: Optional[Callable[..., Any]]) -> bool:
    """Whether ``loss_function`` needs the gradient of the current entropy (default: yes, as in verl)."""
    return bool(getattr(loss_function, ENTROPY_REQUIRES_GRAD_ATTR, True))


def entropy_as_mask(loss_function: Callable[..., Any], *, entropy_coeff: float) -> Callable[..., Any]:
    """Declare that ``loss_function`` uses the current entropy only as a (detached) mask.

    Returns a ``functools.partial`` of ``loss_function`` (picklable, so it survives Ray's
    ``set_loss_fn``) carrying ``entropy_requires_grad = False``. ``entropy_coeff`` is the actor's
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
    setattr(wrapped, ENTROPY_REQUIRES_GRAD_ATTR, False)
    return wrapped


@contextmanager
def _detached_entropy_swapped(engine: Any) -> Iterator[None]:
    """Point both of verl's entropy call sites at the detached function, restoring them on exit."""
    import verl.utils.torch_functional as verl_F

    detached = _detached_call_compatible
    had_instance_attr = "compute_entropy_from_logits" in vars(engine)
    saved_instance = vars(engine).get("compute_entropy_from_logits")
    saved_module = verl_F.entropy_from_logits
    engine.compute_entropy_from_logits = detached
    verl_F.entropy_from_logits = detached
    try:
        yield
    finally:
        verl_F.entropy_from_logits = saved_module
        if had_instance_attr:
            engine.compute_entropy_from_logits = saved_instance
        else:
            del engine.compute_entropy_from_logits


def _detached_call_compatible(logits: torch.Tensor, chunk_size: Optional[int] = None) -> torch.Tensor:
    """Accepts verl's two call forms (with and without ``chunk_size``); the row count stays bounded
    by :data:`DEFAULT_CHUNK_ROWS` (see there)."""
    return detached_entropy_from_logits(logits, chunk_size=chunk_size)


def _wrap_forward_step(forward_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward_step)
    def forward_step_with_detached_entropy(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if entropy_requires_grad(loss_function):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)
        with _detached_entropy_swapped(self):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)

    setattr(forward_step_with_detached_entropy, _INSTALLED_MARK, True)
    return forward_step_with_detached_entropy


def install_detached_entropy(engine: Any = None) -> None:
    """Enable the detached entropy path on ``engine`` (an instance) or, by default, on the class
    ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead``. Idempotent.

    Inert until a loss function opts in with :func:`entropy_as_mask`; see the module docstring.
    """
    if engine is None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

        target: Any = FSDPEngineWithLMHead
    else:
        target = engine
    current = target.forward_step
    if getattr(current, _INSTALLED_MARK, False):
        return
    if isinstance(target, type):
        target.forward_step = _wrap_forward_step(current)
    else:
        # Bind to the instance only: other engines of the same class are left untouched.
        unbound = _wrap_forward_step(type(target).forward_step)
        bound = unbound.__get__(target, type(target))
        setattr(bound.__func__, _INSTALLED_MARK, True)
        target.forward_step = bound
