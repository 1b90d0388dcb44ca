"""pack_old_log_prob_as_update: the old-log-prob pass packed as the update's first epoch, so that every ratio
before the first optimizer step is exactly 1 (verl#6280); the update checks it against the pass's
:class:`PackingRecord`. Also the mark of the update's on-policy first mini-batch (the gauge). docs/losses.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
from tensordict import TensorDict

from verl_ext.engine.guard import check_infer_batch_outputs, engine_attribute
from verl_ext.engine.old_from_update import (
    check_update_batch,
    finish_update,
    keep_pass_outputs,
    placeholder_output,
    skipped_mini_batch,
)
from verl_ext.engine.old_from_update import pending as pending_old
from verl_ext.engine.old_from_update import state_of as old_from_update_state

logger = logging.getLogger(__name__)

UPDATE_PACKING_KEY = "divclip_update_packing"
"""Non-tensor key of the old-log-prob batch: the update's mini-batch settings (``UpdatePacking``)."""

ON_POLICY_KEY = "divclip_on_policy"
"""Non-tensor key: whether the data starts on-policy. On an update batch (set by the trainer; absent: true):
pi_theta equals pi_old when the call starts. On a mini-batch (set by the seam): it runs before any optimizer
step of the call."""

UPDATE_FOLLOWS_OLD_PASS_KEY = "divclip_update_follows_old_pass"
"""Non-tensor key of an update batch: its pi_old came from this rank's packed old-log-prob pass (the trainer
sets it), so with pack_old_log_prob_as_update asked for a missing :class:`PackingRecord` is an error."""

ROW_KEY = "divclip_row"
"""Tensor field the seam adds to a batch it packs or trains: each row's position in the batch the worker
received, so that every micro-batch says which rows it holds."""

_ON_POLICY_ATTR = "_divclip_on_policy"  # the worker's ON_POLICY_KEY for its call's next mini-batch
_RECORD_ATTR = "_divclip_packing_record"
_RECORDING_ATTR = "_divclip_recording"
_OBSERVER_ATTR = "_divclip_update_observer"


class PackingMismatchError(RuntimeError):
    """The update's first epoch is not packed as the old-log-prob pass recorded (or no pass recorded one)."""


@dataclass(frozen=True)
class UpdatePacking:
    """How ``TrainingWorker.train_mini_batch`` will split the batch (its first epoch). ``mini_batch_size``:
    sequences over all data-parallel ranks (``actor.ppo_mini_batch_size * rollout.n``, as the v1 trainer passes
    it); ``seed``: ``actor.data_loader_seed`` (each rank adds its data-parallel rank, like verl)."""

    mini_batch_size: int
    seed: int
    shuffle: bool

    @classmethod
    def from_actor_config(cls, actor: Mapping[str, Any], rollout_n: int) -> UpdatePacking:
        """From ``actor_rollout_ref.actor`` and ``rollout.n``, exactly as ``_update_actor`` reads them."""
        return cls(
            mini_batch_size=int(actor["ppo_mini_batch_size"]) * int(rollout_n),
            seed=int(actor["data_loader_seed"]),
            shuffle=bool(actor["shuffle"]),
        )

    def as_extra_info(self) -> dict[str, dict[str, Any]]:
        return {UPDATE_PACKING_KEY: asdict(self)}


def first_epoch_mini_batches(size: int, mini_batch_size_per_gpu: int, seed: int, shuffle: bool) -> list[torch.Tensor]:
    """The row indices of each mini-batch of ``train_mini_batch``'s first epoch, drawn by verl's own
    ``tu.make_iterator`` (the same DataLoader, generator and seed), so they match by construction."""
    from verl.utils import tensordict_utils as tu

    if mini_batch_size_per_gpu <= 0 or size % mini_batch_size_per_gpu:
        raise ValueError(
            f"the update splits {size} sequences per rank into mini-batches of {mini_batch_size_per_gpu}, which does "
            "not divide them (actor_rollout_ref.actor.ppo_mini_batch_size * rollout.n / data-parallel size)"
        )
    rows = TensorDict({"row": torch.arange(size)}, batch_size=[size])
    iterator = tu.make_iterator(
        rows, mini_batch_size=mini_batch_size_per_gpu, epochs=1, seed=seed, dataloader_kwargs={"shuffle": shuffle}
    )
    return [mini_batch["row"] for mini_batch in iterator]


