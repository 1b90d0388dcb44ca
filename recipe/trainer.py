"""The divclip trainer: verl 0.9.1's synchronous v1 trainer with our actor loss installed.

``DivClipTrainer`` subclasses ``PPOTrainerSync`` (``trainer_mode=sync``) and, once the worker
groups exist, installs :func:`verl_ext.actor_loss.build_actor_loss` on the actor workers with
``set_loss_fn`` -- at init, and again whenever the opt-in adaptive trust-region controller
(``policy_loss.adaptive_delta_target``, :mod:`verl_ext.adaptive_delta`) moves delta after an actor
update; the controller's state is saved into and restored from verl's ``global_step_N`` folders.
With ``actor_rollout_ref.rollout.custom.validation`` set, validation runs each benchmark at its own
response length and sample count (:mod:`recipe.validation.length`); unset, validation is verl's.
With ``loss_mode=kl_full`` or ``kl_full_diagnostic`` the old-log-prob pass also stores pi_old's
top-k (:func:`verl_ext.engine.topk_capture.capturing_old_topk`). Before resuming it sets aside any
checkpoint folder written after the last complete one (:mod:`recipe.checkpoints`); with
``divclip.data_trace`` it records which prompts each step trained on (:mod:`recipe.data_trace`).
Everything else (rollouts, rewards, advantages, old-log-prob recompute with entropy, checkpoints) is verl's.

``DivClipTaskRunner`` mirrors ``verl.trainer.main_ppo.TaskRunnerV1.run``: that class is a
``@ray.remote`` actor class and cannot be subclassed, and its ``run`` builds the trainer
from verl's registry rather than taking a class.
"""

from __future__ import annotations

import copy
import logging
import os
from pprint import pprint
from typing import Any, Optional

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.trainer.ppo.v1 import PPOTrainerSync
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.logging_utils import configure_verl_logging

from verl_ext.actor_loss import build_actor_loss
from verl_ext.adaptive_delta import AdaptiveDelta
from verl_ext.core.region import CONSTRAINTS
from verl_ext.engine.packing import UpdatePacking
from verl_ext.engine.request import describe, request_of, resolve_entropy_path
from verl_ext.engine.topk_capture import capturing_old_topk, old_topk_request

from recipe.checkpoints import set_aside_incomplete_checkpoints
from recipe.data_trace import DataTrace
from recipe.validation.length import ValidationLengthTrainerMixin, ValidationPlan

logger = logging.getLogger(__name__)


