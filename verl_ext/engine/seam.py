"""The one seam between verl-divclip and verl 0.9.1's actor engine: :func:`install`, and what it wraps.

Each wrapper runs the engine's features (:func:`set_features`); an engine without any runs verl's code. What each
wrapper does, the order of one forward step and why wrappers rather than an engine subclass: docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from verl_ext.engine.entropy_path import entropy_fn_for, entropy_swaps
from verl_ext.engine.guard import ENGINE_MODULE, WORKER_MODULE, check_engine_instance, check_verl, engine_attribute
from verl_ext.engine.old_from_update import COLLECT_KEY, collect, substituted_topk, substituting_loss, supplies_topk
from verl_ext.engine.old_from_update import pending as pending_old
from verl_ext.engine.packing import (
    ROW_KEY,
    infer_as_update,
    marking_first_mini_batch,
    marking_on_policy,
    observed_packing,
    row_fingerprints,
    update_mini_batch_index,
)
from verl_ext.engine.request import (
    STEP_PATH_KEY,
    SUPPORTED_STRATEGIES,
    EngineRequest,
    EntropyPath,
    describe,
    request_of,
    resolve_entropy_path,
)
from verl_ext.engine.swap import ORIGINAL_ATTR, Swap, install_dispatch, swapped, verl_function
from verl_ext.engine.topk_capture import TopKStep, refuse_ulysses, topk_outputs_swap, topk_step
from verl_ext.engine.vocab_pass_step import refuse_fused_kernels, vocab_pass_swaps

logger = logging.getLogger(__name__)

_FEATURES_ATTR = "_divclip_features"


@dataclass(frozen=True)
class EngineFeatures:
    """What an engine's forward steps do, set from its loss's request (:func:`set_features`)."""

    request: EngineRequest
    entropy_path: EntropyPath
    entropy_fn: Optional[Callable[..., torch.Tensor]]  #: the fp32 entropy of both passes, or None (verl's)

    def step_path(self, pack_old_log_prob_as_update: bool, old_log_prob_from_update: float) -> dict[str, float]:
        """The ``actor/divclip/path/*`` record of a step of this engine (1.0 / 0.0 per feature, but
        ``old_log_prob_from_update``: the share of the step's rows whose pi_old the update supplied)."""
        return {
            "seam": 1.0,
            "entropy_fp32": float(self.request.vocab_pass or self.entropy_path is EntropyPath.DIVCLIP_FP32),
            "vocab_pass": float(self.request.vocab_pass),
            "pack_old_log_prob_as_update": float(pack_old_log_prob_as_update),
            "old_log_prob_from_update": float(old_log_prob_from_update),
        }


def features_of(engine: Any) -> Optional[EngineFeatures]:
    """The engine's features, or None when no loss asked it for any."""
    return getattr(engine, _FEATURES_ATTR, None)


def is_covered(engine: Any) -> bool:
    """Whether the seam hooks ``engine``: an instance of verl's ``FSDPEngineWithLMHead`` whose hooked methods
    are the seam's wrappers (a subclass overriding one would silently bypass it)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if not isinstance(engine, FSDPEngineWithLMHead):
        return False
    return all(hasattr(getattr(type(engine), name), ORIGINAL_ATTR) for name in ("forward_step", "infer_batch"))


def set_features(engine: Any, request: EngineRequest) -> EngineFeatures:
    """Make every forward step of ``engine`` serve ``request`` (both passes); refuses an engine the seam does not
    cover when anything is requested. Called by the wrapped ``set_loss_fn``, and by tests and benchmarks."""
    if request.any:
        if not is_covered(engine):
            raise ValueError(
                f"{', '.join(request.keys())} need(s) verl-divclip's engine seam, which covers verl's "
                f"FSDPEngineWithLMHead (actor_rollout_ref.actor.strategy in {list(SUPPORTED_STRATEGIES)}); this "
                f"worker's engine is {type(engine).__module__}.{type(engine).__qualname__}. Use a supported strategy, "
                "or turn the key(s) off."
            )
        check_engine_instance(engine)
        if request.vocab_pass:
            refuse_fused_kernels(engine)
    # checked by check_engine_instance above whenever the loss asks for anything; with nothing asked the entropy
    # path is verl's whatever the engine (an uncovered one included) says
    use_fused = request.any and bool(engine_attribute(engine, "engine_config.use_fused_kernels"))
    path = resolve_entropy_path(request, use_fused_kernels=use_fused)
    features = EngineFeatures(request, path, entropy_fn_for(engine) if path is EntropyPath.DIVCLIP_FP32 else None)
    previous = features_of(engine)
    if previous is None or previous.request != request or previous.entropy_path != path:
        logger.info("divclip engine: %s", describe(request, path))  # a loss re-installed every step logs once
    setattr(engine, _FEATURES_ATTR, features)
    return features


def set_pack_old_log_prob_as_update(engine: Any, enabled: bool) -> None:
    """Turn pack_old_log_prob_as_update of ``engine`` on or off, keeping its other features: off is verl's own
    packing of the old-log-prob pass (``python -m recipe.bench onpolicy`` measures both arms)."""
    current = features_of(engine)
    request = current.request if current is not None else EngineRequest()
    set_features(engine, dataclasses.replace(request, pack_old_log_prob_as_update=bool(enabled)))


def logprobs_swap(entropy_detached: bool, topk: Optional[TopKStep]) -> Swap:
    """The step's one ``logprobs_from_logits``: the top-k sees the logits, and with a graph-free entropy
    flash-attn's in-place backward is given back (nothing else needs the logits in backward)."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    original = verl_function(impl, "logprobs_from_logits")

    @functools.wraps(original)
    def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
        if topk is not None:
            topk.on_logits(logits)
        return original(logits=logits, labels=labels, inplace_backward=True if entropy_detached else inplace_backward)

    return Swap(impl, "logprobs_from_logits", logprobs_from_logits, "fp32 entropy / pi_old's top-k")


def step_swaps(
    engine: Any, features: EngineFeatures, micro_batch: Any, loss_function: Any, supply_topk: int = 0
) -> list[Swap]:
    """Every swap of one forward step, decided in the documented order (docs/engine.md, "One forward step");
    ``supply_topk``: the step takes pi_old's top-k from its own logits (``old_log_prob_from_update``)."""
    topk = topk_step(micro_batch, loss_function, supply_topk)
    if topk is not None:
        refuse_ulysses(engine)
    if features.request.vocab_pass:
        return vocab_pass_swaps(engine, loss_function, observers=[topk] if topk is not None else [])
    swaps: list[Swap] = []
    if features.entropy_fn is not None:
        swaps += entropy_swaps(engine, features.entropy_fn)
    if features.entropy_fn is not None or topk is not None:
        swaps.append(logprobs_swap(features.entropy_fn is not None, topk))
    if topk is not None:
        swaps.append(topk_outputs_swap(engine, topk))
    return swaps


def _forward_step(
    original: Callable[..., Any], engine: Any, micro_batch: Any, loss_function: Any, forward_only: bool
) -> Any:
    from verl.utils import tensordict_utils as tu

    features = features_of(engine)
    asked = request_of(loss_function)
    if features is None and asked.any:  # an engine driven without TrainingWorker: marked at its first step
        features = set_features(engine, asked)
    if features is None:
        features = EngineFeatures(EngineRequest(), EntropyPath.VERL, None)
    aligned = observed_packing(engine, micro_batch, forward_only)
    loss, supply_topk, from_update = loss_function, 0, 0.0
    state = None if forward_only else pending_old(engine)
    if state is not None:  # old_log_prob_from_update: the update supplies pi_old of the rows the old pass skipped
        first = update_mini_batch_index(engine) == state.mini_batch
        rows = [int(r) for r in micro_batch[ROW_KEY].tolist()]
        from_update = state.skipped_share(rows)
        substituted_topk(engine, rows, micro_batch, first)
        supply_topk = supplies_topk(engine, first)
        loss = substituting_loss(engine, rows, loss_function, first, state.loss_wants_entropy)
    tu.assign_non_tensor(micro_batch, **{STEP_PATH_KEY: features.step_path(aligned, from_update)})
    with swapped(step_swaps(engine, features, micro_batch, loss_function, supply_topk)):
        return original(engine, micro_batch, loss_function=loss, forward_only=forward_only)


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if hasattr(original, ORIGINAL_ATTR):
        return  # already the seam's
    wrapper = functools.wraps(original)(make(original))  # keeps verl's @register dispatch attributes
    setattr(wrapper, ORIGINAL_ATTR, original)
    setattr(owner, name, wrapper)


def _set_loss_fn(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_loss_fn(self: Any, loss_fn: Any) -> Any:
        engine = getattr(self, "engine", None)
        if engine is not None:
            set_features(engine, request_of(loss_fn))  # before verl's: a refused engine keeps its old loss
        return original(self, loss_fn)

    return set_loss_fn


def _train_mini_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_mini_batch(self: Any, data: Any) -> Any:
        features = features_of(self.engine)
        return marking_on_policy(
            original, self, data, features is not None and features.request.pack_old_log_prob_as_update
        )

    return train_mini_batch


def _train_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def train_batch(self: Any, data: Any) -> Any:
        return marking_first_mini_batch(original, self, data)

    return train_batch


def _infer_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def infer_batch(self: Any, data: Any, loss_function: Any = None) -> Any:
        from verl.utils import tensordict_utils as tu

        if tu.get_non_tensor_data(data=data, key=COLLECT_KEY, default=False):  # the values completed by the update
            return collect(self, row_fingerprints(data))
        features = features_of(self)
        if features is None or not features.request.pack_old_log_prob_as_update:
            return original(self, data, loss_function)
        return infer_as_update(self, data, loss_function, original)

    return infer_batch


def _engine_forward_step(original: Callable[..., Any]) -> Callable[..., Any]:
    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        return _forward_step(original, self, micro_batch, loss_function, forward_only)

    return forward_step


def install(modules: Optional[Mapping[str, Any]] = None) -> None:
    """Install the seam into verl (idempotent; inert for engines whose loss asks for nothing): check verl
    (:func:`verl_ext.engine.guard.check_verl`) before wrapping anything, wrap, install the two dispatchers.
    ``modules``: stand-ins for verl's modules by name (tests install into altered copies of verl's classes)."""
    import importlib

    check_verl(modules)
    resolved = {
        name: (modules or {}).get(name) or importlib.import_module(name) for name in (ENGINE_MODULE, WORKER_MODULE)
    }
    engine_class = resolved[ENGINE_MODULE].FSDPEngineWithLMHead
    worker_class = resolved[WORKER_MODULE].TrainingWorker
    # _wrap leaves a symbol that is already the seam's as it is: no bookkeeping by id(), which a class
    # garbage-collected in between (tests' stand-ins) would hand to a new, unwrapped one
    _wrap(worker_class, "set_loss_fn", _set_loss_fn)
    _wrap(worker_class, "train_mini_batch", _train_mini_batch)
    _wrap(worker_class, "train_batch", _train_batch)
    _wrap(engine_class, "infer_batch", _infer_batch)
    _wrap(engine_class, "forward_step", _engine_forward_step)
    # verl calls these by module-global name in every step; the steps' overrides are dispatched per thread
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.fsdp.transformer_impl as impl

    install_dispatch(verl_F, "entropy_from_logits")
    install_dispatch(impl, "logprobs_from_logits")