def row_token_counts(data: TensorDict) -> list[int]:
    """Tokens per row (prompt + response) of a batch or micro-batch in verl's no-padding layout."""
    input_ids = data["input_ids"]
    if getattr(input_ids, "is_nested", False):
        return input_ids.offsets().diff().tolist()
    return data["attention_mask"].sum(-1).tolist()


def row_fingerprints(data: TensorDict) -> list[tuple[int, int]]:
    """``(tokens, checksum)`` per row, the checksum weighing each token id by its position: rows that differ in
    content or order differ here (identical rows compute identical logits, so need not be told apart)."""
    input_ids = data["input_ids"]
    if getattr(input_ids, "is_nested", False):
        offsets = input_ids.offsets().cpu()
        values = input_ids.values()[int(offsets[0]) : int(offsets[-1])].cpu().long()
        lengths = offsets.diff()
    else:
        mask = data["attention_mask"].bool().cpu()
        values = input_ids.cpu().long()[mask]
        lengths = mask.sum(-1)
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
    positions = torch.arange(len(values)) - starts[rows]
    checksum = torch.zeros(len(lengths), dtype=torch.long).index_add_(0, rows, values * (positions % 65521 + 1))
    return list(zip(lengths.tolist(), checksum.tolist(), strict=False))


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch as a pass computed it: the rows it held, in order, and their token counts."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]

    @classmethod
    def of(cls, micro_batch: TensorDict) -> PackedMicroBatch:
        return cls(tuple(int(r) for r in micro_batch[ROW_KEY].tolist()), tuple(row_token_counts(micro_batch)))

    def describe(self) -> str:
        return f"rows {list(self.rows)} ({sum(self.tokens)} tokens: {list(self.tokens)})"


@dataclass
class PackingRecord:
    """What one rank's old-log-prob pass packed: the batch it received (a fingerprint per row) and, per
    first-epoch update mini-batch, its micro-batches in the order they ran."""

    fingerprints: list[tuple[int, int]]
    #: None for a mini-batch the pass skipped (old_log_prob_from_update: the update computes its pi_old)
    mini_batches: list[Optional[list[PackedMicroBatch]]] = field(default_factory=list)


