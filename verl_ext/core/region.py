"""What a constraint of the unified operator is (ATR-GRPO Eq. 5): its inputs, its trust region, its spec.

A constraint C_t(theta) is a function of the detached importance ratio (and, for some, of pi_old's
log-prob or the coarsened full-vocabulary KL) returning where it holds (:class:`TrustRegion`);
:func:`define_constraint` adds it to :data:`CONSTRAINTS` with what a violation does. The definitions
themselves are :mod:`verl_ext.core.constraints`; the operator that applies them,
:mod:`verl_ext.core.surrogate`; exposing them to verl's ``POLICY_LOSS_REGISTRY``, :mod:`verl_ext.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import torch

from verl_ext.config import DivClipPolicyLossConfig


@dataclass(frozen=True)
class ConstraintInputs:
    """What a constraint may look at. All tensors are detached, float32 or wider."""

    log_ratio: torch.Tensor
    ratio: torch.Tensor
    old_log_prob: torch.Tensor
    response_mask: torch.Tensor
    clip_ratio_low: float
    clip_ratio_high: float
    policy: DivClipPolicyLossConfig
    full_kl: Optional[torch.Tensor] = None  # per-token coarsened KL (kl_full_direction), when pi_old's top-k is stored


@dataclass(frozen=True)
class TrustRegion:
    """Where C_t(theta) holds, and the ratio interval it amounts to.

    ``lower``/``upper`` are scalars or per-token tensors shaped like ``inside``. A constraint
    whose bounds are expensive and not needed to decide ``inside`` may instead return them
    for a sample of valid tokens (1-D) with ``bounds_sampled=True``; they then only feed the
    ``ratio_lower/upper`` metrics, and the constraint cannot use ``preserve`` violations.
    """

    inside: torch.Tensor
    lower: torch.Tensor | float
    upper: torch.Tensor | float
    bounds_sampled: bool = False


ConstraintFn = Callable[[ConstraintInputs], TrustRegion]


@dataclass(frozen=True)
class ConstraintSpec:
    """A registered constraint: how to evaluate C_t and what a violation does.

    ``level``: ``"token"`` evaluates C_t on w_t; ``"sequence"`` on the sequence ratio s_i,
    which then also replaces w_t in the surrogate. ``delta_budget``: the constraint is a
    divergence budget ``policy_loss.delta`` (logged as ``actor/divclip/delta``; the modes
    the adaptive-delta controller may drive). ``budget_metric``: the ``actor/divclip/<name>`` metric
    that measures what delta bounds (the adaptive-delta controller's measurement). ``needs_old_topk``:
    C_t reads pi_old's stored top-k (:mod:`verl_ext.core.coarsened_kl`), which verl's policy-loss registry cannot
    pass: the mode runs only through the actor loss (``python -m recipe.main``). ``reads``: the knobs the mode
    reads (names of :data:`verl_ext.knobs.KNOBS`: ``delta``, ``clip_ratio_high``, ...), beyond those of the features
    switched on (:data:`verl_ext.knobs.FEATURES`); validation refuses any other knob set away from its default.
    ``summary``: the constraint in one line (the README's mode table, rendered from these declarations).
    """

    name: str
    region: ConstraintFn
    on_violation: Literal["drop", "preserve"] = "drop"
    level: Literal["token", "sequence"] = "token"
    delta_budget: bool = False
    budget_metric: str = "kl3_mean"
    needs_old_topk: bool = False
    reads: tuple[str, ...] = ()
    summary: str = ""


CONSTRAINTS: dict[str, ConstraintSpec] = {}


def define_constraint(
    name: str,
    on_violation: Literal["drop", "preserve"] = "drop",
    level: Literal["token", "sequence"] = "token",
    delta_budget: bool = False,
    budget_metric: Optional[str] = None,
    needs_old_topk: bool = False,
    reads: tuple[str, ...] = (),
    summary: str = "",
) -> Callable[[ConstraintFn], ConstraintFn]:
    """Define the constraint ``name`` (a decorator on its region function): it joins :data:`CONSTRAINTS`,
    which the operator (:func:`verl_ext.core.surrogate.constrained_policy_loss`) reads and
    :mod:`verl_ext.registry` exposes to verl as ``policy_loss.loss_mode=<name>``. Defining a name twice
    is an error (a second definition would silently replace the first). ``reads`` declares the knobs the
    constraint reads (:class:`ConstraintSpec`)."""
    if level == "sequence" and on_violation != "drop":
        raise ValueError(f"constraint {name!r}: sequence-level constraints only drop violations")
    metric = budget_metric or ("seq_kl3_mean" if level == "sequence" else "kl3_mean")

    def decorator(region: ConstraintFn) -> ConstraintFn:
        if name in CONSTRAINTS:
            raise ValueError(f"constraint {name!r} is already defined ({CONSTRAINTS[name].region.__qualname__})")
        CONSTRAINTS[name] = ConstraintSpec(
            name, region, on_violation, level, delta_budget, metric, needs_old_topk, tuple(reads), summary
        )
        return region

    return decorator


def interval(inputs: ConstraintInputs, lower: float, upper: float) -> TrustRegion:
    ratio = inputs.ratio
    return TrustRegion((ratio >= lower) & (ratio <= upper), lower, upper)
