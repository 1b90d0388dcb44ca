"""What the benchmarks and tests ask of an engine, and read back from it, beyond what the actor loss declares:
engine features on verl's plain ``ppo_loss``, and which path an engine took.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def with_vocab_pass(loss_function: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_function`` declared to run both passes of its engine through the vocabulary pass (as
    ``policy_loss.vocab_pass`` makes :func:`verl_ext.actor_loss.build_actor_loss` declare it)."""
    from verl_ext.engine.request import declare

    return declare(loss_function, vocab_pass=True)


def packed_as_update(loss_function: Callable[..., Any], enabled: bool = True) -> Callable[..., Any]:
    """``loss_function`` declared to pack its engine's old-log-prob pass as the update (or not)."""
    from verl_ext.engine.request import declare

    return declare(loss_function, pack_old_log_prob_as_update=enabled)


def entropy_path_of(engine: Any) -> Any:
    """The :class:`~verl_ext.engine.request.EntropyPath` an engine's forward steps use (``VERL`` until a loss
    asks for another)."""
    from verl_ext.engine.request import EntropyPath
    from verl_ext.engine.seam import features_of

    features = features_of(engine)
    return EntropyPath.VERL if features is None else features.entropy_path


def uses_vocab_pass(engine: Any) -> bool:
    """Whether an engine's forward steps run the vocabulary pass."""
    from verl_ext.engine.seam import features_of

    features = features_of(engine)
    return features is not None and features.request.vocab_pass
