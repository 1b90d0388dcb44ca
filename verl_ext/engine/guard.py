"""The verl symbols the seam replaces or calls privately, checked before anything is wrapped.

The seam (:mod:`verl_ext.engine.seam`) reaches into verl 0.9.1's actor engine. A renamed method, a
changed signature or a removed config field in another verl release would otherwise turn a feature off
silently (the fp32 entropy, the aligned packing) or fail deep inside a training step. :data:`SYMBOLS`
lists every such symbol with the parameters the seam relies on; :func:`check_symbols` resolves each one
and raises :class:`VerlMismatchError` with one message naming the symbol, what differs, the installed
verl version and the supported one. ``install`` runs it first, so a mismatch stops the worker before
its first step. Tests run it against deliberately altered copies of verl's classes
(``tests/test_engine_seam.py``).

Imports verl's modules lazily (only :func:`resolve` does), so the table itself is cheap to import.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

SUPPORTED_VERL = "0.9.1"
"""The verl release the seam is written against (``pyproject.toml`` pins it)."""

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
WORKER_MODULE = "verl.workers.engine_workers"


class VerlMismatchError(RuntimeError):
    """verl does not have a symbol the seam needs, in the form the seam needs it."""


@dataclass(frozen=True)
class Symbol:
    """A verl attribute the seam depends on.

    ``module`` and ``path`` locate it (``path`` may be dotted: ``Class.method``). ``params``: the leading
    parameter names a callable must accept, in order (``None``: only its presence is checked).
    ``fields``: names a dataclass must declare (config fields the seam reads)."""

    module: str
    path: str
    params: Optional[tuple[str, ...]] = None
    fields: tuple[str, ...] = ()
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.path}"


SYMBOLS: tuple[Symbol, ...] = (
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.forward_step", ("self", "micro_batch", "loss_function", "forward_only"),
           why="wrapped: every forward step of the actor"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.infer_batch", ("self", "data", "loss_function"),
           why="wrapped: the old-log-prob pass packed as the update"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.prepare_model_inputs", ("self", "micro_batch"),
           why="wrapped per step by the vocabulary pass (its labels and temperatures)"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.prepare_model_outputs",
           ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
           why="replaced per step by the vocabulary pass; extended per step by pi_old's top-k"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead._gather_and_unpad_packed", ("self", "tensor", "pad_size"),
           why="called by the vocabulary pass's outputs (Ulysses gather, pad removal)"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.get_data_parallel_size", ("self",), why="the aligned packing's split"),
    Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.get_data_parallel_rank", ("self",), why="the aligned packing's seed"),
    Symbol(ENGINE_MODULE, "logprobs_from_logits", ("logits", "labels", "inplace_backward"),
           why="swapped per step: pi_old's top-k sees the logits; in-place backward under the fp32 entropy"),
    Symbol("verl.utils.torch_functional", "entropy_from_logits", ("logits",),
           why="swapped per step: the padded path's entropy call site"),
    Symbol("verl.workers.config", "FSDPEngineConfig",
           fields=("entropy_checkpointing", "entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size",
                   "use_torch_compile", "max_token_len_per_gpu", "micro_batch_size_per_gpu"),
           why="engine settings the seam reads"),
    Symbol(WORKER_MODULE, "TrainingWorker.set_loss_fn", ("self", "loss_fn"), why="wrapped: marks the engine's features"),
    Symbol(WORKER_MODULE, "TrainingWorker.train_mini_batch", ("self", "data"), why="wrapped: the on-policy mark"),
    Symbol(WORKER_MODULE, "TrainingWorker.train_batch", ("self", "data"), why="wrapped: the on-policy mark"),
    Symbol("verl.utils.tensordict_utils", "make_iterator", ("tensordict", "mini_batch_size", "epochs", "seed", "dataloader_kwargs"),
           why="the update's mini-batch split, reproduced for the old-log-prob pass"),
    Symbol("verl.utils.tensordict_utils", "index_select_tensor_dict", ("batch", "indices"), why="the aligned packing"),
)
"""Every verl symbol the seam replaces, wraps or calls privately (the engine instance's own attributes,
``compute_entropy_from_logits`` and the LM head, are checked per engine: :func:`check_engine_instance`)."""


def verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", "unknown"))


def _mismatch(symbol: Symbol, what: str, version: Optional[str] = None) -> VerlMismatchError:
    return VerlMismatchError(
        f"verl-divclip's engine seam needs {symbol.name} ({symbol.why}), but {what}. Installed verl "
        f"{version or verl_version()}; supported: verl {SUPPORTED_VERL} (pip install 'verl=={SUPPORTED_VERL}')"
    )


def resolve(symbol: Symbol, modules: Optional[Mapping[str, Any]] = None) -> Any:
    """The object ``symbol`` names, from ``modules[symbol.module]`` when given (tests), else the import."""
    owner: Any = (modules or {}).get(symbol.module) or importlib.import_module(symbol.module)
    for part in symbol.path.split("."):
        if not hasattr(owner, part):
            raise _mismatch(symbol, f"{type(owner).__name__} {getattr(owner, '__name__', owner)!s} has no attribute {part!r}")
        owner = getattr(owner, part)
    return owner


def _parameter_names(function: Callable[..., Any]) -> list[str]:
    original = getattr(function, "__divclip_original__", function)  # a seam wrapper reports verl's own signature
    return list(inspect.signature(original).parameters)


def check_symbol(symbol: Symbol, modules: Optional[Mapping[str, Any]] = None) -> Any:
    """Resolve ``symbol`` and check its form; returns the object. Raises :class:`VerlMismatchError`."""
    found = resolve(symbol, modules)
    if symbol.params is not None:
        if not callable(found):
            raise _mismatch(symbol, f"it is a {type(found).__name__}, not a function")
        names = _parameter_names(found)
        if names[: len(symbol.params)] != list(symbol.params):
            raise _mismatch(symbol, f"its parameters are ({', '.join(names)}), not ({', '.join(symbol.params)}, ...)")
    if symbol.fields:
        declared = {field.name for field in dataclasses.fields(found)} if dataclasses.is_dataclass(found) else set()
        missing = [name for name in symbol.fields if name not in declared]
        if missing:
            raise _mismatch(symbol, f"it declares no field {', '.join(missing)}")
    return found


def check_symbols(modules: Optional[Mapping[str, Any]] = None, symbols: tuple[Symbol, ...] = SYMBOLS) -> None:
    """Check every symbol of :data:`SYMBOLS` (see :func:`check_symbol`); the first mismatch raises."""
    for symbol in symbols:
        check_symbol(symbol, modules)


ENGINE_INSTANCE_ATTRIBUTES = ("engine_config", "module", "compute_entropy_from_logits", "prepare_model_outputs")


def check_engine_instance(engine: Any) -> None:
    """The attributes the seam swaps on an engine *instance* for one step (set in verl's ``__init__``)."""
    for name in ENGINE_INSTANCE_ATTRIBUTES:
        if not hasattr(engine, name):
            symbol = Symbol(type(engine).__module__, f"{type(engine).__qualname__}.{name}", why="swapped per step on the engine")
            raise _mismatch(symbol, f"the engine instance has no attribute {name!r}")
