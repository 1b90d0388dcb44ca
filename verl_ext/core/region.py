"""What a constraint C_t of the unified operator (ATR-GRPO Eq. 5) is: a function of detached inputs returning
where it holds (:class:`TrustRegion`), defined into :data:`CONSTRAINTS` with what a violation does. The
definitions: :mod:`verl_ext.core.constraints`; the operator: :mod:`verl_ext.core.surrogate`.
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
    """Where C_t(theta) holds, and its ratio interval: ``lower``/``upper`` scalars or tensors shaped like
    ``inside``, or, with ``bounds_sampled=True``, costly bounds for a 1-D sample of valid tokens that only feed
    the ``ratio_lower/upper`` metrics (such a constraint cannot ``preserve`` violations)."""

    inside: torch.Tensor
    lower: torch.Tensor | float
    upper: torch.Tensor | float
    bounds_sampled: bool = False


ConstraintFn = Callable[[ConstraintInputs], TrustRegion]


@dataclass(frozen=True)
class ConstraintSpec:
    """A registered constraint: how to evaluate C_t and what a violation does.

    ``level``: ``"token"`` evaluates C_t on w_t, ``"sequence"`` on the sequence ratio s_i, which also replaces
    w_t in the surrogate. ``delta_budget``: ``policy_loss.delta`` is a divergence budget (logged; adaptive delta
    may drive it), measured by the ``actor/divclip/<budget_metric>`` metric. ``needs_old_topk``: C_t reads pi_old's
    stored top-k, which verl's registry cannot pass (``python -m recipe.main`` only). ``reads``: the knobs
    (:data:`verl_ext.knobs.KNOBS`) the mode reads beyond the switched-on features'; others set are refused.
    ``summary``: one line for the README's mode table.
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
    """Decorator: define the constraint ``name`` from its region function into :data:`CONSTRAINTS`, which the
    operator reads and :mod:`verl_ext.registry` exposes as ``policy_loss.loss_mode=<name>``. A second definition
    of a name is an error rather than a silent replacement. The other arguments: :class:`ConstraintSpec`."""
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
