"""The divclip trainer: what verl-divclip adds to verl 0.9.1's v1 trainer, for every trainer mode.

:class:`DivClipTrainer` is one piece applied to whichever class verl registers for
``trainer.v1.trainer_mode`` (``sync``, ``colocate_async``, ``separate_async``): :func:`divclip_trainer_class`
composes it with ``verl.trainer.ppo.v1.get_trainer_cls(mode)``, the lookup verl's own ``main_ppo`` does.
What it adds:

* the divclip actor loss (:func:`verl_ext.actor_loss.build_actor_loss`) installed on the actor workers with
  ``set_loss_fn`` once the worker groups exist, and again whenever the opt-in adaptive trust-region
  controller (``policy_loss.adaptive_delta_target``, :mod:`verl_ext.adaptive_delta`) moves delta after an
  actor update; the controller's state is saved into and restored from verl's ``global_step_N`` folders;
* the update's packing handed to the old-log-prob pass (:mod:`verl_ext.engine.packing`), and, for the update,
  whether it follows that pass and whether it starts on-policy (not in ``bypass_mode``, nor in the later
  updates of a Decoupled-PPO cycle, whose pi_old is the cycle's first weights);
* pi_old's top-k stored by the old-log-prob pass for ``loss_mode=kl_full`` / ``kl_full_diagnostic``
  (:func:`verl_ext.engine.topk_capture.capturing_old_topk`);
* the staleness of each trained batch (:mod:`verl_ext.core.staleness`: version lag, mu against pi_old),
  logged as ``actor/divclip/staleness/*``;
* validation at each benchmark's own length (``actor_rollout_ref.rollout.custom.validation``,
  :mod:`recipe.validation.length`);
* only complete checkpoints resumed (:mod:`recipe.checkpoints`) and, with ``divclip.data_trace``, the
  prompts each step trained on (:mod:`recipe.data_trace`).

Where verl's class overrides the same hook (``PPOTrainerSeparateAsync._compute_old_log_prob`` restores the
cycle's first weights), both run: this class's hook wraps verl's through ``super()``. Everything else
(rollouts, rewards, advantages, the old-log-prob recompute with entropy, weight sync, checkpoints) is verl's.

``DivClipTaskRunner`` mirrors ``verl.trainer.main_ppo.TaskRunnerV1.run``: that class is a ``@ray.remote``
actor class and cannot be subclassed, and its ``run`` builds the trainer from verl's registry rather than
taking a class.
"""

from __future__ import annotations

import copy
import logging
import os
from pprint import pprint
from typing import Any, Optional

import ray
from omegaconf import DictConfig, OmegaConf, open_dict
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.import_utils import load_class_from_fqn
from verl.utils.logging_utils import configure_verl_logging

from verl_ext.actor_loss import build_actor_loss
from verl_ext.adaptive_delta import AdaptiveDelta
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.staleness import behaviour_divergence, version_lag
from verl_ext.engine.packing import (
    STARTS_ON_POLICY_KEY,
    UPDATE_FOLLOWS_OLD_PASS_KEY,
    UPDATE_PACKING_KEY,
    UpdatePacking,
)
from verl_ext.engine.request import describe, request_of, resolve_entropy_path
from verl_ext.engine.topk_capture import capturing_old_topk, old_topk_request

from recipe.checkpoints import set_aside_incomplete_checkpoints
from recipe.data_trace import DataTrace
from recipe.validation.length import ValidationLengthTrainerMixin, ValidationPlan

logger = logging.getLogger(__name__)

STALENESS_METRIC = "actor/divclip/staleness/"


