"""The divclip trainer: what verl-divclip adds to verl 0.9.1's v1 trainer, for every trainer mode.

:class:`DivClipTrainer` sits on top of each class verl registers for ``trainer.v1.trainer_mode`` (docs/engine.md,
"The trainer classes"): the divclip actor loss, the adaptive delta, the old-log-prob pass's packing, skip and
top-k, staleness, per-benchmark validation, complete-checkpoint resume and the data trace; the rest is verl's.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any, Optional

import ray
from omegaconf import DictConfig, open_dict
from verl.trainer.main_ppo import TaskRunnerV1
from verl.trainer.ppo.v1 import PPOTrainerColocateAsync, PPOTrainerSeparateAsync, PPOTrainerSync
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
from verl.utils.config import omega_conf_to_dataclass

from recipe.checkpoints import set_aside_incomplete_checkpoints
from recipe.data_trace import DataTrace
from recipe.validation.length import ValidationLengthTrainerMixin
from verl_ext.actor_loss import build_actor_loss
from verl_ext.adaptive_delta import AdaptiveDelta
from verl_ext.config_rules.composed import bypass_mode, old_log_prob_from_update_blocker
from verl_ext.core.region import CONSTRAINTS
from verl_ext.core.staleness import behaviour_divergence
from verl_ext.engine.old_from_update import COLLECT_KEY, OLD_FROM_UPDATE_KEY
from verl_ext.engine.old_from_update import POLICY_KEY as OLD_FROM_UPDATE_CONFIG
from verl_ext.engine.packing import ON_POLICY_KEY, UPDATE_FOLLOWS_OLD_PASS_KEY, UPDATE_PACKING_KEY, UpdatePacking
from verl_ext.engine.request import describe, request_of, resolve_entropy_path
from verl_ext.engine.topk_capture import capturing_old_topk, old_topk_request
from verl_ext.plugin import require_registered

logger = logging.getLogger(__name__)

STALENESS_METRIC = "actor/divclip/staleness/"


class DivClipTrainer(ValidationLengthTrainerMixin):
    """What verl-divclip adds to a verl v1 trainer class (module docstring), composed with each of verl's in
    :data:`DIVCLIP_TRAINERS`. Its hooks call ``super()``: verl's class runs underneath."""

    adaptive_delta: Optional[AdaptiveDelta] = None
    data_trace: Optional[DataTrace] = None

    def __init__(self, config: DictConfig) -> None:
        # this is verl's TaskRunner process, which imported verl: its plugin must have registered the losses
        require_registered()
        super().__init__(config=config)

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
                "policy_loss.delta=%s",
                folder,
                self.adaptive_delta.delta,
            )

    def _trace_restored_prompts(self) -> None:
        """Async modes resume with the prompt groups TransferQueue held at the checkpoint (fetched by an
        earlier attempt, not yet trained): the data trace learns them as restored, each with verl's status (verl
        re-issues the pending and running ones when training starts)."""
        if self.config.trainer.v1.trainer_mode == "sync":
            return
        import transfer_queue as tq

        listing = (tq.kv_list("train") or {}).get("train", {})
        uids = [key for key, tag in listing.items() if tag.get("is_prompt", False)]
        if not uids:
            return
        rows = tq.kv_batch_get(keys=uids, partition_id="train", select_fields=["index", "raw_prompt"])
        self.data_trace.restored(
            self.global_steps + 1,
            uids,
            _column(rows, "index"),
            _column(rows, "raw_prompt"),
            [listing[uid]["status"] for uid in uids],
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

    def _old_log_prob_from_update(self) -> bool:
        """Whether this run takes the first mini-batch's pi_old from its update forward
        (``policy_loss.old_log_prob_from_update``: null = where exact, logged once when not taken)."""
        taken = getattr(self, "_divclip_old_from_update", None)
        if taken is None:
            asked = self.config.actor_rollout_ref.actor.policy_loss.get("old_log_prob_from_update", None)
            blocker = None if asked is False else old_log_prob_from_update_blocker(self.config)
            taken = asked is not False and blocker is None
            if asked is None and blocker is not None:
                logger.info("%s=null: not taken, the old-log-prob pass runs whole: %s", OLD_FROM_UPDATE_CONFIG, blocker)
            self._divclip_old_from_update = taken
        return taken

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        actor_rollout_ref = self.config.actor_rollout_ref
        # The update's mini-batch split travels with the old-log-prob pass (and only with it), so that the
        # workers pack that pass exactly as the update's first epoch and record what they packed.
        packing = UpdatePacking.from_actor_config(actor_rollout_ref.actor, actor_rollout_ref.rollout.n)
        batch.extra_info.update(packing.as_extra_info())
        from_update = self._old_log_prob_from_update() and self.local_trigger_step == 0  # verl's __init__ sets it
        if from_update:  # the first mini-batch's pi_old comes from the update: verl's metrics of it come after
            batch.extra_info[OLD_FROM_UPDATE_KEY] = True
        # kl_full / kl_full_diagnostic: this pass (and only this one) stores pi_old's top-k
        k = old_topk_request(actor_rollout_ref.actor.policy_loss)
        try:
            with capturing_old_topk(batch.extra_info, k):
                batch = super()._compute_old_log_prob(batch, metrics={} if from_update else metrics)
        finally:
            batch.extra_info.pop(UPDATE_PACKING_KEY, None)
            batch.extra_info.pop(OLD_FROM_UPDATE_KEY, None)
        self._divclip_collect_after_update = from_update
        if not from_update:
            metrics.update(self._staleness(batch))
        return batch

    def _collect_old_log_prob(self, batch: Any, metrics: dict) -> None:
        """After an update that supplied pi_old of its first mini-batch: verl's own ``_compute_old_log_prob``
        again, answered by the workers from what the pass and the update computed (no forward), so verl writes
        ``old_log_probs`` / ``entropy`` and logs ``actor/entropy`` (and its rollout debug metrics) from the numbers
        its pass would have given; then the metrics read from pi_old before the update: staleness and
        ``rollout_corr/*`` (verl's function, on the collected values)."""
        batch.extra_info[COLLECT_KEY] = True
        try:
            batch = super()._compute_old_log_prob(batch, metrics=metrics)
        finally:
            batch.extra_info.pop(COLLECT_KEY, None)
        metrics.update(self._staleness(batch))
        metrics.update(self._rollout_corr_metrics(batch))

    def _rollout_corr_metrics(self, batch: Any) -> dict[str, float]:
        """verl's ``rollout_corr/*`` off-policy metrics (``_compute_advantage``, rollout_is/rs null) from the
        collected pi_old: they replace the ones computed from the pass's placeholders."""
        rollout_corr = self.config.algorithm.get("rollout_correction", None)
        if rollout_corr is None or not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            return {}
        import transfer_queue as tq
        from verl import DataProto
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

        fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        _, found = compute_rollout_correction_and_add_to_batch(DataProto(batch=data.to_padded_tensor()), rollout_corr)
        return found

    def _staleness(self, batch: Any) -> dict[str, float]:
        """``actor/divclip/staleness/*`` of the batch about to be trained: mu against pi_old
        (:func:`verl_ext.core.staleness.behaviour_divergence`). The weight-version lag of the same samples is
        verl's own figure (``training/off_policy/trajectory_staleness*``, over the step)."""
        if not self.config.actor_rollout_ref.rollout.calculate_log_probs:
            return {}
        import transfer_queue as tq

        fields = ["old_log_probs", "rollout_log_probs", "response_mask"]
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        padded = data.to_padded_tensor()
        found = behaviour_divergence(padded["old_log_probs"], padded["rollout_log_probs"], padded["response_mask"])
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
        bypass = bypass_mode(self.config)
        # verl's trainer base sets local_trigger_step in __init__ for every mode (0 but in a cycle's later updates)
        starts_on_policy = not bypass and self.local_trigger_step == 0
        batch.extra_info.update({UPDATE_FOLLOWS_OLD_PASS_KEY: not bypass, ON_POLICY_KEY: starts_on_policy})
        batch = super()._update_actor(batch, metrics=metrics)
        if getattr(self, "_divclip_collect_after_update", False):
            self._divclip_collect_after_update = False
            self._collect_old_log_prob(batch, metrics)
        if self.data_trace is not None:
            self.data_trace.trained(self.global_steps, batch.keys, batch.tags)
        if self.adaptive_delta is not None:
            # the step's one update (recipe.config_checks refuses adaptive delta with parameter_sync_step > 1): its
            # KL3 against the pi_old it started from, all-gathered over data-parallel ranks and reduced by verl
            changed = self.adaptive_delta.update(metrics)
            metrics["actor/divclip/delta_next"] = self.adaptive_delta.delta
            if changed:
                self.install_actor_loss()
        return batch


def _column(batch: Any, key: str) -> list[Any]:
    """A batch column as a list (a tensor's values, or a stack of non-tensor values)."""
    value = batch[key]
    return list(value.tolist() if hasattr(value, "tolist") else value)


# -- the classes verl's TaskRunnerV1 builds ------------------------------------------------------


class DivClipPPOTrainerSync(DivClipTrainer, PPOTrainerSync):
    """verl's ``PPOTrainerSync`` (``trainer.v1.trainer_mode=sync``) with :class:`DivClipTrainer` on top."""


class DivClipPPOTrainerColocateAsync(DivClipTrainer, PPOTrainerColocateAsync):
    """verl's ``PPOTrainerColocateAsync`` (``trainer_mode=colocate_async``) with :class:`DivClipTrainer` on top."""


class DivClipPPOTrainerSeparateAsync(DivClipTrainer, PPOTrainerSeparateAsync):
    """verl's ``PPOTrainerSeparateAsync`` (``trainer_mode=separate_async``) with :class:`DivClipTrainer` on top."""


#: ``trainer.v1.trainer_mode`` -> the divclip class that replaces verl's under that name.
DIVCLIP_TRAINERS: dict[str, type[DivClipTrainer]] = {
    "sync": DivClipPPOTrainerSync,
    "colocate_async": DivClipPPOTrainerColocateAsync,
    "separate_async": DivClipPPOTrainerSeparateAsync,
}


def register_divclip_trainers() -> None:
    """Put the divclip classes in verl's trainer registry under verl's own mode names (idempotent).

    verl's ``register_trainer`` refuses to re-register a name, and verl compares ``trainer_mode`` with ``"sync"`` in
    many places, so the names stay verl's and an entry is replaced directly, only where it still holds exactly the
    verl class the divclip class is built on; else RuntimeError naming the mode (another plugin's class, or a verl
    release whose class for that mode moved).
    """
    for mode, cls in DIVCLIP_TRAINERS.items():
        verl_cls = cls.__bases__[-1]
        existing = TRAINER_REGISTRY.get(mode)
        if existing is cls:
            continue
        if existing is not verl_cls:
            raise RuntimeError(
                f"trainer.v1.trainer_mode={mode!r}: verl's trainer registry holds {existing!r}, not verl's "
                f"{verl_cls.__module__}.{verl_cls.__name__} that {cls.__name__} is built on; refusing to replace it"
            )
        TRAINER_REGISTRY[mode] = cls


class DivClipTaskRunner(TaskRunnerV1.__ray_metadata__.modified_class.__ray_actor_class__):
    """verl's ``TaskRunnerV1`` (the class under verl's Ray actor class) whose ``run`` registers the divclip trainers
    in its own process before verl's ``run`` builds one (Ray runs it as ``ray::DivClipTaskRunner``)."""

    def run(self, config: DictConfig) -> Any:
        register_divclip_trainers()  # in the TaskRunner's process only: the one process that builds a trainer
        return super().run(config)


#: :class:`DivClipTaskRunner` as a Ray actor class: ``recipe.main`` passes it to verl's ``run_ppo`` as
#: ``task_runner_class`` (``.remote()``, or
#: ``.options(runtime_env={"nsight": ...}).remote()`` under nsys).
DivClipTaskRunnerV1 = ray.remote(DivClipTaskRunner)
