"""``python -m recipe.main [--dry-run] [hydra overrides...]``: the one training entry point.

Composes ``configs/divclip_trainer.yaml`` (verl's ``ppo_trainer`` plus the divclip keys),
validates it -- ours first, then verl's -- before Ray allocates anything, and runs verl's own ``run_ppo``
with verl's own ``TaskRunnerV1``, started with ``VERL_USE_EXTERNAL_MODULES`` naming :mod:`recipe.trainer`
(:class:`DivClipTaskRunnerV1`): verl imports that module in the TaskRunner's process, which puts the divclip
trainer classes in verl's trainer registry there, so the TaskRunner builds them for ``trainer.v1.trainer_mode``.
With per-benchmark validation lengths, the TaskRunner is also told which agent-loop manager to start.

``--dry-run`` (or ``divclip.dry_run=true``) stops after validation and prints the resolved
config as YAML on stdout, nothing else: no model, data, GPU or Ray needed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
#: verl imports these modules, comma-separated, in every process that runs ``import verl`` with it set.
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
#: What the TaskRunner imports through it: the plugin first (the CPU platform, if any, before verl's trainer
#: modules load), then the module whose import registers the divclip trainer classes.
TRAINER_MODULES = ("verl_ext.plugin", "recipe.trainer")
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
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


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

    from recipe.validation.length import ValidationPlan

    if ValidationPlan.from_config(config) is not None:
        # validation rows run their own agent loop, training rows verl's, through one manager (a manager of the
        # user's own was refused by recipe.validation.length)
        with open_dict(config):
            OmegaConf.update(config, AGENT_LOOP_MANAGER, VALIDATION_AGENT_LOOP_MANAGER)
    run_ppo(config, task_runner_class=DivClipTaskRunnerV1(config))


class DivClipTaskRunnerV1:
    """verl's ``TaskRunnerV1`` (a Ray actor class), started with ``VERL_USE_EXTERNAL_MODULES`` naming
    :data:`TRAINER_MODULES` in its ``runtime_env``, on top of the value the job already gives that variable.

    ``run_ppo`` starts the runner with ``.remote()``, or ``.options(runtime_env={"nsight": ...}).remote()`` when
    profiling with nsys: both are answered here, with the variable added to the ``runtime_env`` asked for. Ray
    merges an actor's ``env_vars`` with the job's, and the actors the TaskRunner starts inherit them (their
    ``import verl`` imports the trainer module too; it only registers classes they never build).
    """

    def __init__(self, config: DictConfig) -> None:
        job_env = OmegaConf.select(config, "ray_kwargs.ray_init.runtime_env.env_vars", default=None) or {}
        job_value = job_env.get(EXTERNAL_MODULES, None) or os.environ.get(EXTERNAL_MODULES, "")
        modules = [name.strip() for name in str(job_value).split(",") if name.strip()]
        self.env_vars = {EXTERNAL_MODULES: ",".join([*modules, *(m for m in TRAINER_MODULES if m not in modules)])}

    def actor_options(self, **options: Any) -> dict[str, Any]:
        """``options`` for ``TaskRunnerV1.options``, with :attr:`env_vars` added to their ``runtime_env``."""
        runtime_env = dict(options.get("runtime_env", None) or {})
        runtime_env["env_vars"] = {**(runtime_env.get("env_vars", None) or {}), **self.env_vars}
        return {**options, "runtime_env": runtime_env}

    def options(self, **options: Any) -> Any:
        from verl.trainer.main_ppo import TaskRunnerV1

        return TaskRunnerV1.options(**self.actor_options(**options))

    def remote(self) -> Any:
        return self.options().remote()


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
