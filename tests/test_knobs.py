"""Generated from the loss modes' knob declarations (:mod:`verl_ext.knobs`): what a mode declares moves the
installed loss, what it does not declare is refused (and would change nothing), and the README's mode table is
the declarations' rendering.

The binding micro-batch is one sweep, built from two policies per token: pi_old's logits at a per-token
sharpness (so q = pi_old(y) runs from about 1/V to about 1), pi_theta's = pi_old's + noise + a per-row bias on
the sampled token (so log w runs over about [-4, 4] and each row's sequence ratio over both sides of 1), an
advantage of each sign per row, the entropies of both policies (ERC's ratio on both sides of every band), a
summed reward per row in {0, 0.5, 1}, and pi_old's top-k at the config's ``kl_full_top_k`` (what the engine stores).
Each knob is moved from its default to the probe value its declaration carries (:attr:`verl_ext.knobs.Knob.probe`);
a feature's knobs are moved with the feature switched on at its declared ``on`` values.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import subprocess
import sys
import textwrap
from functools import lru_cache
from typing import Any

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu

from recipe import mode_table
from recipe.bench.harness import make_actor_config, make_rollout_batch
from tests.test_ppo_loss_parity import verl_modes as registered_verl_modes
from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.config_rules.policy import check_knobs_read
from verl_ext.core.region import CONSTRAINTS
from verl_ext.knobs import (
    FEATURES,
    KNOBS,
    Feature,
    Knob,
    all_modes,
    mode_reads,
    unread_knobs,
)
from verl_ext.verl_modes import VERL_MODE_READS

ROWS, LENGTH, PROMPT, VOCAB = 192, 12, 2, 48


def declared_knob_names() -> set[str]:
    """Every knob some declaration names (each must be in :data:`KNOBS`)."""
    names = {name for mode in all_modes() for name in mode_reads(mode)}
    for feature in FEATURES:
        names |= set(feature.reads) | set(feature.switch)
    return names


# ------------------------------------------------------------------------------------------------
# The declarations themselves
# ------------------------------------------------------------------------------------------------


def test_every_declared_knob_is_a_knob_and_every_knob_is_declared() -> None:
    assert declared_knob_names() <= set(KNOBS), declared_knob_names() - set(KNOBS)
    assert set(KNOBS) <= declared_knob_names(), f"knobs no mode or feature reads: {set(KNOBS) - declared_knob_names()}"
    for knob in KNOBS.values():
        assert knob.probe != knob.default, knob.name


def test_every_registered_mode_has_a_declaration() -> None:
    verl_modes = registered_verl_modes()
    assert sorted(VERL_MODE_READS) == verl_modes
    assert set(all_modes()) == set(CONSTRAINTS) | set(verl_modes)


def _reads_in_source(function: Any) -> set[str]:
    """Every ``config.<name>``, ``config.get("<name>")``, ``config.policy_loss.<name>`` and
    ``config.policy_loss.get("<name>")`` in a function's source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    names: set[str] = set()

    def is_config(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "config") or (
            isinstance(node, ast.Attribute) and node.attr == "policy_loss" and is_config(node.value)
        )

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_config(node.value) and node.attr not in ("get", "policy_loss"):
            names.add(node.attr)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and is_config(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return names


#: What verl's functions read from the config that is not a loss knob: the aggregation's global batch info
#: (ppo_loss fills it), and bypass_mode's rollout-correction settings (algorithm.rollout_correction's).
NOT_KNOBS = {"global_batch_info", "rollout_correction"}


@pytest.mark.parametrize("mode", sorted(VERL_MODE_READS))
def test_verl_mode_declarations_are_what_verls_function_reads(mode: str) -> None:
    """Each declaration equals what verl 0.9.1's registered function reads (bypass_mode: and the vanilla it calls)."""
    function = core_algos.POLICY_LOSS_REGISTRY[mode]
    read = _reads_in_source(function)
    if mode == "bypass_mode":
        assert "compute_policy_loss_vanilla(" in inspect.getsource(function)
        read |= _reads_in_source(core_algos.compute_policy_loss_vanilla)
    assert read - NOT_KNOBS == set(VERL_MODE_READS[mode].reads)


# ------------------------------------------------------------------------------------------------
# The binding micro-batch and one run of the installed loss
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sweep:
    old_logits: torch.Tensor  # (ROWS, LENGTH, VOCAB)
    new_logits: torch.Tensor
    tokens: torch.Tensor  # (ROWS, LENGTH)
    advantages: torch.Tensor  # (ROWS, LENGTH)
    rewards: torch.Tensor  # (ROWS,)


@lru_cache(maxsize=1)
def sweep() -> Sweep:
    gen = torch.Generator().manual_seed(0)
    sharpness = 0.5 + 3.5 * torch.rand(ROWS, LENGTH, 1, generator=gen)
    old_logits = sharpness * torch.randn(ROWS, LENGTH, VOCAB, generator=gen)
    # drawn from the generator, not the global RNG: the sweep is the same whatever ran before it in the process
    tokens = torch.multinomial(old_logits.softmax(-1).view(-1, VOCAB), 1, generator=gen).view(ROWS, LENGTH)
    noisy = old_logits + 0.7 * torch.randn(ROWS, LENGTH, VOCAB, generator=gen)
    # the first token of every row on a grid instead (no noise): pi_old's probability q of it in 8 steps up to
    # 0.995, its ratio w in 12 steps over [0.5, 1.5] (q w < 1), each pair on both advantage signs: the token-level
    # bounds that depend on q (TRGPPO's Bernoulli KL) bind at every knob's value, whatever the noise drew
    q = torch.tensor([0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995]).repeat_interleave(2).repeat(ROWS // 16)
    w = torch.tensor([0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2, 1.3, 1.5]).repeat_interleave(16)
    q_new = torch.clamp(q * w, max=0.999)
    logit = lambda p: torch.log((VOCAB - 1) * p / (1 - p))  # noqa: E731  (one logit among VOCAB - 1 zeros)
    tokens[:, 0] = 0
    old_logits[:, 0], noisy[:, 0] = 0.0, 0.0
    old_logits[:, 0, 0], noisy[:, 0, 0] = logit(q), logit(q_new)
    # each row's sequence log-ratio mean_t log w set exactly (a bias on its sampled tokens' logits, by bisection):
    # |mean log w| log-spaced over [1e-4, 2.5], the direction cycling (+, +, -, -) against the advantage's (+, -):
    # on each side of 1, consecutive sequence ratios' log-ratios are 11 % apart, closer than two bounds a knob
    # moves (the adaptive delta's one step, 13 % apart at its smallest), so a sequence falls between any two
    magnitude = torch.logspace(-4.0, math.log10(2.5), ROWS)
    direction = torch.tensor([1.0, 1.0, -1.0, -1.0]).repeat(ROWS // 4)
    onehot = torch.nn.functional.one_hot(tokens, VOCAB).float()
    onehot[:, 0] = 0.0  # the grid's tokens keep their ratio
    old_lp = old_logits.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)

    def sequence_log_ratio(bias: torch.Tensor) -> torch.Tensor:
        new_lp = (noisy + bias.view(ROWS, 1, 1) * onehot).log_softmax(-1).gather(-1, tokens.unsqueeze(-1))
        return (new_lp.squeeze(-1) - old_lp).mean(-1)

    low, high = torch.full((ROWS,), -40.0), torch.full((ROWS,), 40.0)
    for _ in range(60):  # increasing in the bias
        mid = (low + high) / 2
        above = sequence_log_ratio(mid) > direction * magnitude
        low, high = torch.where(above, low, mid), torch.where(above, mid, high)
    new_logits = noisy + ((low + high) / 2).view(ROWS, 1, 1) * onehot
    sign = torch.tensor([1.0, -1.0]).repeat(ROWS // 2).view(ROWS, 1)
    rewards = torch.tensor([0.0, 0.5, 1.0]).repeat(ROWS // 3 + 1)[:ROWS]
    return Sweep(old_logits, new_logits, tokens, sign.expand(ROWS, LENGTH).clone(), rewards)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    log_p = logits.log_softmax(-1)
    return -(log_p.exp() * log_p).sum(-1)


def _nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@dataclasses.dataclass
class Run:
    grad: torch.Tensor
    loss: float
    metrics: dict[str, float]


def run_installed_loss(
    actor: Any, delta: float | None = None, advantage: float | None = None, on_policy: bool = False
) -> Run:
    """The installed actor loss (:func:`verl_ext.actor_loss.divclip_actor_loss`) on the sweep, as the engine calls
    it: no-padding layout, pi_old's top-k at the config's k when it stores one. ``delta`` replaces the policy's;
    ``advantage`` replaces every advantage; ``on_policy`` marks the micro-batch on-policy (the gauge runs)."""
    from verl_ext.actor_loss import divclip_actor_loss
    from verl_ext.core.coarsened_kl import log_masses_rows, topk_rows
    from verl_ext.engine.topk_capture import NEW_TOPK_LOG_PROBS, OLD_TOPK_LOG_PROBS

    s = sweep()
    old_lp = s.old_logits.log_softmax(-1).gather(-1, s.tokens.unsqueeze(-1)).squeeze(-1)
    new_lp = s.new_logits.log_softmax(-1).gather(-1, s.tokens.unsqueeze(-1)).squeeze(-1)
    data = make_rollout_batch(
        [PROMPT] * ROWS,
        [LENGTH] * ROWS,
        VOCAB,
        old_log_probs=list(old_lp),
        advantages=list(s.advantages if advantage is None else torch.full_like(s.advantages, advantage)),
        old_entropy=list(_entropy(s.old_logits)),
    )
    reward = torch.zeros(ROWS, LENGTH)
    reward[:, -1] = s.rewards
    data["rm_scores"] = _nested(list(reward))
    # the micro-batch is half of its mini-batch, as verl's engine tells the loss (global normalisation)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=2 * ROWS * LENGTH, global_batch_size=2 * ROWS)
    if on_policy:
        from verl_ext.engine.packing import ON_POLICY_KEY

        tu.assign_non_tensor(data, **{ON_POLICY_KEY: True})
    policy = actor.policy_loss
    if delta is not None:
        object.__setattr__(policy, "delta", delta)
    model_output: dict[str, Any] = {}
    if isinstance(policy, DivClipPolicyLossConfig) and policy.stores_old_topk:
        old_masses, ids = topk_rows(s.old_logits.reshape(-1, VOCAB), policy.kl_full_top_k)
        new_masses = log_masses_rows(s.new_logits.reshape(-1, VOCAB), ids)
        data[OLD_TOPK_LOG_PROBS] = _nested(list(old_masses.view(ROWS, LENGTH, -1)))
        model_output[NEW_TOPK_LOG_PROBS] = _nested(list(new_masses.view(ROWS, LENGTH, -1)))
    # the engine's flat output over prompt + response tokens: position t predicts token t + 1
    flat_lp = torch.zeros(ROWS, PROMPT + LENGTH)
    flat_lp[:, PROMPT - 1 : PROMPT - 1 + LENGTH] = new_lp
    flat_entropy = torch.ones(ROWS, PROMPT + LENGTH)
    flat_entropy[:, PROMPT - 1 : PROMPT - 1 + LENGTH] = _entropy(s.new_logits)
    leaf = flat_lp.reshape(-1).clone().requires_grad_(True)
    offsets = torch.arange(0, ROWS + 1) * (PROMPT + LENGTH)
    model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(leaf, offsets=offsets)
    model_output["entropy"] = torch.nested.nested_tensor_from_jagged(flat_entropy.reshape(-1), offsets=offsets)
    torch.manual_seed(0)  # clip_cov draws a random subset of its candidates
    loss, metrics = divclip_actor_loss(actor, model_output, data)
    (grad,) = torch.autograd.grad(loss, [leaf])
    loss = loss.detach()
    values = {}
    for name, metric in metrics.items():
        value = metric.values if hasattr(metric, "values") else metric
        value = value[0] if isinstance(value, list) and len(value) == 1 else value
        values[name] = float(value) if isinstance(value, (int, float, torch.Tensor)) else value
    return Run(grad, float(loss), values)


def actor_config(mode: str, **knobs: Any) -> Any:
    """The actor config of ``mode`` with ``knobs`` (actor or policy-loss fields by name), plus what the mode needs."""
    settings = {**(VERL_MODE_READS[mode].needs if mode in VERL_MODE_READS else {}), **knobs}
    actor = {name: value for name, value in settings.items() if KNOBS[name].owner == "actor"}
    policy = {name: value for name, value in settings.items() if KNOBS[name].owner == "policy_loss"}
    return make_actor_config(
        policy_loss=DivClipPolicyLossConfig(loss_mode=mode, **policy), calculate_entropy=True, **actor
    )


_RUNS: dict[tuple[str, tuple[tuple[str, Any], ...], float | None, float | None], Run] = {}


def run_mode(mode: str, settings: dict[str, Any], delta: float | None = None, advantage: float | None = None) -> Run:
    """:func:`run_installed_loss` of :func:`actor_config`, once per (mode, settings, delta, advantage) in this
    process."""
    key = (mode, tuple(sorted(settings.items())), delta, advantage)
    if key not in _RUNS:
        _RUNS[key] = run_installed_loss(actor_config(mode, **settings), delta, advantage)
    return _RUNS[key]


# ------------------------------------------------------------------------------------------------
# Declared knobs move the loss
# ------------------------------------------------------------------------------------------------


def _base(knob: Knob) -> dict[str, Any]:
    """A fallback knob is moved with the knobs it stands in for null (both runs)."""
    return {name: None for name in knob.fallback_for}


def declared_cases() -> list[tuple[str, str, str]]:
    """(mode, knob, feature or "") for every knob the mode reads and every knob of every feature that stacks on it."""
    cases = [(mode, name, "") for mode in all_modes() for name in mode_reads(mode)]
    cases += [
        (mode, name, feature.name)
        for mode in all_modes()
        for feature in FEATURES
        if feature.stacks_on(mode)
        for name in feature.reads
        if name not in mode_reads(mode)
    ]
    return cases


def _adaptive_runs(mode: str, base: dict[str, Any], probe: dict[str, Any]) -> tuple[Run, Run]:
    """The adaptive delta moves delta between updates: the controller of each config is fed the same measured
    budget metrics, swept over [1e-4, 1]; the loss runs at each measurement where the two next deltas differ, until
    one moves the gradient (there must be one). The two deltas can be close, and a sequence-level mode binds only
    where a whole sequence's ratio falls between them on the side its advantage clips; so the sweep's own
    advantages are tried, then every advantage +1 (the upper bounds bind), then every one -1 (the lower)."""
    from verl_ext.adaptive_delta import AdaptiveDelta

    policies = [actor_config(mode, **settings).policy_loss for settings in (base, probe)]
    controllers = [AdaptiveDelta.from_policy(policy) for policy in policies]  # None: a static delta
    runs = None
    for measured in torch.logspace(-4, 0, 81).tolist():
        deltas = [
            c.next_delta(measured) if c is not None else p.delta for c, p in zip(controllers, policies, strict=False)
        ]
        if deltas[0] != deltas[1]:
            for advantage in (None, 1.0, -1.0):
                runs = run_mode(mode, base, deltas[0], advantage), run_mode(mode, probe, deltas[1], advantage)
                if not torch.equal(runs[0].grad, runs[1].grad):
                    return runs
    if runs is None:
        raise AssertionError(f"{probe}: the controller's next delta never moves")
    return runs


def _moved(feature: Feature | None, base: Run, probe: Run) -> bool:
    if feature is not None and feature.moves.startswith("metrics:"):
        prefix = feature.moves.removeprefix("metrics:")
        pick = lambda run: {k: v for k, v in run.metrics.items() if k.startswith(prefix)}  # noqa: E731
        return pick(base) != pick(probe)
    return not torch.equal(base.grad, probe.grad)


@pytest.mark.parametrize(
    ("mode", "name", "feature_name"),
    declared_cases(),
    ids=[f"{m}-{k}" + (f"-{f}" if f else "") for m, k, f in declared_cases()],
)
def test_a_declared_knob_moves_the_installed_loss(mode: str, name: str, feature_name: str) -> None:
    knob = KNOBS[name]
    feature = next((f for f in FEATURES if f.name == feature_name), None)
    base = {**_base(knob)}
    if feature is not None and name not in feature.switch:
        base.update(feature.on)
    probe = {**base, **(feature.on if feature is not None else {}), name: knob.probe}
    if feature is not None and feature.name == "adaptive delta":
        before, after = _adaptive_runs(mode, base, probe)
    else:
        before, after = run_mode(mode, base), run_mode(mode, probe)
    assert math.isfinite(before.loss) and math.isfinite(after.loss)
    assert _moved(feature, before, after), f"{mode}: {knob.key} {knob.default!r} -> {knob.probe!r} moved nothing"


# ------------------------------------------------------------------------------------------------
# Undeclared knobs are refused, and would change nothing
# ------------------------------------------------------------------------------------------------


def undeclared_cases() -> list[tuple[str, str]]:
    """(mode, knob) for every knob neither the mode nor a feature stacking on it reads, and every knob of a
    feature that stacks on the mode but is off (its switches are not these knobs)."""
    cases = []
    for mode in all_modes():
        for name in KNOBS:
            if name in mode_reads(mode):
                continue
            stacking = [f for f in FEATURES if f.stacks_on(mode) and name in f.reads]
            if any(name in f.switch for f in stacking):
                continue  # setting it switches the feature on: declared
            cases.append((mode, name))
    return cases


@pytest.mark.parametrize(("mode", "name"), undeclared_cases(), ids=[f"{m}-{k}" for m, k in undeclared_cases()])
def test_an_undeclared_knob_is_refused_and_would_change_nothing(mode: str, name: str) -> None:
    knob = KNOBS[name]
    switch = next((f for f in FEATURES if name in f.switch), None)
    # a switch of a feature that does not stack on the mode is refused with the whole feature on
    settings = {**(switch.on if switch is not None else {}), name: knob.probe}
    try:
        actor = actor_config(mode, **settings)
    except ValueError as error:  # the feature's own check refuses it while the config is built
        assert knob.name in str(error) or any(n in str(error) for n in settings), str(error)
        assert switch is not None and not switch.stacks_on(mode), f"{mode}: {name} refused at construction: {error}"
        return
    with pytest.raises(ValueError) as refused:
        check_knobs_read(actor)
    message = str(refused.value)
    assert knob.key in message and f"loss_mode={mode!r}" in message, message
    readers = [m for m in all_modes() if name in mode_reads(m)]
    assert all(f"'{m}'" in message for m in readers), message
    base = run_mode(mode, {k: v for k, v in settings.items() if k != name})
    ignored = run_mode(mode, settings)
    assert torch.equal(base.grad, ignored.grad) and base.loss == ignored.loss, f"{mode} reads {name} undeclared"


def test_defaults_and_declared_settings_pass() -> None:
    for mode in all_modes():
        check_knobs_read(actor_config(mode))
        check_knobs_read(
            actor_config(mode, **{name: KNOBS[name].probe for name in mode_reads(mode) if not KNOBS[name].fallback_for})
        )


def test_every_unread_knob_is_refused_in_one_message() -> None:
    """Two unread knobs: one refusal naming both, each as its own clause (``; `` between them)."""
    actor = actor_config("clip", delta=0.5, gppo_beta_low=0.3)
    first, second = unread_knobs(actor)
    prefix = "actor_rollout_ref.actor.policy_loss"
    assert first.startswith(f"{prefix}.delta=0.5 is not read by loss_mode='clip'"), first
    assert second.startswith(f"{prefix}.gppo_beta_low=0.3 is not read by loss_mode='clip'"), second
    with pytest.raises(ValueError) as refused:
        check_knobs_read(actor)
    assert str(refused.value) == f"{first}; {second}"


def test_the_internal_mode_cannot_be_named() -> None:
    """The mode the actor loss selects for ERC on verl's own modes is refused by name, word for word."""
    from verl_ext.registry import ERC_ON_VERL_MODE

    with pytest.raises(ValueError) as refused:
        DivClipPolicyLossConfig(loss_mode=ERC_ON_VERL_MODE)
    assert str(refused.value) == (
        "actor_rollout_ref.actor.policy_loss.loss_mode='divclip_erc_on_verl_mode' is internal to the divclip actor "
        "loss: name a loss mode"
    )


def test_a_fallback_is_refused_where_the_knobs_it_stands_in_for_are_set() -> None:
    with pytest.raises(ValueError, match=r"actor\.clip_ratio=0\.4 is not read by loss_mode='clip'.*stands in for"):
        check_knobs_read(actor_config("clip", clip_ratio=0.4))
    check_knobs_read(actor_config("clip", clip_ratio=0.4, clip_ratio_low=None))


def test_clip_ratio_c_equal_to_dual_clip_c_says_the_same_c() -> None:
    """The released ERC profile sets verl's clip_ratio_c and the divclip dual_clip_c to the same c."""
    check_knobs_read(actor_config("clip", clip_ratio_c=10.0, dual_clip_c=10.0))
    with pytest.raises(ValueError, match=r"clip_ratio_c=5\.0 is not read by loss_mode='clip'"):
        check_knobs_read(actor_config("clip", clip_ratio_c=5.0, dual_clip_c=10.0))


# ------------------------------------------------------------------------------------------------
# Through the entry point: the dry runs
# ------------------------------------------------------------------------------------------------

P, A = "actor_rollout_ref.actor.policy_loss", "actor_rollout_ref.actor"
REFUSED_DRY_RUNS = [
    ([f"{P}.loss_mode=clip", f"{P}.delta=0.5"], f"{P}.delta=0.5 is not read by loss_mode='clip'"),
    ([f"{P}.loss_mode=kl3", f"{A}.clip_ratio_high=0.5"], f"{A}.clip_ratio_high=0.5 is not read by loss_mode='kl3'"),
    ([f"{P}.loss_mode=clip", f"{P}.gppo_beta_low=0.3"], f"{P}.gppo_beta_low=0.3 is not read by loss_mode='clip'"),
    ([f"{P}.loss_mode=vanilla", f"{P}.delta=0.5"], f"{P}.delta=0.5 is not read by loss_mode='vanilla'"),
    ([f"{P}.loss_mode=kl3", f"{P}.erc_eps=0.001"], f"{P}.erc_eps=0.001 is not read by loss_mode='kl3'"),
    ([f"{P}.loss_mode=gspo", f"{A}.clip_ratio_c=5.0"], f"{A}.clip_ratio_c=5.0 is not read by loss_mode='gspo'"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED_DRY_RUNS, ids=[" ".join(o) for o, _ in REFUSED_DRY_RUNS])
def test_the_entry_point_refuses_an_unread_knob_before_ray(overrides: list[str], message: str) -> None:
    from recipe.config_checks import ConfigError, validate_divclip_config
    from tests.test_recipe_main import compose_config

    with pytest.raises(ConfigError) as refused:
        validate_divclip_config(compose_config(*overrides))
    assert message in str(refused.value)


def test_the_dry_run_command_refuses_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "recipe.main", "--dry-run", *REFUSED_DRY_RUNS[0][0]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and REFUSED_DRY_RUNS[0][1] in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# The README's table is the declarations' rendering
# ------------------------------------------------------------------------------------------------


def test_the_readme_mode_table_is_rendered_from_the_declarations() -> None:
    text = mode_table.README.read_text()
    stale = "README.md's mode table is stale: run python -m recipe.mode_table --write"
    assert text == mode_table.render_readme(text), stale
    table = mode_table.render_table()
    for mode in all_modes():
        assert f"| `{mode}`" in table, mode
    for feature in FEATURES:
        assert f"| + {feature.name} on" in table, feature.name
