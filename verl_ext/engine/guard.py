"""What the seam relies on in verl, checked before anything is wrapped, and where the seam reads it.

The seam (:mod:`verl_ext.engine.seam`) reaches into verl 0.9.1's actor engine. In another verl release a
renamed method, a changed signature, a removed config field, a renamed engine attribute or non-tensor
key, or a changed result layout would otherwise turn a feature or a refusal off silently (the fp32
entropy, the aligned packing, the vocabulary pass's refusal of ``calculate_sum_pi_squared``) or fail deep
inside a training step. Each dependency is a row of one table below; a mismatch raises
:class:`VerlMismatchError` with one message naming what differs, the installed verl version and the
supported one.

* :func:`check_verl_version` -- verl is :data:`SUPPORTED_VERL`, unless :data:`ALLOW_UNSUPPORTED_VERL_ENV`
  is ``1`` (at install).
* :data:`SYMBOLS` -- every verl symbol the seam wraps, swaps or calls: it exists, takes the parameters
  the seam passes, declares the config fields the seam reads (at install).
* :data:`KEY_USES` -- the non-tensor keys (and fields of dicts verl passes between its own methods) that
  verl's functions must still read or write for a feature to hold, found in their source (at install).
* :data:`MODEL_OUTPUT_KEYS` -- every key verl's ``prepare_model_outputs`` writes is produced or refused
  by the vocabulary pass, which replaces it wholesale (in its source, at install).
* :data:`ENGINE_INSTANCE_ATTRIBUTES` -- the engine instance's attributes (and its configs') that the
  features read or swap (when the seam sets an engine's features; the features read them through
  :func:`engine_attribute`, never with a silent default).
* :data:`INFER_BATCH_OUTPUT_KEYS` -- the layout of verl's ``infer_batch`` result that the aligned packing
  reassembles (:func:`check_infer_batch_outputs`, at each call, before the first key is read).

:func:`check_verl` runs the install-time checks; ``seam.install`` calls it first, so a mismatch stops the
worker before its first step. Tests run each check against deliberately altered copies of verl's classes
(``tests/test_engine_seam.py``).

Imports verl's modules lazily (only :func:`resolve` does), so the tables are cheap to import.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import logging
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

SUPPORTED_VERL = "0.9.1"
"""The verl release the seam is written against (``pyproject.toml`` pins it)."""

ALLOW_UNSUPPORTED_VERL_ENV = "DIVCLIP_ALLOW_UNSUPPORTED_VERL"
"""Set to ``1`` to install the seam into a verl release other than :data:`SUPPORTED_VERL` (every other
check still runs; what they cannot see -- changed behaviour under unchanged names -- is the user's risk)."""

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
WORKER_MODULE = "verl.workers.engine_workers"
ENGINE_UTILS_MODULE = "verl.workers.engine.utils"


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
                   "use_torch_compile", "use_fused_kernels", "use_dynamic_bsz", "max_token_len_per_gpu",
                   "micro_batch_size_per_gpu"),
           why="engine settings the seam reads"),
    Symbol("verl.workers.config", "HFModelConfig", fields=("use_fused_kernels",),
           why="the vocabulary pass refuses verl's fused kernels"),
    Symbol(WORKER_MODULE, "TrainingWorker.set_loss_fn", ("self", "loss_fn"), why="wrapped: marks the engine's features"),
    Symbol(WORKER_MODULE, "TrainingWorker.train_mini_batch", ("self", "data"), why="wrapped: the on-policy mark"),
    Symbol(WORKER_MODULE, "TrainingWorker.train_batch", ("self", "data"), why="wrapped: the on-policy mark"),
    Symbol("verl.utils.tensordict_utils", "make_iterator", ("tensordict", "mini_batch_size", "epochs", "seed", "dataloader_kwargs"),
           why="the update's mini-batch split, reproduced for the old-log-prob pass"),
    Symbol("verl.utils.tensordict_utils", "index_select_tensor_dict", ("batch", "indices"), why="the aligned packing"),
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
    """Refuse a verl release other than :data:`SUPPORTED_VERL`, unless ``environ`` (default: the process's
    environment as it is at the call) sets :data:`ALLOW_UNSUPPORTED_VERL_ENV` to ``1`` (then log a warning and
    go on).

    Why refuse although every name is checked: the other checks see names, signatures and layouts, not
    behaviour -- a release that keeps them all and changes, say, how verl packs micro-batches would break
    the aligned packing's bit-identity without any of them noticing."""
    installed = installed or verl_version()
    if installed == SUPPORTED_VERL:
        return
    if (os.environ if environ is None else environ).get(ALLOW_UNSUPPORTED_VERL_ENV, "").strip() == "1":
        logger.warning(
            "verl %s is installed; verl-divclip's engine seam is written for verl %s and runs on it because %s=1",
            installed, SUPPORTED_VERL, ALLOW_UNSUPPORTED_VERL_ENV,
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


# ------------------------------------------------------------------------------------------------
# Keys verl's functions read and write, found in their source
# ------------------------------------------------------------------------------------------------

Access = Literal["reads", "writes"]


@dataclass(frozen=True)
class KeyUse:
    """A key that verl's ``function`` must read or write for a feature of the seam to hold: a non-tensor
    key of a batch, or a field of a dict verl passes between its own methods (``container``: the dict's
    name in verl's source; ``None``: any). ``value``: for a write the seam relies on, the expression verl
    must assign (its source text)."""

    module: str
    function: str
    key: str
    access: Access
    why: str
    container: Optional[str] = None
    value: Optional[str] = None

    @property
    def symbol(self) -> Symbol:
        where = f" of {self.container}" if self.container else ""
        return Symbol(self.module, self.function, why=f"which {self.access} the key {self.key!r}{where}: {self.why}")


_MICRO_BATCHES = (ENGINE_UTILS_MODULE, "prepare_micro_batches")
_TRAIN_BATCH = (WORKER_MODULE, "TrainingWorker.train_batch")
_INFER_BATCH = (WORKER_MODULE, "TrainingWorker.infer_batch")
_TRAIN_MINI_BATCH = (WORKER_MODULE, "TrainingWorker.train_mini_batch")
_SPLIT = "the update's check of its packing counts the first epoch's mini-batches by verl's own rule"
_INPUTS = (ENGINE_MODULE, "FSDPEngineWithLMHead.prepare_model_inputs")
_OUTPUTS = (ENGINE_MODULE, "FSDPEngineWithLMHead.prepare_model_outputs")
_PACKING = "the aligned packing sets it on the old-log-prob pass's batch to the update's setting"
_REFUSAL = "the vocabulary pass refuses a step that sets it, reading the same key"

KEY_USES: tuple[KeyUse, ...] = (
    KeyUse(*_MICRO_BATCHES, "use_dynamic_bsz", "reads", "it picks which of the two micro-batch settings splits a batch"),
    KeyUse(*_MICRO_BATCHES, "max_token_len_per_gpu", "reads", _PACKING),
    KeyUse(*_MICRO_BATCHES, "micro_batch_size_per_gpu", "reads", _PACKING),
    KeyUse(*_TRAIN_BATCH, "max_token_len_per_gpu", "writes", "the update's token budget, which the aligned packing copies",
           value="self.engine_config.max_token_len_per_gpu"),
    KeyUse(*_TRAIN_BATCH, "micro_batch_size_per_gpu", "writes", "the update's micro-batch size, which the aligned packing copies",
           value="self.engine_config.micro_batch_size_per_gpu"),
    KeyUse(*_TRAIN_BATCH, "use_dynamic_bsz", "writes", "the aligned packing splits both passes the same way",
           value="self.engine_config.use_dynamic_bsz"),
    KeyUse(*_TRAIN_MINI_BATCH, "mini_batch_size", "reads", _SPLIT),
    KeyUse(*_TRAIN_MINI_BATCH, "num_mini_batch", "reads", _SPLIT),
    KeyUse(*_INFER_BATCH, "use_dynamic_bsz", "writes", "the aligned packing splits both passes the same way",
           value="self.engine_config.use_dynamic_bsz"),
    KeyUse(*_INFER_BATCH, "compute_loss", "reads",
           "the old-log-prob pass runs without a loss function, which is how a step knows to capture pi_old's top-k"),
    KeyUse(*_INPUTS, "temperature", "reads", "the per-token temperatures the vocabulary pass divides by"),
    KeyUse(*_INPUTS, "input_ids_rmpad_rolled", "writes", "the vocabulary pass's labels", container="output_args"),
    KeyUse(*_INPUTS, "temperature_rmpad", "writes", "the vocabulary pass's temperatures (remove-padding path)",
           container="output_args"),
    KeyUse(*_INPUTS, "temperature", "writes", "the vocabulary pass's temperatures (padded path)", container="output_args"),
    KeyUse(*_INPUTS, "pad_size", "writes", "the vocabulary pass's Ulysses gather and pad removal", container="output_args"),
    KeyUse(*_OUTPUTS, "calculate_entropy", "reads", "the vocabulary pass, replacing it, emits the entropy on the same key"),
    KeyUse(*_OUTPUTS, "distillation_only", "reads", _REFUSAL),
    KeyUse(*_OUTPUTS, "distillation_use_topk", "reads", _REFUSAL),
    KeyUse(*_OUTPUTS, "calculate_sum_pi_squared", "reads", _REFUSAL),
    KeyUse(*_OUTPUTS, "use_fused_kernels", "reads", _REFUSAL),
)
"""Each (verl function, key, why) the seam relies on, checked in the function's source at install."""


@dataclass
class _KeyAccesses:
    """What one function's source reads and writes: ``(container, key)`` pairs; writes map to the value's source."""

    reads: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    writes: dict[tuple[str, str], Optional[str]] = dataclasses.field(default_factory=dict)

    def has(self, access: Access, key: str, container: Optional[str]) -> bool:
        found = self.reads if access == "reads" else self.writes
        return any(k == key and container in (None, c) for c, k in found)

    def value(self, key: str, container: Optional[str]) -> list[Optional[str]]:
        return [v for (c, k), v in self.writes.items() if k == key and container in (None, c)]


def _source_tree(symbol: Symbol, modules: Optional[Mapping[str, Any]]) -> ast.AST:
    found = resolve(symbol, modules)
    function = inspect.unwrap(getattr(found, "__divclip_original__", found))  # verl's own, under a seam wrapper
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError) as error:
        raise _mismatch(symbol, f"its source cannot be read ({error}), so the keys the seam relies on cannot be checked") from None


