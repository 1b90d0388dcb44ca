"""Adaptive trust-region threshold (ATR-GRPO Sec. 6.5): between actor updates the budget delta moves so that the
measured divergence (the constraint's ``budget_metric``) tracks d_targ, by PPO's adaptive-KL rule on the budget.
Runs on the driver; its state is :data:`STATE_FILE` in verl's checkpoint folder (docs/losses.md, "Adaptive δ").
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.config_rules.policy import check_policy_config
from verl_ext.core.region import CONSTRAINTS

STATE_FILE = "divclip_adaptive_delta.json"
TOKEN_METRIC = "actor/divclip/kl3_mean"
SEQUENCE_METRIC = "actor/divclip/seq_kl3_mean"
FULL_KL_METRIC = "actor/divclip/kl_full_mean"


@dataclass
class AdaptiveDelta:
    """The controller's state (``delta``) and its constants, from ``DivClipPolicyLossConfig``."""

    delta: float
    target: float
    tolerance: float
    rate: float
    minimum: float
    maximum: float
    metric: str
    updates: int = 0

    @classmethod
    def from_policy(cls, policy: DivClipPolicyLossConfig) -> Optional[AdaptiveDelta]:
        """The controller configured by ``policy``, or ``None`` when delta is static. Raises
        ``ValueError`` naming the key if ``loss_mode`` has no KL budget to adapt."""
        check_policy_config(policy)
        if not policy.adaptive_delta_enabled:
            return None
        return cls(
            delta=float(policy.delta),
            target=float(policy.adaptive_delta_target),
            tolerance=float(policy.adaptive_delta_tolerance),
            rate=float(policy.adaptive_delta_rate),
            minimum=float(policy.adaptive_delta_min),
            maximum=float(policy.adaptive_delta_max),
            metric=f"actor/divclip/{CONSTRAINTS[policy.loss_mode].budget_metric}",
        )

    def next_delta(self, measured: float) -> float:
        """The rule of docs/losses.md ("Adaptive δ"), without changing the state."""
        if not math.isfinite(measured) or measured < 0:
            raise ValueError(
                f"adaptive delta: the measured mean KL3 ({self.metric}) must be finite and >= 0, got {measured!r}"
            )
        if measured > self.target * self.tolerance:
            return max(self.delta / self.rate, self.minimum)
        if measured < self.target / self.tolerance:
            return min(self.delta * self.rate, self.maximum)
        return self.delta

    def update(self, metrics: dict[str, Any]) -> bool:
        """Apply the rule to one actor update's reduced metrics; returns whether delta changed."""
        if self.metric not in metrics:
            raise KeyError(
                f"adaptive delta needs the update's {self.metric!r} metric, which the actor loss did not report "
                f"(actor metrics: {sorted(k for k in metrics if k.startswith('actor/'))})"
            )
        new = self.next_delta(float(metrics[self.metric]))
        changed = new != self.delta
        self.delta = new
        self.updates += 1
        return changed

    # -- persistence next to verl's checkpoint -------------------------------------------------

    def save(self, global_step_folder: str) -> str:
        """Write the state into ``global_step_folder`` atomically; returns the file's path."""
        os.makedirs(global_step_folder, exist_ok=True)
        path = os.path.join(global_step_folder, STATE_FILE)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(asdict(self), f, indent=1)
        os.replace(tmp, path)
        return path

    def restore(self, global_step_folder: str) -> bool:
        """Load delta (and the update count) saved in ``global_step_folder``; ``False`` if that
        checkpoint has no controller state (e.g. it was written with a static delta)."""
        path = os.path.join(global_step_folder, STATE_FILE)
        if not os.path.exists(path):
            return False
        with open(path) as f:
            state = json.load(f)
        delta = state.get("delta")
        if not (isinstance(delta, int | float) and math.isfinite(delta) and delta > 0):
            raise ValueError(f"{path}: 'delta' must be a finite number > 0, got {delta!r}")
        if state.get("metric") not in (None, self.metric):
            raise ValueError(
                f"{path} tracked {state.get('metric')!r}, but this run's loss_mode tracks {self.metric!r}: "
                "resuming would continue a different controller"
            )
        # the bounds are this run's config: a resumed run may narrow them
        self.delta = min(max(float(delta), self.minimum), self.maximum)
        self.updates = int(state.get("updates", 0))
        return True
