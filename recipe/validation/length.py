"""In-training validation at its own response length and sample count, per benchmark.

verl 0.9.1 validates every set at one ``rollout.response_length`` and ``val_kwargs.n`` (verl-project/verl#2997), the
papers do not (ERC §4.1: 32 samples of 32k while training at 16k). Reads ``rollout.custom.validation``, refuses before
Ray what it cannot serve, and gives each validation row ``__rollout_n__``, ``agent_name`` and its length, without
patching verl (docs/evaluation.md).
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from verl_ext.config_rules.policy import ROLLOUT

logger = logging.getLogger(__name__)

VALIDATION_KEY = f"{ROLLOUT}.custom.validation"
#: The agent loop validation rows run (registered by :mod:`recipe.validation.rollout`).
VALIDATION_AGENT_LOOP = "divclip_validation_single_turn"
#: Per-row validation length, read (and dropped) by the validation agent loop.
LENGTH_COLUMN = "__divclip_val_response_length__"
#: verl's per-row sample count (``PPOTrainer._validate``, ``AgentLoopWorkerTQ._run_prompt``).
ROLLOUT_N_COLUMN = "__rollout_n__"
#: Servers whose ``generate`` honours a request's ``max_tokens`` above ``rollout.response_length``.
SUPPORTED_ROLLOUTS = ("vllm", "sglang", "hf_cpu")
#: SGLang keeps one position free: its server allows ``max_model_len - len(prompt) - 1`` new tokens.
CONTEXT_RESERVE = {"sglang": 1}
_ENTRY_KEYS = ("response_length", "n")


class ValidationLengthError(ValueError):
    """A validation-length setting that cannot be served; the message names the key."""


@dataclass(frozen=True)
class BenchmarkValidation:
    """How one validation set is sampled: ``n`` responses of at most ``response_length`` tokens."""

    response_length: int
    n: int


@dataclass(frozen=True)
class ValidationPlan:
    """The resolved per-benchmark validation settings (``None`` from :meth:`from_config` when the
    config sets none, so verl's own validation runs untouched)."""

    default: BenchmarkValidation
    benchmarks: dict[str, BenchmarkValidation] = field(default_factory=dict)

    def settings(self, data_source: str) -> BenchmarkValidation:
        return self.benchmarks.get(str(data_source), self.default)

    @property
    def max_response_length(self) -> int:
        return max([self.default.response_length, *(b.response_length for b in self.benchmarks.values())])

    @classmethod
    def from_config(cls, config: Any) -> Optional[ValidationPlan]:
        """Parse ``actor_rollout_ref.rollout.custom.validation`` (raises :class:`ValidationLengthError`)."""
        rollout = config.actor_rollout_ref.rollout
        custom = rollout.get("custom", None)
        section = None if custom is None else custom.get("validation", None)
        if section is None:
            return None
        unknown = sorted(set(section.keys()) - {"response_length", "benchmarks"})
        if unknown:
            raise ValidationLengthError(
                f"{VALIDATION_KEY}.{unknown[0]} is not a validation setting (known: response_length, benchmarks)"
            )
        length = _positive(section.get("response_length", None), f"{VALIDATION_KEY}.response_length")
        entries = section.get("benchmarks", None) or {}
        if not isinstance(entries, Mapping):
            raise ValidationLengthError(
                f"{VALIDATION_KEY}.benchmarks must map data_source -> {{response_length, n}}, got {entries!r}"
            )
        base_n = _positive(rollout.val_kwargs.n, f"{ROLLOUT}.val_kwargs.n")
        default = BenchmarkValidation(int(length or rollout.response_length), int(base_n))
        benchmarks: dict[str, BenchmarkValidation] = {}
        for data_source, entry in entries.items():
            key = f"{VALIDATION_KEY}.benchmarks.{data_source}"
            if entry is None:  # an explicit "no entry" (a profile dropping a set it does not validate)
                continue
            if not isinstance(entry, Mapping):
                raise ValidationLengthError(f"{key} must be {{response_length: int, n: int}} or null, got {entry!r}")
            extra = sorted(set(entry.keys()) - set(_ENTRY_KEYS))
            if extra:
                raise ValidationLengthError(f"{key}.{extra[0]} is not a benchmark setting (known: response_length, n)")
            entry_length = _positive(entry.get("response_length", None), f"{key}.response_length")
            entry_n = _positive(entry.get("n", None), f"{key}.n")
            benchmarks[str(data_source)] = BenchmarkValidation(
                int(entry_length or default.response_length), int(entry_n or default.n)
            )
        if length is None and not benchmarks:
            return None
        return cls(default=default, benchmarks=benchmarks)


def _positive(value: Any, key: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValidationLengthError(f"{key} must be a positive integer or null, got {value!r}")
    if value <= 0:
        raise ValidationLengthError(f"{key} must be a positive integer, got {value}")
    return int(value)


# ---------------------------------------------------------------------------------- pre-Ray checks


def check_validation_length(config: Any) -> Optional[ValidationPlan]:
    """The plan, after refusing what it cannot serve (raises :class:`ValidationLengthError`)."""
    plan = ValidationPlan.from_config(config)
    if plan is None:
        return None
    rollout = config.actor_rollout_ref.rollout
    why = f"validation lengths ({VALIDATION_KEY})"
    if not config.trainer.get("use_v1", False):
        raise ValidationLengthError(
            f"{why} need verl's v1 trainer, whose validation keeps responses ragged: set trainer.use_v1=true "
            f"(got {config.trainer.get('use_v1', None)!r})"
        )
    if rollout.multi_turn.get("enable", False):
        raise ValidationLengthError(
            f"{why} run single-turn validation only: {ROLLOUT}.multi_turn.enable=true is not supported"
        )
    agent = rollout.agent
    if agent.get("default_agent_loop", "single_turn_agent") != "single_turn_agent":
        raise ValidationLengthError(
            f"{why} replace verl's single_turn_agent on validation rows: "
            f"{ROLLOUT}.agent.default_agent_loop={agent.default_agent_loop!r} is not supported"
        )
    if agent.get("agent_loop_manager_class", None):
        raise ValidationLengthError(
            f"{why} bring their own agent-loop manager: {ROLLOUT}.agent.agent_loop_manager_class="
            f"{agent.agent_loop_manager_class!r} cannot be combined with them"
        )
    if rollout.name not in SUPPORTED_ROLLOUTS:
        raise ValidationLengthError(
            f"{why} need a server that honours a request's max_tokens ({', '.join(SUPPORTED_ROLLOUTS)}): "
            f"{ROLLOUT}.name={rollout.name!r} is not supported"
        )
    context = _context_length(config)
    reserve = CONTEXT_RESERVE.get(rollout.name, 0)
    prompt = int(rollout.prompt_length)
    for data_source, setting in sorted({"(default)": plan.default, **plan.benchmarks}.items()):
        needed = prompt + setting.response_length + reserve
        if needed > context:
            where = "" if data_source == "(default)" else f".benchmarks.{data_source}"
            key = f"{VALIDATION_KEY}{where}.response_length"
            raise ValidationLengthError(
                f"{ROLLOUT}.max_model_len={context} is smaller than {ROLLOUT}.prompt_length ({prompt}) + "
                f"{key} ({setting.response_length})"
                + (f" + {reserve} (SGLang)" if reserve else "")
                + f" = {needed}: raise max_model_len (up to the model's position limit) or shorten the length"
            )
    _check_benchmarks_in_val_files(config, plan)
    return plan


def _context_length(config: Any) -> int:
    """``rollout.max_model_len``, or, when null, the model's ``max_position_embeddings`` (what the
    servers use); a model config that cannot be read here is an error asking for the key."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.get("max_model_len", None) is not None:
        return int(rollout.max_model_len)
    model = config.actor_rollout_ref.model
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            model.path, trust_remote_code=bool(model.get("trust_remote_code", False)), local_files_only=True
        )
        limit = getattr(hf_config, "max_position_embeddings", None)
        if limit is None:
            limit = getattr(getattr(hf_config, "text_config", None), "max_position_embeddings", None)
        if limit is None:
            raise ValueError("no max_position_embeddings in its config")
        return int(limit)
    except Exception as error:
        raise ValidationLengthError(
            f"{ROLLOUT}.max_model_len is null and the context length of actor_rollout_ref.model.path="
            f"{model.path!r} cannot be read here ({error}): set {ROLLOUT}.max_model_len so that prompt + "
            f"validation length ({VALIDATION_KEY}) can be checked"
        ) from error


def _val_files(config: Any) -> list[str]:
    files = config.data.get("val_files", None)
    if files is None:
        return []
    return [str(files)] if isinstance(files, str) else [str(f) for f in files]


def validation_data_sources(path: str) -> set[str]:
    """The ``data_source`` values of one parquet validation file (``unknown`` without the column,
    as verl's ``_validate`` labels such rows); a file with an ``agent_name`` column is refused."""
    import pyarrow.parquet as pq

    columns = pq.read_schema(path).names
    if "agent_name" in columns:
        raise ValidationLengthError(
            f"data.val_files: {path} has an agent_name column (a multi-turn / custom agent dataset); "
            f"validation lengths ({VALIDATION_KEY}) run verl's single-turn loop only"
        )
    if "data_source" not in columns:
        return {"unknown"}
    table = pq.read_table(path, columns=["data_source"])
    return {str(v) for v in set(table.column("data_source").to_pylist())}


def _check_benchmarks_in_val_files(config: Any, plan: ValidationPlan) -> None:
    """Every benchmark in the map is a ``data_source`` of some validation file. Files that cannot be
    read here (not written yet at a dry run, remote ``hdfs://`` paths) are named in a warning: the
    run itself reads them after Ray starts, where verl fails on a missing one."""
    if not plan.benchmarks:
        return
    sources: set[str] = set()
    unread: list[str] = []
    for path in _val_files(config):
        if "://" in path or not os.path.isfile(path):
            unread.append(path)
            continue
        sources |= validation_data_sources(path)
    if unread:
        logger.warning(
            "%s.benchmarks not checked against %s (not readable here): their data_source values must be %s",
            VALIDATION_KEY,
            unread,
            sorted(plan.benchmarks),
        )
        return
    missing = sorted(set(plan.benchmarks) - sources)
    if missing:
        raise ValidationLengthError(
            f"{VALIDATION_KEY}.benchmarks.{missing[0]}: no validation file holds data_source {missing[0]!r} "
            f"(data.val_files hold {sorted(sources)}); remove the entry or set it to null"
        )


# ------------------------------------------------------------------------- the validation batches


class PerBenchmarkValidationLoader:
    """The validation dataloader, each batch with the plan's per-row columns added.

    ``__rollout_n__`` must be in the batch *before* ``PPOTrainer._validate`` reads it (it counts
    the samples it expects per prompt from it), so the columns are added where batches are made.
    """

    def __init__(self, loader: Any, plan: ValidationPlan) -> None:
        self.loader = loader
        self.plan = plan

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            yield self.annotate(batch)

    def annotate(self, batch: dict[str, Any]) -> dict[str, Any]:
        size = len(batch["raw_prompt"])
        sources = batch.get("data_source", None)
        sources = ["unknown"] * size if sources is None else list(sources)
        settings = [self.plan.settings(source) for source in sources]
        batch[ROLLOUT_N_COLUMN] = np.fromiter((s.n for s in settings), dtype=object, count=size)
        batch[LENGTH_COLUMN] = np.fromiter((s.response_length for s in settings), dtype=object, count=size)
        batch["agent_name"] = np.fromiter((VALIDATION_AGENT_LOOP for _ in settings), dtype=object, count=size)
        return batch


class ValidationLengthProbe:
    """Stands in for the trainer's replay buffer during ``_validate`` and records, for every
    validation response it hands out, its length (TransferQueue's ``response_len`` tag) and its
    ``data_source``; everything else is delegated untouched."""

    def __init__(self, replay_buffer: Any) -> None:
        self._replay_buffer = replay_buffer
        self.lengths: dict[str, list[int]] = defaultdict(list)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._replay_buffer, name)

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> Any:
        batch, metrics = self._replay_buffer.sample(
            global_steps=global_steps, partition_id=partition_id, batch_size=batch_size
        )
        if partition_id == "val" and len(batch.keys) > 0:
            import transfer_queue as tq

            data = tq.kv_batch_get(keys=batch.keys, partition_id=partition_id, select_fields=["data_source"])
            for source, tag in zip(data.pop("data_source").tolist(), batch.tags, strict=True):
                self.lengths[str(source)].append(int(tag["response_len"]))
        return batch, metrics

    def metrics(self, plan: ValidationPlan) -> dict[str, float]:
        """``val-aux/<data_source>/response_length/{mean,max,min,clip_ratio,limit}``."""
        out: dict[str, float] = {}
        for source, lengths in sorted(self.lengths.items()):
            limit = plan.settings(source).response_length
            values = np.asarray(lengths, dtype=np.float64)
            prefix = f"val-aux/{source}/response_length"
            out[f"{prefix}/mean"] = float(values.mean())
            out[f"{prefix}/max"] = float(values.max())
            out[f"{prefix}/min"] = float(values.min())
            out[f"{prefix}/clip_ratio"] = float((values >= limit).mean())
            out[f"{prefix}/limit"] = float(limit)
        return out


class ValidationLengthTrainerMixin:
    """For a v1 ``PPOTrainer`` subclass: per-benchmark validation from the config's plan.

    With no plan (nothing set under ``actor_rollout_ref.rollout.custom.validation``) both hooks
    call verl's methods and change nothing.
    """

    validation_plan: Optional[ValidationPlan] = None

    def _init_dataloader(self) -> None:
        super()._init_dataloader()  # type: ignore[misc]
        self.validation_plan = ValidationPlan.from_config(self.config)  # type: ignore[attr-defined]
        if self.validation_plan is not None:
            self.val_dataloader = PerBenchmarkValidationLoader(self.val_dataloader, self.validation_plan)

    def _validate(self) -> dict[str, float]:
        if self.validation_plan is None:
            return super()._validate()  # type: ignore[misc]
        buffer = self.replay_buffer  # type: ignore[has-type]
        probe = ValidationLengthProbe(buffer)
        self.replay_buffer = probe
        try:
            metrics = super()._validate()  # type: ignore[misc]
        finally:
            self.replay_buffer = buffer
        metrics.update(probe.metrics(self.validation_plan))
        return metrics


__all__ = [
    "LENGTH_COLUMN",
    "ROLLOUT_N_COLUMN",
    "VALIDATION_AGENT_LOOP",
    "VALIDATION_KEY",
    "BenchmarkValidation",
    "PerBenchmarkValidationLoader",
    "ValidationLengthError",
    "ValidationLengthProbe",
    "ValidationLengthTrainerMixin",
    "ValidationPlan",
    "check_validation_length",
    "validation_data_sources",
]