def _string(node: Optional[ast.AST]) -> Optional[str]:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _subscript_keys(node: ast.Subscript, parents: Mapping[ast.AST, ast.AST]) -> set[str]:
    """The keys a subscript ``d[...]`` names: a literal; a loop variable over literal names (each of them);
    any other expression ``e`` as ``"*e"`` (a key only known at run time), ``e`` being the loop's iterable
    when it is a loop variable."""
    literal = _string(node.slice)
    if literal is not None:
        return {literal}
    if isinstance(node.slice, ast.Name):
        scope = parents.get(node)
        while scope is not None:
            if isinstance(scope, ast.For) and node.slice.id in {n.id for n in ast.walk(scope.target) if isinstance(n, ast.Name)}:
                elements = scope.iter.elts if isinstance(scope.iter, (ast.Tuple, ast.List, ast.Set)) else []
                names = {name for element in elements if (name := _string(element)) is not None}
                return names if elements and len(names) == len(elements) else {f"*{ast.unparse(scope.iter)}"}
            scope = parents.get(scope)
    return {f"*{ast.unparse(node.slice)}"}


def _key_accesses(tree: ast.AST) -> _KeyAccesses:
    """Keys read: ``key="k"`` arguments, literal arguments of ``.get``/``.pop``/``get_non_tensor_data``,
    ``d["k"]`` loads, ``"k" in d``. Keys written: keyword arguments of ``assign_non_tensor`` and ``dict``,
    ``d["k"] = v`` stores, literal keys of ``d = {...}`` and ``d.update(...)`` (unknown ones as ``"*e"``)."""
    found = _KeyAccesses()
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            data = next((kw.value for kw in node.keywords if kw.arg == "data"), node.args[0] if node.args else None)
            container = ast.unparse(data) if data is not None else ""
            found.reads.update((container, key) for kw in node.keywords if kw.arg == "key" and (key := _string(kw.value)))
            if name in ("get", "pop", "get_non_tensor_data"):
                owner = ast.unparse(node.func.value) if isinstance(node.func, ast.Attribute) else ""
                found.reads.update((owner, key) for arg in node.args if (key := _string(arg)))
            if name in ("assign_non_tensor", "dict"):
                found.writes.update({(container, kw.arg): ast.unparse(kw.value) for kw in node.keywords if kw.arg})
            if name == "update" and isinstance(node.func, ast.Attribute):
                target = ast.unparse(node.func.value)
                for arg in node.args:
                    keys = [_string(k) for k in arg.keys] if isinstance(arg, ast.Dict) else [None]
                    found.writes.update({(target, k if k is not None else f"*{ast.unparse(arg)}"): None for k in keys})
        elif isinstance(node, ast.Subscript):
            target = ast.unparse(node.value)
            for key in _subscript_keys(node, parents):
                if isinstance(node.ctx, ast.Store):
                    assigned = parents.get(node)
                    found.writes[(target, key)] = ast.unparse(assigned.value) if isinstance(assigned, ast.Assign) else None
                else:
                    found.reads.add((target, key))
        elif isinstance(node, ast.Compare) and (key := _string(node.left)) and isinstance(node.ops[0], ast.In):
            found.reads.add((ast.unparse(node.comparators[0]), key))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                found.writes.update({(ast.unparse(target), _string(k) or f"*{ast.unparse(k)}"): None
                                     for k in node.value.keys if k is not None})
    return found


