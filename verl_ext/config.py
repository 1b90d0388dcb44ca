"""The divclip knobs: a subclass of verl's ``PolicyLossConfig`` that a config selects with ``_target_``.

verl rejects undeclared keys, hence the subclass (:data:`CONFIG_TARGET`); the clip epsilons stay verl's
``actor.clip_ratio_low/high``. A leaf (verl and the standard library): the loss-mode registry's checks join at
construction through :func:`register_mode_check`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config import PolicyLossConfig

CONFIG_TARGET = "verl_ext.config.DivClipPolicyLossConfig"
#: verl's actor config and, below it, this dataclass: the prefixes of every key an error names.
ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS_KEY = f"{ACTOR}.policy_loss"
#: ``correct_nll_norm`` values: verl's global normalisation, or the released ERC code's per micro-batch one.
CORRECT_NLL_NORMS = ("global", "micro_batch")
#: ``kl_full_direction`` values: KL(pi_theta || pi_old) (ATR-GRPO Eq. 4) or KL(pi_old || pi_theta) (Truly PPO).
KL_FULL_DIRECTIONS = ("forward", "reverse")


#: The loss-mode registry's checks, run at the end of ``__post_init__`` (:func:`register_mode_check`).
_MODE_CHECKS: list[Callable[[DivClipPolicyLossConfig], None]] = []


def register_mode_check(
    check: Callable[[DivClipPolicyLossConfig], None],
) -> Callable[[DivClipPolicyLossConfig], None]:
    """Run ``check(config)`` at the end of every later ``DivClipPolicyLossConfig.__post_init__`` (idempotent):
    how :mod:`verl_ext.config_rules` adds the mode registry's checks without this module importing it. Configs
    built before that import are checked by their consumers."""
    if check not in _MODE_CHECKS:
        _MODE_CHECKS.append(check)
    return check


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class DivClipPolicyLossConfig(PolicyLossConfig):
    """Knobs of the unified divergence-constrained surrogate (ATR-GRPO Eq. 5) and of ERC (docs/losses.md).

    Args:
        delta: Per-token divergence budget of ``kl3`` (ATR-GRPO Theorem 4.2), ``kl1``, ``kl2``, ``is_kl3``,
            ``trgppo`` and ``kl_full``; per-sequence for ``seq_kl3`` (KL3(s_i) <= delta, Sec. 6.5). The paper's
            0.07; with the adaptive controller on, its initial value.
        adaptive_delta_target: Target d_targ of an update's mean KL3 (``actor/divclip/kl3_mean``; ``seq_kl3_mean``
            for ``seq_kl3``), tracked by PPO's adaptive-KL rule (Schulman et al. 2017 Sec. 4) acting on the
            budget (ATR-GRPO Sec. 6.5, :mod:`verl_ext.adaptive_delta`). ``None``: static delta, the paper's ATR.
        adaptive_delta_tolerance: Dead band factor tau >= 1 (PPO's 1.5).
        adaptive_delta_rate: Multiplicative step r > 1.
        adaptive_delta_min: Lower bound of the adaptive delta.
        adaptive_delta_max: Upper bound of the adaptive delta.
        dual_clip_c: Dual-clip cap c (Ye et al. 2020) of the ratio for A < 0; ``None``: off, so ``clip`` is
            exact PPO / DAPO. verl's own modes read ``actor.clip_ratio_c`` instead and refuse this key.
        gppo_beta_low: GPPO (Klear-Reasoner, general form) gradient scale beta_1 of tokens clipped at the lower
            bound (A < 0): gradient beta_1 * (1 - eps_low) * A. 1.0 in the paper.
        gppo_beta_high: beta_2 of tokens clipped at the upper bound (A > 0): beta_2 * (1 + eps_high) * A.
        dcpo_cap: Upper cap of DCPO's dynamic upper bound (DCPO's 10).
        kl_full_top_k: k of ``kl_full`` (ATR-GRPO Eq. 4): KL_t over pi_old's k most likely ids plus a tail
            bucket, a lower bound of the full KL. 1 <= k <= vocabulary; 4 * (2k + 1) bytes per token.
        kl_full_direction: ``"forward"``: KL(pi_theta || pi_old), Eq. 4; ``"reverse"``: KL(pi_old || pi_theta),
            the trigger of Truly PPO (Wang et al. 2019).
        kl_full_diagnostic: On any divclip mode, store pi_old's top-k and report where the mode's clip
            decisions and the full-KL rule's disagree.
        erc_beta_low: ERC band beta_l (ERC paper Eq. 6, beta = 0.05): tokens with H_new / H_old <= 1 - beta_l
            lose their gradient. ``None``: ERC off. Stacks on every mode, verl's own too (``verl_ext.verl_modes``).
        erc_beta_high: beta_h: tokens with H_new / H_old >= 1 + beta_h lose their gradient. Set with beta_l.
        erc_eps: Added to both entropies, (H + eps) / (H_old + eps), as the reference ERC code does, so a
            zero-entropy token gets ratio 1, not NaN.
        correct_nll_coef: Weight of a negative log-likelihood term on the responses whose summed token-level
            reward equals ``correct_reward`` (the released ERC scripts: 0.1; not in the paper). Only the actor
            loss installed by ``recipe.main`` applies it.
        correct_reward: Summed token-level reward that marks a response correct (1.0 with this project's rewards).
        correct_nll_norm: ``"global"``: normalised like the policy loss (``agg_loss`` with the global batch
            info); ``"micro_batch"``: per micro-batch, as the released ERC code.
        token_dump_path: Per-token JSONL dump for ERC's Figure 3 (``python -m recipe.plots scatter``); ``{rank}``
            becomes the process rank. Needs ERC on.
        token_dump_every_n_steps: Dump on every n-th training step only.
        token_dump_max_tokens: At most this many tokens per dumped step and process.
        vocab_pass: Both passes' log pi(y_t) and entropy by the chunked vocabulary pass
            (:mod:`verl_ext.core.vocab_pass`), never building the ``tokens x vocabulary`` logits.
        pack_old_log_prob_as_update: Pack the old-log-prob pass as the update's first epoch, so that every
            ratio before the first optimizer step is exactly 1 (verl#6280; docs/losses.md, "On-policy
            exactness"). Needs ``actor.strategy`` fsdp or fsdp2.
        old_log_prob_from_update: Take pi_old of each step's first mini-batch from its own update forward,
            detached: packed as the pass, it *is* pi_old bit for bit (verl#3996). ``None``: where exact,
            otherwise not (logged with the reason); ``True``: refused before Ray where not exact; ``False``: never.
    """

    delta: float = 0.07
    adaptive_delta_target: Optional[float] = None
    adaptive_delta_tolerance: float = 1.5
    adaptive_delta_rate: float = 1.5
    adaptive_delta_min: float = 0.005
    adaptive_delta_max: float = 0.5
    dual_clip_c: Optional[float] = None
    gppo_beta_low: float = 1.0
    gppo_beta_high: float = 1.0
    dcpo_cap: float = 10.0
    kl_full_top_k: int = 32
    kl_full_direction: str = "forward"
    kl_full_diagnostic: bool = False
    erc_beta_low: Optional[float] = None
    erc_beta_high: Optional[float] = None
    erc_eps: float = 1e-8
    correct_nll_coef: float = 0.0
    correct_reward: float = 1.0
    correct_nll_norm: str = "global"
    token_dump_path: Optional[str] = None
    token_dump_every_n_steps: int = 10
    token_dump_max_tokens: int = 2048
    vocab_pass: bool = False
    pack_old_log_prob_as_update: bool = True
    old_log_prob_from_update: Optional[bool] = None

    def __post_init__(self) -> None:
        prefix = POLICY_LOSS_KEY
        if not (_finite(self.delta) and self.delta > 0):
            raise ValueError(f"{prefix}.delta must be a finite number > 0, got {self.delta!r}")
        self._check_adaptive_delta(prefix)
        if self.dual_clip_c is not None and not (_finite(self.dual_clip_c) and self.dual_clip_c > 1):
            raise ValueError(
                f"{prefix}.dual_clip_c must be > 1 (or null to disable dual-clip), got {self.dual_clip_c!r}"
            )
        for key in ("gppo_beta_low", "gppo_beta_high"):
            value = getattr(self, key)
            if not (_finite(value) and value >= 0):
                raise ValueError(f"{prefix}.{key} must be a finite number >= 0, got {value!r}")
        if not (_finite(self.dcpo_cap) and self.dcpo_cap > 1):
            raise ValueError(f"{prefix}.dcpo_cap must be > 1, got {self.dcpo_cap!r}")
        if isinstance(self.kl_full_top_k, bool) or not isinstance(self.kl_full_top_k, int) or self.kl_full_top_k < 1:
            raise ValueError(f"{prefix}.kl_full_top_k must be an integer >= 1, got {self.kl_full_top_k!r}")
        if self.kl_full_direction not in KL_FULL_DIRECTIONS:
            raise ValueError(
                f"{prefix}.kl_full_direction must be one of {KL_FULL_DIRECTIONS}, got {self.kl_full_direction!r}"
            )
        if not isinstance(self.kl_full_diagnostic, bool):
            raise ValueError(f"{prefix}.kl_full_diagnostic must be true or false, got {self.kl_full_diagnostic!r}")
        if (self.erc_beta_low is None) != (self.erc_beta_high is None):
            missing = "erc_beta_high" if self.erc_beta_high is None else "erc_beta_low"
            raise ValueError(
                f"{prefix}.{missing} is null while the other ERC band is set: set both "
                "erc_beta_low and erc_beta_high (ERC on) or neither (ERC off)"
            )
        if self.erc_beta_low is not None:
            if not (_finite(self.erc_beta_low) and 0 < self.erc_beta_low < 1):
                raise ValueError(f"{prefix}.erc_beta_low must lie in (0, 1), got {self.erc_beta_low!r}")
            if not (_finite(self.erc_beta_high) and self.erc_beta_high > 0):
                raise ValueError(f"{prefix}.erc_beta_high must be > 0, got {self.erc_beta_high!r}")
        if not (_finite(self.erc_eps) and self.erc_eps > 0):
            raise ValueError(f"{prefix}.erc_eps must be a finite number > 0, got {self.erc_eps!r}")
        if not (_finite(self.correct_nll_coef) and self.correct_nll_coef >= 0):
            raise ValueError(f"{prefix}.correct_nll_coef must be a finite number >= 0, got {self.correct_nll_coef!r}")
        if not _finite(self.correct_reward):
            raise ValueError(f"{prefix}.correct_reward must be a finite number, got {self.correct_reward!r}")
        if self.correct_nll_norm not in CORRECT_NLL_NORMS:
            raise ValueError(
                f"{prefix}.correct_nll_norm must be one of {CORRECT_NLL_NORMS}, got {self.correct_nll_norm!r}"
            )
        for key in ("token_dump_every_n_steps", "token_dump_max_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}.{key} must be an integer >= 1, got {value!r}")
        if self.token_dump_path is not None and not self.erc_enabled:
            raise ValueError(
                f"{prefix}.token_dump_path dumps ERC's per-token entropy ratios: set erc_beta_low/erc_beta_high too"
            )
        for key in ("vocab_pass", "pack_old_log_prob_as_update"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{prefix}.{key} must be true or false, got {getattr(self, key)!r}")
        if self.old_log_prob_from_update is not None and not isinstance(self.old_log_prob_from_update, bool):
            raise ValueError(
                f"{prefix}.old_log_prob_from_update must be true, false or null, got {self.old_log_prob_from_update!r}"
            )
        for check in _MODE_CHECKS:  # the loss-mode registry's checks (see register_mode_check)
            check(self)

    @property
    def erc_enabled(self) -> bool:
        return self.erc_beta_low is not None

    @property
    def stores_old_topk(self) -> bool:
        """Whether the old-log-prob pass must store pi_old's top-k: ``kl_full`` or the diagnostic."""
        return self.loss_mode == "kl_full" or self.kl_full_diagnostic

    @property
    def adaptive_delta_enabled(self) -> bool:
        return self.adaptive_delta_target is not None

    def _check_adaptive_delta(self, prefix: str) -> None:
        if self.adaptive_delta_target is not None and not (
            _finite(self.adaptive_delta_target) and self.adaptive_delta_target > 0
        ):
            raise ValueError(
                f"{prefix}.adaptive_delta_target must be a finite number > 0 (or null for a static delta), "
                f"got {self.adaptive_delta_target!r}"
            )
        if not (_finite(self.adaptive_delta_tolerance) and self.adaptive_delta_tolerance >= 1):
            raise ValueError(
                f"{prefix}.adaptive_delta_tolerance must be a finite number >= 1, got {self.adaptive_delta_tolerance!r}"
            )
        if not (_finite(self.adaptive_delta_rate) and self.adaptive_delta_rate > 1):
            raise ValueError(
                f"{prefix}.adaptive_delta_rate must be a finite number > 1, got {self.adaptive_delta_rate!r}"
            )
        for key in ("adaptive_delta_min", "adaptive_delta_max"):
            value = getattr(self, key)
            if not (_finite(value) and value > 0):
                raise ValueError(f"{prefix}.{key} must be a finite number > 0, got {value!r}")
        if self.adaptive_delta_min > self.adaptive_delta_max:
            raise ValueError(
                f"{prefix}.adaptive_delta_min ({self.adaptive_delta_min}) must not exceed "
                f"adaptive_delta_max ({self.adaptive_delta_max})"
            )
        if (
            self.adaptive_delta_enabled
            and _finite(self.delta)
            and not (self.adaptive_delta_min <= self.delta <= self.adaptive_delta_max)
        ):
            raise ValueError(
                f"{prefix}.delta={self.delta} (the adaptive controller's initial delta) must lie within "
                f"[adaptive_delta_min, adaptive_delta_max] = [{self.adaptive_delta_min}, {self.adaptive_delta_max}]"
            )


def check_clip_ratios(clip_ratio_low: Any, clip_ratio_high: Any) -> tuple[float, float]:
    """Validate verl's actor clip epsilons as used by the divclip modes: 0 <= eps_low < 1,
    eps_high >= 0, and a non-empty interval l = 1 - eps_low < u = 1 + eps_high."""
    prefix = ACTOR
    for key, value in (("clip_ratio_low", clip_ratio_low), ("clip_ratio_high", clip_ratio_high)):
        if not _finite(value):
            raise ValueError(f"{prefix}.{key} must be a finite number, got {value!r}")
    if not 0 <= clip_ratio_low < 1:
        raise ValueError(f"{prefix}.clip_ratio_low must lie in [0, 1), got {clip_ratio_low!r}")
    if clip_ratio_high < 0:
        raise ValueError(f"{prefix}.clip_ratio_high must be >= 0, got {clip_ratio_high!r}")
    if clip_ratio_low == clip_ratio_high == 0:  # within the bounds above, the one empty [1 - eps_low, 1 + eps_high]
        raise ValueError(f"{prefix}.clip_ratio_low/clip_ratio_high are both 0: the ratio interval [1, 1] is empty")
    return float(clip_ratio_low), float(clip_ratio_high)


def actor_clip_range(actor_config: Any) -> tuple[float, float]:
    """The actor's (eps_low, eps_high) as verl's own losses read them: ``clip_ratio_low/high``, each falling back
    to ``clip_ratio`` when null. Not validated (verl's modes accept epsilons the divclip modes refuse)."""
    low = actor_config.clip_ratio_low if actor_config.clip_ratio_low is not None else actor_config.clip_ratio
    high = actor_config.clip_ratio_high if actor_config.clip_ratio_high is not None else actor_config.clip_ratio
    return low, high


def actor_clip_ratios(actor_config: Any) -> tuple[float, float]:
    """The actor's validated (eps_low, eps_high) (:func:`actor_clip_range`, checked for the divclip modes)."""
    return check_clip_ratios(*actor_clip_range(actor_config))