def infer_as_update(engine: Any, data: TensorDict, loss_function: Any, infer: Callable[..., Any]) -> Any:
    """verl's ``infer_batch`` (``infer``) run once per first-epoch update mini-batch of ``data``, each packed
    with the update's micro-batch settings; the outputs are reassembled in ``data``'s order. With the
    trainer's packing key the pass leaves its :class:`PackingRecord` on the engine (docs/losses.md)."""
    from verl.utils import tensordict_utils as tu

    size = len(data)
    packing = tu.get_non_tensor_data(data=data, key=UPDATE_PACKING_KEY, default=None)
    max_token_len, micro_batch_size = (
        engine_attribute(engine, f"engine_config.{name}")
        for name in ("max_token_len_per_gpu", "micro_batch_size_per_gpu")
    )
    record, skip = None, None
    if packing is None:  # a direct caller: one mini-batch, in order (train_mini_batch(mini_batch_size=len))
        groups = [torch.arange(size)]
    else:
        dp_size, dp_rank = engine.get_data_parallel_size(), engine.get_data_parallel_rank()
        groups = first_epoch_mini_batches(
            size, int(packing["mini_batch_size"]) // dp_size, int(packing["seed"]) + dp_rank, bool(packing["shuffle"])
        )
        record = PackingRecord(row_fingerprints(data))
        # old_log_prob_from_update: the mini-batch whose pi_old its own update forward supplies is not run here
        skip = skipped_mini_batch(engine, data, groups, record.fingerprints)
    run, outputs = [], []
    for index, rows in enumerate(groups):
        recorded: Optional[list[PackedMicroBatch]] = None  # stays None for the skipped mini-batch
        if index != skip:
            part = tu.index_select_tensor_dict(data, rows)
            part[ROW_KEY] = rows.clone()
            tu.assign_non_tensor(part, max_token_len_per_gpu=max_token_len, micro_batch_size_per_gpu=micro_batch_size)
            recorded = []
            setattr(engine, _RECORDING_ATTR, recorded)
            try:
                outputs.append(infer(engine, part, loss_function))
            finally:
                setattr(engine, _RECORDING_ATTR, None)
            run.append(rows)
        if record is not None:
            record.mini_batches.append(recorded)
    if record is not None:  # the trainer's old pass (a reference pass on the same engine keeps it: no key)
        setattr(engine, _RECORD_ATTR, record)
    check_infer_batch_outputs(outputs)  # verl's result layout, before any key of it is read
    if old_from_update_state(engine) is not None:
        mask = data["response_mask"]  # response tokens per row (pi_old's top-k placeholders)
        responses = mask.offsets().diff().tolist() if getattr(mask, "is_nested", False) else [mask.shape[-1]] * size
        keep_pass_outputs(engine, row_token_counts(data), responses, run, outputs)
        return placeholder_output(engine, size)
    if len(outputs) == 1 and packing is None:
        return outputs[0]
    if any(out is None for out in outputs):
        return None

    piece_of_row = torch.cat(groups).argsort().tolist()  # the outputs hold the rows in the groups' order
    model_output: dict[str, torch.Tensor] = {}
    for key in outputs[0]["model_output"]:
        pieces = [row for out in outputs for row in out["model_output"][key].unbind()]
        model_output[key] = torch.nested.as_nested_tensor([pieces[i] for i in piece_of_row], layout=torch.jagged)
    metrics: dict[str, list[Any]] = {}
    for out in outputs:
        for key, value in out.get("metrics", {}).items():
            metrics.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    return {"model_output": model_output, "loss": [loss for out in outputs for loss in out["loss"]], "metrics": metrics}