def check_key_uses(modules: Optional[Mapping[str, Any]] = None, uses: Sequence[KeyUse] = KEY_USES) -> None:
    """Check that each verl function of ``uses`` still reads or writes its key (and, where given, assigns the
    expected value), in its source; the first mismatch raises :class:`VerlMismatchError`."""
    accesses: dict[tuple[str, str], _KeyAccesses] = {}
    for use in uses:
        where = (use.module, use.function)
        if where not in accesses:
            accesses[where] = _key_accesses(_source_tree(Symbol(*where), modules))
        found = accesses[where]
        if not found.has(use.access, use.key, use.container):
            raise _mismatch(use.symbol, f"its source no longer {use.access} {use.key!r}")
        if use.value is not None and use.value not in found.value(use.key, use.container):
            raise _mismatch(use.symbol, f"its source sets {use.key!r} to {' / '.join(map(str, found.value(use.key, use.container)))}, "
                                        f"not {use.value}")


# ------------------------------------------------------------------------------------------------
# The keys of verl's model output, which the vocabulary pass replaces
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelOutputKey:
    """A key verl's ``prepare_model_outputs`` writes into its ``model_output``: ``produced`` by the
    vocabulary pass too, or never reached with it (the recipe refuses what makes verl write it)."""

    key: str
    produced: bool
    why: str


