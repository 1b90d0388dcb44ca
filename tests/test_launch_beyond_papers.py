"""Launch rows beyond the papers: ERC stacked on verl's own GSPO and SAPO losses on the ERC paper's
7B setup. Each script's command line, composed and validated by ``recipe.main`` as its dry run does,
resolves to the rule, the ERC band and the ERC base settings (docs/experiments.md, "Beyond the papers")."""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_launch import _actor, printer, script_config  # noqa: F401  (printer: the fixture)

ROWS = {  # script -> (loss_mode, clip eps (low, high), loss_agg_mode, actor extras)
    "run_erc_gspo_7b.sh": ("gspo", (0.0003, 0.0004), "seq-mean-token-mean", {}),
    "run_erc_sapo_7b.sh": ("sapo", None, None, {"tau_pos": 1.0, "tau_neg": 1.05}),
}


@pytest.fixture(scope="module")
def configs(printer: str) -> dict[str, Any]:  # noqa: F811  (the imported fixture)
    """Each row as its dry run resolves it (composed and validated in this process: tests/test_launch.py's
    ``script_config``)."""
    return {script: script_config(printer, script, "--dry-run") for script in ROWS}


@pytest.mark.parametrize("script", sorted(ROWS))
def test_erc_on_verl_mode_rows(configs: dict[str, Any], script: str) -> None:
    mode, eps, agg, extras = ROWS[script]
    config = configs[script]
    actor = _actor(config)
    policy = actor["policy_loss"]
    assert config["actor_rollout_ref"]["model"]["path"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"
    assert policy["_target_"] == "verl_ext.config.DivClipPolicyLossConfig"  # so the ERC keys exist
    assert policy["loss_mode"] == mode
    assert (policy["erc_beta_low"], policy["erc_beta_high"]) == (0.05, 0.05)
    assert actor["calculate_entropy"] is True and actor["entropy_coeff"] == 0
    if eps is not None:
        assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == eps
    if agg is not None:
        assert actor["loss_agg_mode"] == agg
    for key, value in extras.items():
        assert actor[key] == value
    assert config["trainer"]["experiment_name"] == script.removeprefix("run_").removesuffix(".sh")
    assert config["data"]["max_response_length"] == 16384  # the ERC setup's 16k responses
