"""Property tests: no NaN/Inf anywhere for hostile inputs, for every divclip mode.

Log-probs anywhere in [-1e4, 0] (ratios far outside every bound), rows or whole batches
fully masked, zero and 1e-12 entropies, float32 and bf16, ERC and dual-clip on and off.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from verl.trainer.ppo.core_algos import get_policy_loss_fn

from tests.test_losses import MODES, actor_config
from verl_ext.registry import LossInputs, supplying

LOG_PROB = st.one_of(
    st.floats(min_value=-1e4, max_value=0.0, allow_nan=False),
    st.sampled_from([0.0, -0.0, -1e-12, -1e-6, -20.0, -1e4]),
)
ENTROPY = st.one_of(st.sampled_from([0.0, 1e-12, 1e-30]), st.floats(min_value=0.0, max_value=12.0, allow_nan=False))
ADVANTAGE = st.one_of(st.floats(min_value=-10.0, max_value=10.0, allow_nan=False), st.just(0.0))


@st.composite
def loss_inputs(draw):
    rows = draw(st.integers(1, 3))
    cols = draw(st.integers(1, 6))
    n = rows * cols

    def tensor(strategy):
        return torch.tensor(draw(st.lists(strategy, min_size=n, max_size=n)), dtype=torch.float64).reshape(rows, cols)

    old = tensor(LOG_PROB)
    new = tensor(LOG_PROB)
    adv = tensor(ADVANTAGE)
    mask = tensor(st.booleans())
    if draw(st.booleans()):
        mask[draw(st.integers(0, rows - 1))] = 0  # a fully masked row
    entropies = (tensor(ENTROPY), tensor(ENTROPY)) if draw(st.booleans()) else None
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    dual_clip_c = draw(st.sampled_from([None, 3.0, 10.0]))
    return old, new, adv, mask, entropies, dtype, dual_clip_c


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=loss_inputs())
def test_loss_and_gradient_are_finite(mode, inputs):
    old, new, adv, mask, entropies, dtype, dual_clip_c = inputs
    erc = {"erc_beta_low": 0.05, "erc_beta_high": 0.05} if entropies is not None else {}
    config = actor_config(mode, dual_clip_c=dual_clip_c, **erc)
    log_prob = new.to(dtype).requires_grad_(True)
    supplied = contextlib.nullcontext()  # ERC's entropies reach the entry as the actor loss gives them
    if entropies is not None:
        supplied = supplying(LossInputs(old_entropy=entropies[0].to(dtype), entropy=entropies[1].to(dtype)))
    with supplied:
        loss, metrics = get_policy_loss_fn(mode)(
            old_log_prob=old.to(dtype),
            log_prob=log_prob,
            advantages=adv.float(),
            response_mask=mask,
            loss_agg_mode="token-mean",
            config=config,
        )
    loss.backward()
    assert torch.isfinite(loss), (mode, loss)
    assert torch.isfinite(log_prob.grad).all(), (mode, log_prob.grad)
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if not mask.any():
        assert loss.item() == 0.0 and torch.all(log_prob.grad == 0)