_DISTILLATION = ("top-k distillation: refused with the vocabulary pass (distillation_use_topk / use_fused_kernels at "
                 "the step: vocab_pass_step; before Ray, recipe/config_checks.py: distillation.enabled for every run, "
                 "validate_verl_features; use_fused_kernels with the pass, validate_vocab_pass)")

MODEL_OUTPUT_KEYS: tuple[ModelOutputKey, ...] = (
    ModelOutputKey("log_probs", True, "the pass's log pi(y_t), nested like verl's"),
    ModelOutputKey("entropy", True, "the pass's entropy, nested like verl's, when calculate_entropy"),
    ModelOutputKey("sum_pi_squared", False,
                   "needs the logits: calculate_sum_pi_squared is refused with the vocabulary pass (at the step: "
                   "vocab_pass_step; before Ray for every run: recipe/config_checks.py validate_verl_features)"),
    ModelOutputKey("distillation_losses", False, f"fused-kernel {_DISTILLATION}"),
    ModelOutputKey("student_mass", False, f"fused-kernel {_DISTILLATION}"),
    ModelOutputKey("teacher_mass", False, f"fused-kernel {_DISTILLATION}"),
    ModelOutputKey("*outputs.items()", False, f"the fields of the loss's logits processor under {_DISTILLATION}"),
)
"""Every key verl's ``prepare_model_outputs`` writes, and why the vocabulary pass, which replaces it for a
step, loses none ("*e": the keys of a loop over ``e``, known only at run time)."""

_PREPARE_OUTPUTS = Symbol(*_OUTPUTS, why="replaced per step by the vocabulary pass, which must produce or refuse each key it writes")


def model_output_keys(modules: Optional[Mapping[str, Any]] = None) -> set[str]:
    """The keys verl's ``prepare_model_outputs`` writes into its ``model_output`` dict (its source)."""
    writes = _key_accesses(_source_tree(_PREPARE_OUTPUTS, modules)).writes
    return {key for container, key in writes if container == "model_output"}


def check_model_output_keys(modules: Optional[Mapping[str, Any]] = None,
                            table: Sequence[ModelOutputKey] = MODEL_OUTPUT_KEYS) -> None:
    """verl's ``prepare_model_outputs`` writes only keys of ``table``, and every key the vocabulary pass
    produces; otherwise the pass would drop a key verl's consumers read, or emit one they no longer do."""
    written = model_output_keys(modules)
    unknown = sorted(written - {row.key for row in table})
    if unknown:
        raise _mismatch(_PREPARE_OUTPUTS, f"its model_output gains {', '.join(map(repr, unknown))}, which the vocabulary "
                                          "pass neither produces nor refuses (verl_ext.engine.guard.MODEL_OUTPUT_KEYS)")
    gone = [row.key for row in table if row.produced and row.key not in written]
    if gone:
        raise _mismatch(_PREPARE_OUTPUTS, f"its model_output no longer has {', '.join(map(repr, gone))}, which the "
                                          "vocabulary pass produces in its place")


