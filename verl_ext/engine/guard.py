"""What the seam relies on in verl (its version, :data:`SYMBOLS`, the engine's attributes, ``infer_batch``'s
result), checked before it is used; a mismatch raises :class:`VerlMismatchError` naming what differs and both
verl versions. verl is imported lazily (only :func:`resolve` does). docs/engine.md ("What is wrapped").
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from verl_ext.core import key_reads

logger = logging.getLogger(__name__)

SUPPORTED_VERL = "0.9.1"
"""The verl release the seam is written against (``pyproject.toml`` pins it)."""

ALLOW_UNSUPPORTED_VERL_ENV = "DIVCLIP_ALLOW_UNSUPPORTED_VERL"
"""Set to ``1`` to install the seam into a verl release other than :data:`SUPPORTED_VERL` (every other
check still runs; what they cannot see -- changed behaviour under unchanged names -- is the user's risk)."""

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
WORKER_MODULE = "verl.workers.engine_workers"


class VerlMismatchError(RuntimeError):
    """verl does not have a symbol the seam needs, in the form the seam needs it."""


@dataclass(frozen=True)
class Symbol:
    """A verl attribute the seam depends on (``path`` may be dotted: ``Class.method``). ``params``: the leading
    parameter names a callable must accept, in order (``None``: only its presence is checked); ``fields``: names
    a dataclass must declare."""

    module: str
    path: str
    params: Optional[tuple[str, ...]] = None
    fields: tuple[str, ...] = ()
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"


SYMBOLS: tuple[Symbol, ...] = (
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.forward_step",
        ("self", "micro_batch", "loss_function", "forward_only"),
        why="wrapped: every forward step of the actor",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.infer_batch",
        ("self", "data", "loss_function"),
        why="wrapped: the old-log-prob pass packed as the update",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.prepare_model_inputs",
        ("self", "micro_batch"),
        why="wrapped per step by the vocabulary pass (its labels and temperatures)",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.prepare_model_outputs",
        ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
        why="replaced per step by the vocabulary pass; extended per step by pi_old's top-k",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead._gather_and_unpad_packed",
        ("self", "tensor", "pad_size"),
        why="called by the vocabulary pass's outputs (Ulysses gather, pad removal)",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.get_data_parallel_size",
        ("self",),
        why="pack_old_log_prob_as_update's split",
    ),
    Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.get_data_parallel_rank",
        ("self",),
        why="pack_old_log_prob_as_update's seed",
    ),
    Symbol(
        ENGINE_MODULE,
        "logprobs_from_logits",
        ("logits", "labels", "inplace_backward"),
        why="dispatched per step (a dispatcher installed once): pi_old's top-k sees the logits; in-place backward "
        "under the fp32 entropy",
    ),
    Symbol(
        "verl.utils.torch_functional",
        "entropy_from_logits",
        ("logits",),
        why="dispatched per step (a dispatcher installed once): the padded path's entropy call site",
    ),
    Symbol(
        "verl.workers.config",
        "FSDPEngineConfig",
        fields=(
            "entropy_checkpointing",
            "entropy_from_logits_with_chunking",
            "entropy_from_logits_chunk_size",
            "use_torch_compile",
            "use_fused_kernels",
            "use_dynamic_bsz",
            "max_token_len_per_gpu",
            "micro_batch_size_per_gpu",
        ),
        why="engine settings the seam reads",
    ),
    Symbol(
        "verl.workers.config",
        "HFModelConfig",
        fields=("use_fused_kernels",),
        why="the vocabulary pass refuses verl's fused kernels",
    ),
    Symbol(
        WORKER_MODULE, "TrainingWorker.set_loss_fn", ("self", "loss_fn"), why="wrapped: marks the engine's features"
    ),
    Symbol(WORKER_MODULE, "TrainingWorker.train_mini_batch", ("self", "data"), why="wrapped: the on-policy flag"),
    Symbol(WORKER_MODULE, "TrainingWorker.train_batch", ("self", "data"), why="wrapped: the on-policy flag"),
    Symbol(
        "verl.utils.tensordict_utils",
        "make_iterator",
        ("tensordict", "mini_batch_size", "epochs", "seed", "dataloader_kwargs"),
        why="the update's mini-batch split, reproduced for the old-log-prob pass",
    ),
    Symbol(
        "verl.utils.tensordict_utils",
        "index_select_tensor_dict",
        ("batch", "indices"),
        why="pack_old_log_prob_as_update",
    ),
    Symbol(
        "verl.workers.utils.padding",
        "response_from_nested",
        ("tensor", "response_mask"),
        why="old_log_prob_from_update: the update's log-probs and entropy as pi_old, in the response layout",
    ),
)
"""Every verl symbol the seam replaces, wraps or calls privately (the engine instance's own attributes
are checked per engine: :data:`ENGINE_INSTANCE_ATTRIBUTES`)."""


def verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", "unknown"))


