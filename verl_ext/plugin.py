"""verl plugin: imported by ``import verl`` through the ``verl.plugins`` entry point.

Registers the divclip policy-loss modes (and the CPU platform) in every process that imports
verl, Ray workers included, so configs can say ``policy_loss.loss_mode=kl3`` anywhere.

verl swallows plugin import errors at DEBUG level; :func:`require_registered` is the loud
check that entry points (``recipe.main``) call before anything is scheduled.
"""

from __future__ import annotations

import verl_ext.losses  # noqa: F401  (registers the modes with verl's POLICY_LOSS_REGISTRY)


def require_registered() -> None:
    """Raise with the real cause if the divclip modes are missing from verl's registry."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_ext.losses import CONSTRAINTS

    missing = sorted(set(CONSTRAINTS) - set(POLICY_LOSS_REGISTRY))
    if not CONSTRAINTS or missing:
        raise RuntimeError(
            f"verl_ext policy losses are not registered with verl (missing: {missing or 'all'}). "
            "Is verl-divclip installed in this environment (`pip install -e .`) so that its "
            "`verl.plugins` entry point runs, and is VERL_USE_EXTERNAL_PLUGINS not 'none'?"
        )