def check_verl(modules: Optional[Mapping[str, Any]] = None) -> None:
    """Everything ``seam.install`` checks before it wraps anything: the version, :data:`SYMBOLS`,
    :data:`KEY_USES`, :data:`MODEL_OUTPUT_KEYS` (``modules``: stand-ins for verl's modules, in tests)."""
    check_verl_version()
    check_symbols(modules)
    check_key_uses(modules)
    check_model_output_keys(modules)


# ------------------------------------------------------------------------------------------------
# The engine instance, and the results the seam consumes
# ------------------------------------------------------------------------------------------------

ENGINE_INSTANCE_ATTRIBUTES: dict[str, str] = {
    "engine_config": "swapped per step by the fp32 entropy (a copy without entropy_checkpointing)",
    "engine_config.entropy_checkpointing": "read: the fp32 entropy turns it off for its step",
    "engine_config.use_torch_compile": "read: the fp32 entropy is compiled where verl's is",
    "engine_config.use_fused_kernels": "read: with verl's fused kernels their entropy serves both passes",
    "engine_config.max_token_len_per_gpu": "read: the aligned packing's token budget (the update's)",
    "engine_config.micro_batch_size_per_gpu": "read: the aligned packing's micro-batch size (the update's)",
    "model_config.use_fused_kernels": "read: the vocabulary pass refuses verl's fused kernels",
    "use_ulysses_sp": "read: pi_old's top-k refuses Ulysses sequence parallelism",
    "module": "its LM head's forward swapped per step by the vocabulary pass",
    "compute_entropy_from_logits": "swapped per step by the fp32 entropy",
    "prepare_model_inputs": "swapped per step by the vocabulary pass",
    "prepare_model_outputs": "swapped per step by the vocabulary pass and pi_old's top-k",
}
"""The attributes of an engine *instance* (set in verl's ``__init__``) and of its configs that the seam's
features read or swap: dotted path -> why."""


def engine_attribute(engine: Any, path: str) -> Any:
    """``engine``'s attribute at the dotted ``path``, a row of :data:`ENGINE_INSTANCE_ATTRIBUTES`. The
    features read the engine through this, not ``getattr(..., default)``: an attribute verl renamed raises,
    naming it, instead of reading as the default and turning a feature or a refusal off."""
    if path not in ENGINE_INSTANCE_ATTRIBUTES:
        raise KeyError(f"{path!r} is not a row of guard.ENGINE_INSTANCE_ATTRIBUTES: add it (and why the seam reads it)")
    owner, parts = engine, path.split(".")
    for depth, part in enumerate(parts):
        if not hasattr(owner, part):
            where = "the engine instance" if depth == 0 else f"its {'.'.join(parts[:depth])} ({type(owner).__name__})"
            symbol = Symbol(type(engine).__module__, f"{type(engine).__qualname__}.{path}", why=ENGINE_INSTANCE_ATTRIBUTES[path])
            raise _mismatch(symbol, f"{where} has no attribute {part!r}")
        owner = getattr(owner, part)
    return owner


def check_engine_instance(engine: Any) -> None:
    """Every row of :data:`ENGINE_INSTANCE_ATTRIBUTES` on ``engine`` (when the seam sets its features)."""
    for path in ENGINE_INSTANCE_ATTRIBUTES:
        engine_attribute(engine, path)


INFER_BATCH_OUTPUT_KEYS: dict[str, str] = {
    "model_output": "reassembled per key in the batch's order",
    "loss": "concatenated over the update's mini-batches",
    "metrics": "merged over the update's mini-batches",
}
"""The keys of verl's ``infer_batch`` result that the aligned packing reassembles (and verl's
``TrainingWorker`` reads back)."""


def check_infer_batch_outputs(outputs: Sequence[Any]) -> None:
    """Each of verl's ``infer_batch`` results (``None``: a rank without outputs) is a dict with every key of
    :data:`INFER_BATCH_OUTPUT_KEYS`; the aligned packing checks them before it reads one."""
    symbol = Symbol(ENGINE_MODULE, "FSDPEngineWithLMHead.infer_batch",
                    why=f"its result's {', '.join(INFER_BATCH_OUTPUT_KEYS)} reassembled by the aligned packing")
    for output in outputs:
        if output is None:
            continue
        if not isinstance(output, Mapping):
            raise _mismatch(symbol, f"it returned a {type(output).__name__}, not a dict")
        missing = [key for key in INFER_BATCH_OUTPUT_KEYS if key not in output]
        if missing:
            raise _mismatch(symbol, f"its result has no key {', '.join(map(repr, missing))} (it has {sorted(output)})")
