"""``python -m recipe.main [--dry-run] [hydra overrides...]``: the one training entry point.

Composes ``configs/divclip_trainer.yaml``, validates it (ours first, then verl's) before Ray allocates anything, and
runs verl's own ``run_ppo`` with :class:`recipe.trainer.DivClipTaskRunnerV1`. ``--dry-run`` (or
``divclip.dry_run=true``) prints the resolved config as YAML after validation: no model, data, GPU or Ray needed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
AGENT_LOOP_MANAGER = "actor_rollout_ref.rollout.agent.agent_loop_manager_class"
VALIDATION_AGENT_LOOP_MANAGER = "recipe.validation.rollout.ValidationLengthAgentLoopManager"


def validate(config: DictConfig) -> None:
    """Our checks (naming keys), then verl's ``validate_config``."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    from recipe.config_checks import lora_rank_check_without_vllm, validate_divclip_config

    auto_set_device(config)
    validate_divclip_config(config)
    with lora_rank_check_without_vllm():
        validate_config(
            config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )


def run(config: DictConfig) -> None:
    # verl's validation prints to stdout; a dry run's stdout is the YAML alone
    with contextlib.redirect_stdout(sys.stderr) if config.divclip.dry_run else contextlib.nullcontext():
        validate(config)
    # the strategy is resolved by this process's resolver (recipe.config_checks.actor_strategy); Ray's
    # processes get the value
    config.actor_rollout_ref.actor.strategy = config.actor_rollout_ref.actor.strategy
    if config.divclip.dry_run:
        OmegaConf.resolve(config)
        sys.stdout.write(OmegaConf.to_yaml(config))
        return
    from verl.trainer.main_ppo import run_ppo

    from recipe.trainer import DivClipTaskRunnerV1
    from recipe.validation.length import ValidationPlan

    if ValidationPlan.from_config(config) is not None:
        # validation rows run their own agent loop, training rows verl's, through one manager (a manager of the
        # user's own was refused by recipe.validation.length)
        with open_dict(config):
            OmegaConf.update(config, AGENT_LOOP_MANAGER, VALIDATION_AGENT_LOOP_MANAGER)
    run_ppo(config, task_runner_class=DivClipTaskRunnerV1)


@hydra.main(config_path=CONFIG_DIR, config_name="divclip_trainer", version_base=None)
def _hydra_main(config: DictConfig) -> None:
    run(config)


def hydra_argv(argv: list[str]) -> list[str]:
    """The Hydra overrides for ``argv``: ``--dry-run`` becomes ``divclip.dry_run=true``, with Hydra's
    output and logging off so that stdout carries only the YAML (verl's logging goes to stderr)."""
    if "--dry-run" not in argv:
        return list(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    return [a for a in argv if a != "--dry-run"] + [
        "divclip.dry_run=true",
        "hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null", "hydra.run.dir=.",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    sys.argv = [sys.argv[0]] + hydra_argv(argv)
    _hydra_main()


if __name__ == "__main__":
    main()