class DivClipTrainer(ValidationLengthTrainerMixin):
    """What verl-divclip adds to a verl v1 trainer class (module docstring); compose it with one through
    :func:`divclip_trainer_class`. Its hooks call ``super()``: verl's class runs underneath."""

    adaptive_delta: Optional[AdaptiveDelta] = None
    data_trace: Optional[DataTrace] = None

    # -- checkpoints -----------------------------------------------------------------------------

    def _load_checkpoint(self) -> None:
        trainer = self.config.trainer
        if trainer.resume_mode == "auto":  # only complete checkpoints stay where verl (and people) look
            folder = trainer.default_local_dir
            set_aside_incomplete_checkpoints(folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder))
        trace_path = self.config.get("divclip", {}).get("data_trace", None)
        self.data_trace = DataTrace(trace_path) if trace_path else None
        super()._load_checkpoint()  # sets global_steps, restores the workers (and, async, TransferQueue)
        if self.data_trace is not None and self.global_steps > 0:
            self._trace_restored_prompts()
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

    def _trace_restored_prompts(self) -> None:
        """Async modes resume with the prompt groups TransferQueue held at the checkpoint (fetched by an
        earlier attempt, not yet trained): the data trace learns them as fetched."""
        if self.config.trainer.v1.trainer_mode == "sync":
            return
        import transfer_queue as tq

        listing = (tq.kv_list("train") or {}).get("train", {})
        uids = [key for key, tag in listing.items() if tag.get("is_prompt", False)]
        if not uids:
            return
        rows = tq.kv_batch_get(keys=uids, partition_id="train", select_fields=["index", "raw_prompt"])
        self.data_trace.fetched(self.global_steps + 1, uids, _column(rows, "index"), _column(rows, "raw_prompt"),
                                event="restored")

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

    def _save_checkpoint(self) -> None:
        if self.adaptive_delta is not None:
            # before verl's save, which ends by pointing latest_checkpointed_iteration.txt here
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            self.adaptive_delta.save(folder)
        super()._save_checkpoint()

    # -- the actor loss --------------------------------------------------------------------------

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

    # -- one update ------------------------------------------------------------------------------

    def _bypass_mode(self) -> bool:
        rollout_correction = self.config.algorithm.get("rollout_correction", None) or {}
        return bool(rollout_correction.get("bypass_mode", False))

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        actor_rollout_ref = self.config.actor_rollout_ref
        # The update's mini-batch split travels with the old-log-prob pass (and only with it), so that the
        # workers pack that pass exactly as the update's first epoch and record what they packed.
        packing = UpdatePacking.from_actor_config(actor_rollout_ref.actor, actor_rollout_ref.rollout.n)
        batch.extra_info.update(packing.as_extra_info())
        # kl_full / kl_full_diagnostic: this pass (and only this one) stores pi_old's top-k
        k = old_topk_request(actor_rollout_ref.actor.policy_loss)
        try:
            with capturing_old_topk(batch.extra_info, k):
                batch = super()._compute_old_log_prob(batch, metrics=metrics)
        finally:
            batch.extra_info.pop(UPDATE_PACKING_KEY, None)
        metrics.update(self._staleness(batch))
        return batch

    def _staleness(self, batch: Any) -> dict[str, float]:
        """``actor/divclip/staleness/*`` of the batch about to be trained (:mod:`verl_ext.core.staleness`)."""
        found: dict[str, float] = {}
        min_versions = [tag["min_global_steps"] for tag in batch.tags
                        if not tag.get("is_padding", False) and tag.get("min_global_steps") is not None]
        found.update(version_lag(self.global_steps - 1, min_versions))
        if self.config.actor_rollout_ref.rollout.calculate_log_probs:
            import transfer_queue as tq

            fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            padded = data.to_padded_tensor()
            found.update(behaviour_divergence(padded["old_log_probs"], padded["rollout_log_probs"], padded["response_mask"]))
        return {STALENESS_METRIC + name: value for name, value in found.items()}

    def _next_train_batch(self, num_prompts: Optional[int] = None) -> Any:
        batch = super()._next_train_batch(num_prompts)
        if self.data_trace is not None:
            indices = _column(batch, "index") if "index" in batch.keys() else [None] * len(batch)
            self.data_trace.fetched(self.global_steps, _column(batch, "uid"), indices, _column(batch, "raw_prompt"))
        return batch

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        # pi_old came from this rank's packed old pass (so the workers compare the update with its record)
        # unless bypass_mode skipped that pass; and pi_theta is pi_old when the update starts, unless pi_old
        # is the behaviour policy (bypass) or the first weights of a Decoupled-PPO cycle (a later update of it)
        bypass = self._bypass_mode()
        starts_on_policy = not bypass and getattr(self, "local_trigger_step", 0) == 0
        batch.extra_info.update({UPDATE_FOLLOWS_OLD_PASS_KEY: not bypass, STARTS_ON_POLICY_KEY: starts_on_policy})
        batch = super()._update_actor(batch, metrics=metrics)
        if self.data_trace is not None:
            self.data_trace.trained(self.global_steps, batch.keys, batch.tags)
        if self.adaptive_delta is not None and self._update_measures_drift(starts_on_policy):
            # the update's KL3, all-gathered over data-parallel ranks and reduced by verl
            changed = self.adaptive_delta.update(metrics)
            metrics["actor/divclip/delta_next"] = self.adaptive_delta.delta
            if changed:
                self.install_actor_loss()
        return batch

    def _update_measures_drift(self, starts_on_policy: bool) -> bool:
        """Whether the update's KL3 measures how far the policy moves, for adaptive delta. Not when the update is
        one on-policy pass: ``separate_async`` trains one mini-batch per update, so with ``ppo_epochs=1`` the first
        update of each ``parameter_sync_step`` cycle starts at pi_old and reads exactly 0 whatever delta is (in the
        other modes one mini-batch per step is refused before Ray)."""
        actor = self.config.actor_rollout_ref.actor
        one_pass = self.config.trainer.v1.trainer_mode == "separate_async" and actor.ppo_epochs == 1
        return not (starts_on_policy and one_pass)


def _column(batch: Any, key: str) -> list[Any]:
    """A batch column as a list (a tensor's values, or a stack of non-tensor values)."""
    value = batch[key]
    return list(value.tolist() if hasattr(value, "tolist") else value)


_TRAINER_CLASSES: dict[str, type] = {}


def divclip_trainer_class(mode: str) -> type:
    """:class:`DivClipTrainer` composed with the class verl registers for ``trainer.v1.trainer_mode=mode``
    (``verl.trainer.ppo.v1.get_trainer_cls``, which raises naming the known modes), built once per mode and
    published in this module under its own name (``DivClipPPOTrainerSync``, ...)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    if mode not in _TRAINER_CLASSES:
        base = get_trainer_cls(mode)
        name = f"DivClip{base.__name__}"
        cls = type(name, (DivClipTrainer, base), {"__module__": __name__, "__qualname__": name, "__doc__":
                   f"verl's ``{base.__name__}`` (trainer_mode={mode}) with :class:`DivClipTrainer` on top."})
        globals()[name] = cls
        _TRAINER_CLASSES[mode] = cls
    return _TRAINER_CLASSES[mode]


@ray.remote(num_cpus=1)
class DivClipTaskRunner:
    """Mirror of verl's ``TaskRunnerV1`` that builds the divclip trainer of the configured mode."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.trainer: Any = None
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
        trainer_cls = divclip_trainer_class(config.trainer.v1.trainer_mode)
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config)
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