def _mismatch(symbol: Symbol, what: str, version: Optional[str] = None) -> VerlMismatchError:
    return VerlMismatchError(
        f"verl-divclip's engine seam needs {symbol.name} ({symbol.why}), but {what}. Installed verl "
        f"{version or verl_version()}; supported: verl {SUPPORTED_VERL} (pip install 'verl=={SUPPORTED_VERL}')"
    )


def check_verl_version(installed: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse a verl release other than :data:`SUPPORTED_VERL`, unless ``environ`` (default: ``os.environ`` at
    the call) sets :data:`ALLOW_UNSUPPORTED_VERL_ENV` to ``1`` (then warn). The other checks see names, not
    behaviour: a release that changes how verl packs micro-batches would break pack_old_log_prob_as_update's
    bit-identity unseen."""
    installed = installed or verl_version()
    if installed == SUPPORTED_VERL:
        return
    if (os.environ if environ is None else environ).get(ALLOW_UNSUPPORTED_VERL_ENV, "").strip() == "1":
        logger.warning(
            "verl %s is installed; verl-divclip's engine seam is written for verl %s and runs on it because %s=1",
            installed,
            SUPPORTED_VERL,
            ALLOW_UNSUPPORTED_VERL_ENV,
        )
        return
    raise VerlMismatchError(
        f"verl-divclip's engine seam is written for verl {SUPPORTED_VERL}; installed verl {installed} is refused. "
        f"Install the supported release (pip install 'verl=={SUPPORTED_VERL}'), or set {ALLOW_UNSUPPORTED_VERL_ENV}=1 "
        f"in every process that imports verl_ext (the driver and the Ray workers) to run on verl {installed} anyway: "
        "the seam still checks every symbol, attribute and key it relies on, but not verl's behaviour behind them"
    )


def resolve(symbol: Symbol, modules: Optional[Mapping[str, Any]] = None) -> Any:
    """The object ``symbol`` names, from ``modules[symbol.module]`` when given (tests), else the import."""
    owner: Any = (modules or {}).get(symbol.module) or importlib.import_module(symbol.module)
    for part in symbol.path.split("."):
        if not hasattr(owner, part):
            raise _mismatch(
                symbol, f"{type(owner).__name__} {getattr(owner, '__name__', owner)!s} has no attribute {part!r}"
            )
        owner = getattr(owner, part)
    return owner


def check_symbol(symbol: Symbol, modules: Optional[Mapping[str, Any]] = None) -> Any:
    """Resolve ``symbol`` and check its form; returns the object. Raises :class:`VerlMismatchError`."""
    found = resolve(symbol, modules)
    if symbol.params is not None:
        if not callable(found):
            raise _mismatch(symbol, f"it is a {type(found).__name__}, not a function")
        original = getattr(found, "__divclip_original__", found)  # a seam wrapper reports verl's own signature
        names = list(inspect.signature(original).parameters)
        if names[: len(symbol.params)] != list(symbol.params):
            raise _mismatch(symbol, f"its parameters are ({', '.join(names)}), not ({', '.join(symbol.params)}, ...)")
    if symbol.fields:
        declared = {field.name for field in dataclasses.fields(found)} if dataclasses.is_dataclass(found) else set()
        missing = [name for name in symbol.fields if name not in declared]
        if missing:
            raise _mismatch(symbol, f"it declares no field {', '.join(missing)}")
    return found


def check_symbols(modules: Optional[Mapping[str, Any]] = None, symbols: tuple[Symbol, ...] = SYMBOLS) -> None:
    """:func:`check_symbol` on each of ``symbols``; the first mismatch raises."""
    for symbol in symbols:
        check_symbol(symbol, modules)


def check_verl(modules: Optional[Mapping[str, Any]] = None) -> None:
    """Everything ``seam.install`` checks before it wraps anything: the version and :data:`SYMBOLS`
    (``modules``: stand-ins for verl's modules, in tests)."""
    check_verl_version()
    check_symbols(modules)


ENGINE_INSTANCE_ATTRIBUTES: dict[str, str] = {
    "engine_config": "swapped per step by the fp32 entropy (a copy without entropy_checkpointing)",
    "engine_config.entropy_checkpointing": "read: the fp32 entropy turns it off for its step",
    "engine_config.use_torch_compile": "read: the fp32 entropy is compiled where verl's is",
    "engine_config.use_fused_kernels": "read: with verl's fused kernels their entropy serves both passes",
    "engine_config.max_token_len_per_gpu": "read: pack_old_log_prob_as_update's token budget (the update's)",
    "engine_config.micro_batch_size_per_gpu": "read: pack_old_log_prob_as_update's micro-batch size (the update's)",
    "model_config.use_fused_kernels": "read: the vocabulary pass refuses verl's fused kernels",
    "use_ulysses_sp": "read: pi_old's top-k refuses Ulysses sequence parallelism",
    "module": "its LM head's forward swapped per step by the vocabulary pass",
    "compute_entropy_from_logits": "swapped per step by the fp32 entropy",
    "prepare_model_inputs": "swapped per step by the vocabulary pass",
    "prepare_model_outputs": "swapped per step by the vocabulary pass and pi_old's top-k",
}
"""The attributes of an engine *instance* (set in verl's ``__init__``) and of its configs that the seam's
features read or swap: dotted path -> why."""

_ACTOR = "actor_rollout_ref.actor"
_READ_KEYS = {
    "engine_config.entropy_checkpointing": f"{_ACTOR}.fsdp_config.entropy_checkpointing",
    "engine_config.use_torch_compile": f"{_ACTOR}.fsdp_config.use_torch_compile",
    "engine_config.use_fused_kernels": "actor_rollout_ref.model.use_fused_kernels",
    "engine_config.max_token_len_per_gpu": f"{_ACTOR}.ppo_max_token_len_per_gpu",
    "engine_config.micro_batch_size_per_gpu": f"{_ACTOR}.ppo_micro_batch_size_per_gpu",
    "model_config.use_fused_kernels": "actor_rollout_ref.model.use_fused_kernels",
    "use_ulysses_sp": f"{_ACTOR}.fsdp_config.ulysses_sequence_parallel_size",
}
ENGINE_ATTRIBUTE_KEYS: dict[str, tuple[str, ...]] = {
    path: (_READ_KEYS[path],) if path in _READ_KEYS else () for path in ENGINE_INSTANCE_ATTRIBUTES
}
"""The verl config key each row of :data:`ENGINE_INSTANCE_ATTRIBUTES` carries into the actor engine (verl
0.9.1's ``ActorRolloutRefWorker`` builds ``engine_config`` from ``actor.fsdp_config`` and sets its batch sizes
from ``actor.ppo_*`` and its fused kernels from ``model``); ``()`` for what is swapped, not read.
:func:`engine_attribute` records them (:mod:`verl_ext.core.key_reads`) as read by the feature that asked."""


def engine_attribute(engine: Any, path: str) -> Any:
    """``engine``'s attribute at the dotted ``path``, a row of :data:`ENGINE_INSTANCE_ATTRIBUTES`: an attribute
    verl renamed raises, naming it, where ``getattr(..., default)`` would silently turn a feature or refusal off."""
    value = _attribute(engine, path)
    key_reads.record(*ENGINE_ATTRIBUTE_KEYS[path], depth=1)
    return value


def _attribute(engine: Any, path: str) -> Any:
    if path not in ENGINE_INSTANCE_ATTRIBUTES:
        raise KeyError(f"{path!r} is not a row of guard.ENGINE_INSTANCE_ATTRIBUTES: add it (and why the seam reads it)")
    owner, parts = engine, path.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(owner, part):
            where = "the engine instance" if depth == 0 else f"its {'.'.join(parts[:depth])} ({type(owner).__name__})"
            symbol = Symbol(
                type(engine).__module__, f"{type(engine).__qualname__}.{path}", why=ENGINE_INSTANCE_ATTRIBUTES[path]
            )
            raise _mismatch(symbol, f"{where} has no attribute {part!r}")
        owner = getattr(owner, part)
    return owner


def check_engine_instance(engine: Any) -> None:
    """Every row of :data:`ENGINE_INSTANCE_ATTRIBUTES` on ``engine`` (when the seam sets its features)."""
    for path in ENGINE_INSTANCE_ATTRIBUTES:
        _attribute(engine, path)  # a check, not a read of the key: not recorded


INFER_BATCH_OUTPUT_KEYS: dict[str, str] = {
    "model_output": "reassembled per key in the batch's order",
    "loss": "concatenated over the update's mini-batches",
    "metrics": "merged over the update's mini-batches",
}
"""The keys of verl's ``infer_batch`` result that pack_old_log_prob_as_update reassembles (and verl's
``TrainingWorker`` reads back)."""


def check_infer_batch_outputs(outputs: Sequence[Any]) -> None:
    """Each of verl's ``infer_batch`` results (``None``: a rank without outputs) is a dict with every key of
    :data:`INFER_BATCH_OUTPUT_KEYS`; pack_old_log_prob_as_update checks them before it reads one."""
    symbol = Symbol(
        ENGINE_MODULE,
        "FSDPEngineWithLMHead.infer_batch",
        why=f"its result's {', '.join(INFER_BATCH_OUTPUT_KEYS)} reassembled by pack_old_log_prob_as_update",
    )
    for output in outputs:
        if output is None:
            continue
        if not isinstance(output, Mapping):
            raise _mismatch(symbol, f"it returned a {type(output).__name__}, not a dict")
        missing = [key for key in INFER_BATCH_OUTPUT_KEYS if key not in output]
        if missing:
            raise _mismatch(symbol, f"its result has no key {', '.join(map(repr, missing))} (it has {sorted(output)})")