class UpdateObserver:
    """Compares one update call's first-epoch mini-batches and micro-batches with the old pass's record; the
    first difference raises :class:`PackingMismatchError`. ``first_epoch``: the update's mini-batches per epoch."""

    def __init__(self, record: PackingRecord, first_epoch: int) -> None:
        self.record = record
        self.first_epoch = first_epoch
        self.mini_batch = -1
        self.micro_batch = 0

    def _mismatch(self, what: str) -> PackingMismatchError:
        return PackingMismatchError(
            f"actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=true, but {what}. The old-log-prob "
            "pass was packed for a different update split than the one verl runs, so its ratios would carry the "
            "kernels' noise: this verl (or trainer mode) passes the update's mini-batches differently from what "
            "verl_ext.engine.packing.UpdatePacking derives; set pack_old_log_prob_as_update=false to run with "
            "verl's own packing, or report it"
        )

    def start(self, fingerprints: list[tuple[int, int]]) -> None:
        """The update's batch: the same rows, in the same order, as the old pass received, and the same split."""
        recorded = self.record.fingerprints
        if fingerprints != recorded:
            first = next(
                (i for i, (a, b) in enumerate(zip(fingerprints, recorded, strict=False)) if a != b),
                min(len(fingerprints), len(recorded)),
            )
            raise self._mismatch(
                f"the update received {len(fingerprints)} rows and the old-log-prob pass {len(recorded)}, first "
                f"different at row {first} (tokens, checksum: update "
                f"{fingerprints[first] if first < len(fingerprints) else None}, old pass "
                f"{recorded[first] if first < len(recorded) else None})"
            )
        if self.first_epoch != len(self.record.mini_batches):
            raise self._mismatch(
                f"the update splits its first epoch into {self.first_epoch} mini-batch(es) and the old-log-prob pass "
                f"packed {len(self.record.mini_batches)}"
            )

    def _end_mini_batch(self) -> None:
        if 0 <= self.mini_batch < self.first_epoch:
            expected = self.record.mini_batches[self.mini_batch]
            if expected is not None and self.micro_batch != len(expected):
                raise self._mismatch(
                    f"update mini-batch {self.mini_batch} ran {self.micro_batch} micro-batch(es) and the old-log-prob "
                    f"pass packed it into {len(expected)}: {[m.describe() for m in expected]}"
                )

    def start_mini_batch(self) -> None:
        self._end_mini_batch()
        self.mini_batch += 1
        self.micro_batch = 0

    def observe(self, micro_batch: TensorDict) -> None:
        """An update micro-batch about to run: in the first epoch it must be the recorded one."""
        if self.mini_batch < 0:
            raise self._mismatch(
                "an update micro-batch ran before any of the update's mini-batches started (verl's train_mini_batch "
                "did not pass its mini-batches through TrainingWorker.train_batch), so the update cannot be compared"
            )
        if self.mini_batch >= self.first_epoch:
            return  # later epochs are off-policy by definition; nothing was packed for them
        expected = self.record.mini_batches[self.mini_batch]
        if expected is None:  # old_log_prob_from_update: this mini-batch's pi_old is its own forward, any packing
            self.micro_batch += 1
            return
        found = PackedMicroBatch.of(micro_batch)
        if self.micro_batch >= len(expected) or found != expected[self.micro_batch]:
            recorded = expected[self.micro_batch].describe() if self.micro_batch < len(expected) else "nothing"
            raise self._mismatch(
                f"update mini-batch {self.mini_batch}, micro-batch {self.micro_batch} holds {found.describe()}, where "
                f"the old-log-prob pass packed {recorded}"
            )
        self.micro_batch += 1

    def finish(self) -> None:
        """The update call returned: its last mini-batch is complete, and every recorded one ran."""
        self._end_mini_batch()
        if self.mini_batch + 1 < self.first_epoch:
            raise self._mismatch(
                f"the update ran {self.mini_batch + 1} of its first epoch's {self.first_epoch} mini-batch(es) through "
                "TrainingWorker.train_batch, so the others were not compared"
            )


def update_mini_batches_per_epoch(worker: Any, data: TensorDict) -> int:
    """How many mini-batches ``TrainingWorker.train_mini_batch`` makes of ``data`` per epoch (its own rule:
    ``mini_batch_size`` over the data-parallel size, or ``num_mini_batch``)."""
    from verl.utils import tensordict_utils as tu

    mini_batch_size = tu.get_non_tensor_data(data=data, key="mini_batch_size", default=None)
    if mini_batch_size is None:
        return int(tu.get_non_tensor_data(data=data, key="num_mini_batch", default=1))
    per_gpu = int(mini_batch_size) // worker.engine.get_data_parallel_size()
    return len(data) // per_gpu if per_gpu > 0 else 0


def observing_update(worker: Any, data: TensorDict, pack_old_log_prob_as_update: bool) -> Optional[UpdateObserver]:
    """Before an update call: take the engine's record (each serves one update) and, with the packing on, start
    comparing (the rows get :data:`ROW_KEY`); None when nothing is compared."""
    from verl.utils import tensordict_utils as tu

    engine = worker.engine
    record: Optional[PackingRecord] = getattr(engine, _RECORD_ATTR, None)
    setattr(engine, _RECORD_ATTR, None)
    if not pack_old_log_prob_as_update:
        return None
    if record is None:
        if tu.get_non_tensor_data(data=data, key=UPDATE_FOLLOWS_OLD_PASS_KEY, default=False):
            raise PackingMismatchError(
                "actor_rollout_ref.actor.policy_loss.pack_old_log_prob_as_update=true and the trainer ran this batch's "
                "old-log-prob pass, but this rank's engine holds no record of it: the pass did not reach the seam's "
                "infer_batch with the update's packing (divclip_update_packing), so the update cannot be checked"
            )
        return None
    observer = UpdateObserver(record, update_mini_batches_per_epoch(worker, data))
    observer.start(row_fingerprints(data))
    data[ROW_KEY] = torch.arange(len(data))
    return observer


