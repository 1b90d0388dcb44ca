"""Which knobs (:data:`KNOBS`: keys of the policy-loss config or verl's actor) each loss mode reads, and the check
that refuses one set away from its default that neither the mode nor a switched-on feature reads. Declared by
``define_constraint(reads=...)``, :data:`verl_ext.verl_modes.VERL_MODE_READS` and :data:`FEATURES`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Optional

from verl.workers.config import ActorConfig

from verl_ext.config import POLICY_LOSS_KEY, DivClipPolicyLossConfig
from verl_ext.core import constraints as _definitions  # noqa: F401  (defines every constraint)
from verl_ext.core.region import CONSTRAINTS
from verl_ext.verl_modes import VERL_MODE_READS

ACTOR_KEY = "actor_rollout_ref.actor"


@dataclass(frozen=True)
class Knob:
    """A config key a loss reads.

    Attributes:
        name: the field name (``delta``, ``clip_ratio_high``); declarations name knobs by it.
        owner: ``"policy_loss"`` (a field of the policy-loss config) or ``"actor"`` (a field of verl's actor).
        probe: a value other than the default, at which ``tests/test_knobs.py`` checks that the knob moves the loss.
        fallback_for: knobs this one stands in for when they are null: verl's ``clip_ratio`` is read only where
            ``clip_ratio_low`` or ``clip_ratio_high`` is null.
        same_as: a knob whose value this one may repeat without being read: ``clip_ratio_c`` equal to the divclip
            ``dual_clip_c`` says the same dual-clip c (the released ERC profile sets both).
    """

    name: str
    owner: Literal["policy_loss", "actor"]
    probe: Any
    fallback_for: tuple[str, ...] = ()
    same_as: Optional[str] = None

    @property
    def key(self) -> str:
        return f"{POLICY_LOSS_KEY}.{self.name}" if self.owner == "policy_loss" else f"{ACTOR_KEY}.{self.name}"

    @property
    def default(self) -> Any:
        """verl's default for its own keys, ``DivClipPolicyLossConfig``'s for the project's."""
        cls = DivClipPolicyLossConfig if self.owner == "policy_loss" else ActorConfig
        (spec,) = [f for f in dataclasses.fields(cls) if f.name == self.name]
        return spec.default

    def value(self, actor: Any) -> Any:
        """The knob's value in an actor config (a policy-loss field the config's class lacks: its default)."""
        source = actor.policy_loss if self.owner == "policy_loss" else actor
        return getattr(source, self.name, self.default)


def _knobs(owner: Literal["policy_loss", "actor"], **probes: Any) -> dict[str, Knob]:
    return {name: Knob(name, owner, probe) for name, probe in probes.items()}


#: Every knob a policy loss reads, with the probe value the declaration test moves it to.
KNOBS: dict[str, Knob] = {
    # verl's actor (ActorConfig): the clip epsilons, dual-clip / truncation c, SAPO's temperatures
    **_knobs("actor", clip_ratio_low=0.1, clip_ratio_high=0.5, tau_pos=2.0, tau_neg=2.0),
    "clip_ratio": Knob("clip_ratio", "actor", 0.4, fallback_for=("clip_ratio_low", "clip_ratio_high")),
    "clip_ratio_c": Knob("clip_ratio_c", "actor", 5.0, same_as="dual_clip_c"),
    # verl's PolicyLossConfig
    **_knobs(
        "policy_loss",
        clip_cov_ratio=0.2,
        clip_cov_lb=-1.0,
        clip_cov_ub=0.5,
        kl_cov_ratio=0.2,
        ppo_kl_coef=1.0,
        dro_beta=0.5,
    ),
    # the project's DivClipPolicyLossConfig
    **_knobs(
        "policy_loss",
        delta=0.2,
        gppo_beta_low=0.3,
        gppo_beta_high=0.3,
        dcpo_cap=3.0,
        dual_clip_c=3.0,
        kl_full_top_k=2,
        kl_full_direction="reverse",
        kl_full_diagnostic=True,
        erc_beta_low=0.2,
        erc_beta_high=0.2,
        erc_eps=1.0,
        adaptive_delta_target=0.02,
        adaptive_delta_tolerance=3.0,
        adaptive_delta_rate=2.0,
        adaptive_delta_min=0.06,
        adaptive_delta_max=0.08,
        correct_nll_coef=0.1,
        correct_reward=0.5,
        correct_nll_norm="micro_batch",
    ),
}


@dataclass(frozen=True)
class Feature:
    """An opt-in feature that stacks on loss modes and reads its own knobs.

    Attributes:
        name: how messages and the README name it.
        switch: the knobs that switch it on (set away from their defaults).
        reads: the knobs it reads when on (its switches included).
        stacks_on: whether it applies to a loss mode (it is refused, or ignored, on the others).
        on: the values that switch it on (the declaration test's base; the paper's where there is one).
        moves: what its knobs change in the installed loss: ``"gradient"``, or ``"metrics:<prefix>"`` for a
            diagnostic that changes no gradient, only the ``<prefix>*`` metrics.
        summary: one line for the README's mode table.
    """

    name: str
    switch: tuple[str, ...]
    reads: tuple[str, ...]
    stacks_on: Callable[[str], bool]
    on: dict[str, Any]
    summary: str
    moves: str = "gradient"

    def is_on(self, actor: Any) -> bool:
        return any(_away_from_default(KNOBS[name], actor) for name in self.switch)


def _is_divclip(mode: str) -> bool:
    return mode in CONSTRAINTS


def _has_budget(mode: str) -> bool:
    return mode in CONSTRAINTS and CONSTRAINTS[mode].delta_budget


def _erc_stacks_on(mode: str) -> bool:
    return mode != "bypass_mode"  # it skips the old-log-prob pass that gives pi_old's entropy


FEATURES: tuple[Feature, ...] = (
    Feature(
        "ERC",
        ("erc_beta_low", "erc_beta_high"),
        ("erc_beta_low", "erc_beta_high", "erc_eps"),
        _erc_stacks_on,
        on={"erc_beta_low": 0.05, "erc_beta_high": 0.05},
        summary="1 − β_l < H_new/H_old < 1 + β_h, hard (any advantage sign); both entropies from one fp32 function",
    ),
    Feature(
        "dual-clip",
        ("dual_clip_c",),
        ("dual_clip_c",),
        _is_divclip,
        on={"dual_clip_c": 3.0},
        summary="w ≤ c for A < 0 (verl's own modes: verl's `actor.clip_ratio_c`, where they read it)",
    ),
    Feature(
        "adaptive delta",
        ("adaptive_delta_target",),
        (
            "adaptive_delta_target",
            "adaptive_delta_tolerance",
            "adaptive_delta_rate",
            "adaptive_delta_min",
            "adaptive_delta_max",
        ),
        _has_budget,
        on={"adaptive_delta_target": 0.01},
        summary="δ moves between updates so the update's mean KL3 tracks a target (opt-in; off = the paper's static δ)",
    ),
    Feature(
        "correct-response NLL",
        ("correct_nll_coef",),
        ("correct_nll_coef", "correct_reward", "correct_nll_norm"),
        lambda mode: True,
        on={"correct_nll_coef": 0.1},
        summary="+ coef × NLL of the responses whose summed reward is `correct_reward` (released ERC scripts)",
    ),
    Feature(
        "kl_full diagnostic",
        ("kl_full_diagnostic",),
        ("kl_full_diagnostic", "kl_full_top_k", "kl_full_direction", "delta"),
        _is_divclip,
        on={"kl_full_diagnostic": True},
        moves="metrics:actor/divclip/kl_full",
        summary="where the mode's clip decisions and the full-KL rule's (at δ) disagree (opt-in, metrics only)",
    ),
)
FEATURES_BY_NAME = {feature.name: feature for feature in FEATURES}


def all_modes() -> list[str]:
    """Every loss mode with a declaration: the divclip constraints, then verl's own modes."""
    return [*CONSTRAINTS, *VERL_MODE_READS]


def mode_reads(mode: str) -> tuple[str, ...]:
    """The knobs ``mode`` itself reads (its declaration); a ``KeyError`` naming the mode if it has none."""
    if mode in CONSTRAINTS:
        return CONSTRAINTS[mode].reads
    if mode in VERL_MODE_READS:
        return VERL_MODE_READS[mode].reads
    raise KeyError(
        f"loss_mode={mode!r} declares no knobs: add reads= to its define_constraint, or an entry to "
        "verl_ext.verl_modes.VERL_MODE_READS for a verl mode"
    )


def features_on(mode: str, actor: Any) -> list[Feature]:
    """The features switched on in ``actor`` that stack on ``mode``."""
    return [feature for feature in FEATURES if feature.stacks_on(mode) and feature.is_on(actor)]


def knobs_read(mode: str, actor: Any) -> set[str]:
    """The knobs read under ``mode`` with ``actor``'s features: the mode's own and the switched-on features'."""
    return set(mode_reads(mode)).union(*(feature.reads for feature in features_on(mode, actor)))


def readers(name: str) -> tuple[list[str], list[str]]:
    """The modes that read knob ``name``, and the features that do."""
    modes = [mode for mode in all_modes() if name in mode_reads(mode)]
    return modes, [feature.name for feature in FEATURES if name in feature.reads]


def _equal(a: Any, b: Any) -> bool:
    if all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
        return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
    return a == b


def _away_from_default(knob: Knob, actor: Any) -> bool:
    return not _equal(knob.value(actor), knob.default)


def _unread(knob: Knob, actor: Any, read: set[str]) -> bool:
    """Whether ``knob`` is away from its default and nothing reads it."""
    if not _away_from_default(knob, actor):
        return False
    if knob.same_as is not None and _equal(knob.value(actor), KNOBS[knob.same_as].value(actor)):
        return False
    if knob.name not in read:
        return True
    # a fallback is read only where a knob it stands in for is null
    return bool(knob.fallback_for) and all(KNOBS[name].value(actor) is not None for name in knob.fallback_for)


def unread_knobs(actor: Any) -> list[str]:
    """The knobs of ``actor`` (verl's actor config, with a divclip or a verl policy-loss config) set away from
    their defaults that neither its ``loss_mode`` nor a switched-on feature reads, one message each."""
    mode = actor.policy_loss.loss_mode
    read = knobs_read(mode, actor)
    on = [feature.name for feature in features_on(mode, actor)]
    problems = []
    for knob in KNOBS.values():
        if not _unread(knob, actor, read):
            continue
        modes, features = readers(knob.name)
        where = f"loss_mode={mode!r}" + (f" (with {', '.join(on)} on)" if on else "")
        if knob.name in read:  # a fallback whose knobs are all set
            problems.append(
                f"{knob.key}={knob.value(actor)!r} is not read by {where}: it stands in for "
                f"{' / '.join(KNOBS[name].key for name in knob.fallback_for)} only where they are null, and both are "
                "set: set those, or null them to use this one"
            )
            continue
        readers_text = f"the loss modes that read it: {modes}" if modes else "no loss mode reads it itself"
        if features:
            switches = [f"{name} (switched on by {' / '.join(FEATURES_BY_NAME[name].switch)})" for name in features]
            readers_text += f"; the features that read it: {', '.join(switches)}"
        same = f" (or at {KNOBS[knob.same_as].key}'s value, which says the same)" if knob.same_as else ""
        problems.append(
            f"{knob.key}={knob.value(actor)!r} is not read by {where}, so it would change nothing: "
            f"{readers_text}. Leave it at its default {knob.default!r}{same} or select a mode that reads it"
        )
    return problems