class DivClipTrainer(ValidationLengthTrainerMixin, PPOTrainerSync):
    """``PPOTrainerSync`` whose actor workers use the divclip actor loss, with the optional
    adaptive-delta controller run on the driver (see :mod:`verl_ext.adaptive_delta`) and
    per-benchmark validation lengths (:mod:`recipe.validation.length`)."""

    adaptive_delta: Optional[AdaptiveDelta] = None
    data_trace: Optional[DataTrace] = None

    def _load_checkpoint(self) -> None:
        trainer = self.config.trainer
        if trainer.resume_mode == "auto":  # only complete checkpoints stay where verl (and people) look
            folder = trainer.default_local_dir
            set_aside_incomplete_checkpoints(folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder))
        trace_path = self.config.get("divclip", {}).get("data_trace", None)
        self.data_trace = DataTrace(trace_path) if trace_path else None
        super()._load_checkpoint()  # sets global_steps and restores the workers
        self.adaptive_delta = self._build_adaptive_delta()
        if self.adaptive_delta is None or self.global_steps == 0:
            return
        folder = self._resumed_folder()
        if self.adaptive_delta.restore(folder):
            logger.info("adaptive delta restored from %s: delta=%s", folder, self.adaptive_delta.delta)
        else:
            logger.warning(
                "adaptive delta: %s has no controller state (written with a static delta?); starting from "
                "policy_loss.delta=%s", folder, self.adaptive_delta.delta,
            )

    def _build_adaptive_delta(self) -> Optional[AdaptiveDelta]:
        policy = self.config.actor_rollout_ref.actor.policy_loss
        if policy.get("loss_mode") not in CONSTRAINTS:
            return None
        return AdaptiveDelta.from_policy(omega_conf_to_dataclass(policy))

    def _resumed_folder(self) -> str:
        """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from."""
        trainer = self.config.trainer
        if trainer.resume_mode == "resume_path":
            folder = trainer.resume_from_path
        else:
            folder = os.path.join(trainer.default_local_dir, f"global_step_{self.global_steps}")
        return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)

    def on_init_end(self) -> None:
        super().on_init_end()
        self.install_actor_loss()

    def install_actor_loss(self) -> None:
        actor_cfg = self.config.actor_rollout_ref.actor
        if self.adaptive_delta is not None:
            actor_cfg = copy.deepcopy(actor_cfg)
            with open_dict(actor_cfg):
                actor_cfg.policy_loss.delta = self.adaptive_delta.delta
        actor_config = omega_conf_to_dataclass(actor_cfg)
        loss = build_actor_loss(actor_config)
        self.actor_rollout_wg.set_loss_fn(loss)  # ONE_TO_ALL: the same loss (and delta) on every rank
        request = request_of(loss)
        path = resolve_entropy_path(
            request, use_fused_kernels=bool(self.config.actor_rollout_ref.model.get("use_fused_kernels", False))
        )
        # what was asked; the workers log what each step really did (actor/divclip/path/*)
        logger.info(
            "divclip actor loss installed: loss_mode=%s, delta=%s; asked of the engine: %s",
            actor_config.policy_loss.get("loss_mode", "vanilla"),
            actor_config.policy_loss.get("delta", None),
            describe(request, path),
        )

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        # The update's mini-batch split travels with the old-log-prob pass, so that the workers can
        # pack that pass exactly as the update's first epoch (verl_ext.engine.packing).
        actor_rollout_ref = self.config.actor_rollout_ref
        packing = UpdatePacking.from_actor_config(actor_rollout_ref.actor, actor_rollout_ref.rollout.n)
        batch.extra_info.update(packing.as_extra_info())
        # kl_full / kl_full_diagnostic: this pass (and only this one) stores pi_old's top-k
        k = old_topk_request(actor_rollout_ref.actor.policy_loss)
        with capturing_old_topk(batch.extra_info, k):
            return super()._compute_old_log_prob(batch, metrics=metrics)

    def _next_train_batch(self, num_prompts: Optional[int] = None) -> Any:
        batch = super()._next_train_batch(num_prompts)
        if self.data_trace is not None:
            column = lambda key: list(getattr(batch[key], "tolist", lambda: batch[key])())  # noqa: E731  (tensor or stack)
            indices = column("index") if "index" in batch.keys() else [None] * len(batch)
            self.data_trace.fetched(column("uid"), indices, column("raw_prompt"))
        return batch

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        batch = super()._update_actor(batch, metrics=metrics)
        if self.data_trace is not None:
            self.data_trace.trained(self.global_steps, batch.keys)
        if self.adaptive_delta is not None:
            # the update's KL3, all-gathered over data-parallel ranks and reduced by verl
            changed = self.adaptive_delta.update(metrics)
            metrics["actor/divclip/delta_next"] = self.adaptive_delta.delta
            if changed:
                self.install_actor_loss()
        return batch

    def _save_checkpoint(self) -> None:
        if self.adaptive_delta is not None:
            # before verl's save, which ends by pointing latest_checkpointed_iteration.txt here
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            self.adaptive_delta.save(folder)
        super()._save_checkpoint()


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
        if ValidationPlan.from_config(self.config) is not None:
            # validation rows run their own agent loop (recipe.validation.length checked that no
            # custom manager is set); training rows run verl's, through the same dispatch
            from recipe.validation.rollout import ValidationLengthAgentLoopManager

            manager_cls = ValidationLengthAgentLoopManager
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