def update_mini_batch_index(engine: Any) -> int:
    """The index of the update mini-batch now running on ``engine`` (-1: none observed)."""
    observer: Optional[UpdateObserver] = getattr(engine, _OBSERVER_ATTR, None)
    return -1 if observer is None else observer.mini_batch


def observed_packing(engine: Any, micro_batch: TensorDict, forward_only: bool) -> bool:
    """One forward step of ``engine``: record it (old pass) or compare it (update); whether the step's update
    call was found packed as the old pass (``actor/divclip/path/pack_old_log_prob_as_update``)."""
    if forward_only:
        recording = getattr(engine, _RECORDING_ATTR, None)  # set in an old-log-prob pass run by infer_as_update
        if recording is not None and ROW_KEY in micro_batch.keys():
            recording.append(PackedMicroBatch.of(micro_batch))
        return False
    observer: Optional[UpdateObserver] = getattr(engine, _OBSERVER_ATTR, None)
    if observer is None:
        return False
    observer.observe(micro_batch)
    return True


def is_on_policy(data: TensorDict) -> bool:
    """Whether this (micro-)batch belongs to the update's first mini-batch, before any optimizer step."""
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=data, key=ON_POLICY_KEY, default=False))


def marking_on_policy(
    train_mini_batch: Callable[..., Any], worker: Any, data: TensorDict, pack_old_log_prob_as_update: bool
) -> Any:
    """``TrainingWorker.train_mini_batch``, observed (:func:`observing_update`), its first mini-batch marked
    on-policy when the call starts from pi_old (see :func:`marking_first_mini_batch`)."""
    from verl.utils import tensordict_utils as tu

    state = pending_old(worker.engine)
    observer = observing_update(worker, data, pack_old_log_prob_as_update)
    starts_on_policy = bool(tu.get_non_tensor_data(data=data, key=ON_POLICY_KEY, default=True))
    if state is not None:  # old_log_prob_from_update: this update supplies the first mini-batch's pi_old
        check_update_batch(worker.engine, row_fingerprints(data), starts_on_policy and observer is not None)
        state.loss_wants_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
    setattr(worker, _ON_POLICY_ATTR, starts_on_policy)
    setattr(worker.engine, _OBSERVER_ATTR, observer)
    try:
        output = train_mini_batch(worker, data)
        if observer is not None:
            observer.finish()
        finish_update(worker.engine)
        return output
    finally:
        setattr(worker, _ON_POLICY_ATTR, None)
        setattr(worker.engine, _OBSERVER_ATTR, None)


def marking_first_mini_batch(train_batch: Callable[..., Any], worker: Any, data: TensorDict) -> Any:
    """``TrainingWorker.train_batch``: inside a ``train_mini_batch`` call that starts on-policy, the first
    mini-batch carries ``ON_POLICY_KEY = True`` (the others ``False``); a direct call carries nothing."""
    from verl.utils import tensordict_utils as tu

    observer: Optional[UpdateObserver] = getattr(worker.engine, _OBSERVER_ATTR, None)
    if observer is not None:
        observer.start_mini_batch()
    on_policy = getattr(worker, _ON_POLICY_ATTR, None)
    if on_policy is not None:  # inside a train_mini_batch call: only its first mini-batch can be on-policy
        tu.assign_non_tensor(data, **{ON_POLICY_KEY: on_policy})
        setattr(worker, _ON_POLICY_ATTR, False)
    state = pending_old(worker.engine)
    if observer is not None and state is not None and observer.mini_batch == state.mini_batch:
        tu.assign_non_tensor(data, calculate_entropy=True)  # pi_old's entropy (verl's actor/entropy, ERC's H_old)
    return train_batch(worker, data)
