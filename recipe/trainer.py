"""The divclip trainer: verl 0.9.1's synchronous v1 trainer with our actor loss installed.

``DivClipTrainer`` subclasses ``PPOTrainerSync`` (``trainer_mode=sync``) and, once the worker
groups exist, installs :func:`verl_ext.actor_loss.build_actor_loss` on the actor workers with
``set_loss_fn`` -- once, at init. Everything else (rollouts, rewards, advantages, old-log-prob
recompute with entropy, checkpoints, validation) is verl's.

``DivClipTaskRunner`` mirrors ``verl.trainer.main_ppo.TaskRunnerV1.run``: that class is a
``@ray.remote`` actor class and cannot be subclassed, and its ``run`` builds the trainer
from verl's registry rather than taking a class.
"""

from __future__ import annotations

import logging
from pprint import pprint
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo.v1 import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.logging_utils import configure_verl_logging

from verl_ext.actor_loss import build_actor_loss
from verl_ext.entropy import describe_entropy_path, loss_entropy_path, resolve_entropy_path

logger = logging.getLogger(__name__)


class DivClipTrainer(PPOTrainerSync):
    """``PPOTrainerSync`` whose actor workers use the divclip actor loss."""

    def on_init_end(self) -> None:
        super().on_init_end()
        self.install_actor_loss()

    def install_actor_loss(self) -> None:
        actor_config = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        loss = build_actor_loss(actor_config)
        self.actor_rollout_wg.set_loss_fn(loss)
        path = resolve_entropy_path(
            loss_entropy_path(loss),
            use_fused_kernels=bool(self.config.actor_rollout_ref.model.get("use_fused_kernels", False)),
        )
        logger.info(
            "divclip actor loss installed: loss_mode=%s, per-token entropy: %s",
            actor_config.policy_loss.get("loss_mode", "vanilla"),
            describe_entropy_path(path),
        )


@ray.remote(num_cpus=1)
class DivClipTaskRunner:
    """Mirror of verl's ``TaskRunnerV1`` that builds :class:`DivClipTrainer`."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.trainer: DivClipTrainer | None = None
        self.agent_loop_manager: Any = None

    def init_agent_loop_manager(self) -> None:
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ

        manager_fqn = self.config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
        manager_cls = load_class_from_fqn(manager_fqn, "AgentLoopManager") if manager_fqn else AgentLoopManagerTQ
        self.agent_loop_manager = manager_cls.create(
            config=self.config,
            llm_client=self.trainer.get_llm_client(),
            teacher_client=self.trainer.get_teacher_client(),
            reward_loop_worker_handles=self.trainer.get_reward_handles(),
        )

    def run(self, config: DictConfig) -> None:
        import transfer_queue as tq

        from verl_ext.plugin import require_registered

        configure_verl_logging()
        require_registered()  # this Ray process imported verl: the entry point must have run
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = DivClipTrainer(config=config)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()
