"""The vocabulary pass inside verl 0.9.1's actor engine (``FSDPEngineWithLMHead``).

``actor_rollout_ref.actor.policy_loss.vocab_pass=true`` makes every forward step of the actor's
engine -- the old-log-prob pass (``infer_batch``) as well as the update (``train_batch``) --
compute ``log pi(y_t)`` and the entropy with :func:`verl_ext.vocab_pass.vocab_pass` instead of
materialising the ``tokens x vocabulary`` logits. For the duration of one step:

* the LM head module's ``forward`` (``model.get_output_embeddings()``) is replaced, on the instance,
  by one that runs the pass on the hidden states it receives and the weight it holds, returning a
  ``(..., 2)`` float32 tensor ``[log pi(y_t), H_t]`` in place of the logits. The head is still
  *called* by the model, so the module's forward pre/post hooks fire: FSDP2 (``fully_shard`` on
  the untied head; the root's parameters for a tied one) and FSDP1 unshard the weight for the
  call, reshard it after, unshard it again for the backward (the pass's output carries FSDP's
  pre-backward hook) and reduce-scatter its gradient -- unlike verl's ``use_fused_kernels``
  forward, which reads ``lm_head.weight`` outside the head's forward and fails under FSDP2.
* ``prepare_model_inputs`` is wrapped to hand the step's labels (verl's rolled input ids, Ulysses-
  sliced and padded like the hidden states), per-token temperatures and, on the padded path, the
  valid-token mask to that head;
* ``prepare_model_outputs`` is replaced by :func:`_prepare_vocab_pass_outputs`, which turns the
  head's ``[log pi, H]`` into verl's ``model_output`` (nested ``log_probs`` / ``entropy``), with the
  same Ulysses all-gather and pad removal verl applies to its log-probs.

Another hook may observe the head's input for the step (:func:`observing_head`, a
:class:`HeadObserver`): it asks the pass for each token's top-k ids, receives the hidden states, the
head weight (unsharded: inside the head's forward), the per-token temperatures and those ids, and adds
its own fields to ``model_output``. :mod:`verl_ext.full_kl` stores pi_old's top-k this way.

The entropy carries a gradient only when the loss may differentiate it (no :func:`entropy_as_mask`
declaration: an entropy bonus); ERC's masking entropy stays graph-free. Combinations the pass
cannot serve raise at the first step (and, for a recipe run, in ``recipe.validation`` before Ray
starts): ``use_fused_kernels``, a consumer of the full logits (``calculate_sum_pi_squared``,
top-k distillation), a head with a bias, a LoRA-wrapped head.
"""

from __future__ import annotations

import functools
import logging
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from verl_ext.entropy import EntropyPath, _attribute, loss_entropy_path
from verl_ext.vocab_pass import vocab_pass

logger = logging.getLogger(__name__)

VOCAB_PASS_KEY = "actor_rollout_ref.actor.policy_loss.vocab_pass"
VOCAB_PASS_ATTR = "divclip_vocab_pass"
"""Attribute a loss function sets to ``True`` to run its engine's forward steps through the pass."""

_ENGINE_ATTR = "_divclip_vocab_pass"
_INSTALLED_MARK = "_verl_ext_vocab_pass_installed"


def with_vocab_pass(loss_function: Callable[..., Any]) -> Callable[..., Any]:
    """Declare that the engine running ``loss_function`` computes both passes with the vocabulary
    pass. Returns a picklable ``functools.partial`` carrying :data:`VOCAB_PASS_ATTR` (other
    declarations on ``loss_function``, e.g. :func:`verl_ext.entropy.entropy_as_mask`, are kept)."""
    wrapped = functools.partial(loss_function)
    for name, value in vars(loss_function).items() if hasattr(loss_function, "__dict__") else ():
        setattr(wrapped, name, value)
    setattr(wrapped, VOCAB_PASS_ATTR, True)
    return wrapped


def loss_uses_vocab_pass(loss_function: Optional[Callable[..., Any]]) -> bool:
    return bool(getattr(loss_function, VOCAB_PASS_ATTR, False))


def mark_engine_vocab_pass(engine: Any, enabled: bool) -> None:
    """Make every forward step of ``engine`` use (or stop using) the vocabulary pass. Called by the
    wrapped ``TrainingWorker.set_loss_fn``; tests and benches may call it directly."""
    if enabled:
        _refuse_engine(engine)
    if bool(getattr(engine, _ENGINE_ATTR, False)) != enabled:
        logger.info("divclip: log-probs and entropy from %s", "the vocabulary pass" if enabled else "verl's logits")
    setattr(engine, _ENGINE_ATTR, enabled)


def engine_uses_vocab_pass(engine: Any) -> bool:
    return bool(getattr(engine, _ENGINE_ATTR, False))


def step_uses_vocab_pass(engine: Any, loss_function: Optional[Callable[..., Any]]) -> bool:
    """Whether a forward step of ``engine`` with ``loss_function`` runs through the pass: the engine is
    marked, or the loss declares it (an engine driven without ``TrainingWorker``, marked at this step)."""
    return engine_uses_vocab_pass(engine) or loss_uses_vocab_pass(loss_function)


def _refuse_engine(engine: Any) -> None:
    model_config = getattr(engine, "model_config", None)
    if bool(getattr(model_config, "use_fused_kernels", False)):
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true replaces the LM head's logits; actor_rollout_ref.model.use_fused_kernels=true "
            "replaces the model forward with verl's fused kernel: choose one"
        )


# ------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------


class HeadObserver(Protocol):
    """A consumer of the LM head's input during one vocabulary-pass step (see :func:`observing_head`)."""

    def requested_top_k(self, vocab: int) -> int:
        """How many top ids per token to ask the pass for (0: none); may raise naming its config key."""

    def on_head(self, hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor, top_ids: Optional[torch.Tensor]) -> None:
        """Called once per step inside the head's forward, without a graph: ``(tokens, hidden)`` states
        in verl's packed order, the head weight, ``(tokens,)`` temperatures, ``(tokens, k)`` top ids."""

    def model_outputs(self) -> dict[str, torch.Tensor]:
        """Fields to add to the step's ``model_output``."""


_OBSERVERS_ATTR = "_divclip_head_observers"


@contextmanager
def observing_head(engine: Any, observer: HeadObserver) -> Iterator[None]:
    """Register ``observer`` for the forward steps of ``engine`` run inside the block (looked up when
    the head runs, so it works whichever of the engine's ``forward_step`` wrappers is outermost)."""
    observers = list(getattr(engine, _OBSERVERS_ATTR, ()))
    with _attribute(engine, _OBSERVERS_ATTR, observers + [observer]):
        yield


def head_observers(engine: Any) -> list[HeadObserver]:
    return list(getattr(engine, _OBSERVERS_ATTR, ()))


@dataclass
class _StepState:
    """What the head needs from ``prepare_model_inputs`` for one micro-batch."""

    engine: Any = None
    labels: Optional[torch.Tensor] = None  # (rows,) rolled input ids, in the head's row order
    temperature: Optional[torch.Tensor] = None  # (rows,) per-token temperature
    valid: Optional[torch.Tensor] = None  # padded path: (batch, seq) mask of real tokens
    entropy_grad: bool = False


def output_head(module: Any) -> torch.nn.Module:
    """The LM head module of an (FSDP-wrapped) causal LM."""
    inner = getattr(module, "_fsdp_wrapped_module", module)  # FSDP1 wrapper
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{VOCAB_PASS_KEY}=true needs a causal LM with an output head; {type(inner).__name__} has none")
    if not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(
            f"{VOCAB_PASS_KEY}=true: the LM head {type(head).__name__} has no plain weight (a LoRA/PEFT-wrapped head?); "
            "turn the vocabulary pass off or keep the head out of the adapter's target_modules"
        )
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{VOCAB_PASS_KEY}=true: the LM head has a bias, which the vocabulary pass does not add")
    if hasattr(head, "base_layer") or hasattr(head, "lora_A"):
        raise ValueError(f"{VOCAB_PASS_KEY}=true: the LM head carries a LoRA adapter; the pass reads only its base weight")
    return head


def _head_forward(head: torch.nn.Module, state: _StepState, hidden_states: torch.Tensor) -> torch.Tensor:
    """The LM head's forward during a vocabulary-pass step: ``[log pi(y_t), H_t]`` per token."""
    if state.labels is None or state.temperature is None:
        raise RuntimeError("the vocabulary-pass head was called outside a prepared forward step")
    hidden = hidden_states
    if state.valid is not None:  # padded path: only the real tokens, in verl's packed order
        hidden = hidden_states[state.valid]
    else:
        hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    observers = head_observers(state.engine)
    vocab = head.weight.shape[0]
    top_k = max((observer.requested_top_k(vocab) for observer in observers), default=0)
    out = vocab_pass(hidden, head.weight, state.labels, state.temperature, top_k=top_k, entropy_grad=state.entropy_grad)
    with torch.no_grad():
        for observer in observers:
            observer.on_head(hidden.detach(), head.weight.detach(), state.temperature, out.top_ids)
    return torch.stack([out.log_probs, out.entropy], dim=-1)


def _capture_inputs(engine: Any, prepare: Callable[..., Any], state: _StepState) -> Callable[..., Any]:
    def prepare_model_inputs(micro_batch: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        model_inputs, output_args = prepare(micro_batch=micro_batch)
        for key, consumer in (
            ("use_fused_kernels", "actor_rollout_ref.model.use_fused_kernels"),
            ("distillation_use_topk", "top-k distillation (distillation.distillation_loss.loss_settings.use_topk)"),
            ("calculate_sum_pi_squared", "actor_rollout_ref.actor.calculate_sum_pi_squared"),
        ):
            if tu.get_non_tensor_data(data=micro_batch, key=key, default=False):
                raise ValueError(f"{VOCAB_PASS_KEY}=true never materialises the logits that {consumer} needs")
        if "input_ids_rmpad_rolled" not in output_args:
            raise ValueError(f"{VOCAB_PASS_KEY}=true: verl's inputs carry no rolled labels (pad_mode?)")
        state.labels = output_args["input_ids_rmpad_rolled"].reshape(-1)
        if "temperature_rmpad" in output_args:  # remove-padding (and Ulysses) path: one per row
            state.temperature = output_args["temperature_rmpad"].reshape(-1)
            state.valid = None
        else:  # padded path: per sample, expanded over its real tokens
            lengths = micro_batch["input_ids"].offsets().diff()
            state.temperature = output_args["temperature"].reshape(-1).repeat_interleave(lengths)
            max_len = int(lengths.max())
            state.valid = torch.arange(max_len, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)
        return model_inputs, output_args

    return prepare_model_inputs


def _prepare_vocab_pass_outputs(engine: Any) -> Callable[..., dict[str, Any]]:
    """verl's ``prepare_model_outputs`` for a head that returned ``[log pi, H]``."""

    def prepare_model_outputs(
        output: Any, output_args: dict[str, Any], micro_batch: Any, logits_processor_func: Any = None
    ) -> dict[str, Any]:
        from verl.utils import tensordict_utils as tu

        calculate_entropy = tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False)
        distillation_only = tu.get_non_tensor_data(data=micro_batch, key="distillation_only", default=False)
        if distillation_only:
            raise ValueError(f"{VOCAB_PASS_KEY}=true cannot serve distillation-only steps (they need the logits)")
        packed = output.logits.reshape(-1, 2)
        log_probs, entropy = packed[:, 0], packed[:, 1]
        if "pad_size" in output_args:  # remove-padding: all-gather the Ulysses group, drop the pad
            log_probs = engine._gather_and_unpad_packed(log_probs, output_args["pad_size"])
            if calculate_entropy:
                entropy = engine._gather_and_unpad_packed(entropy, output_args["pad_size"])
        cu_seqlens = micro_batch["input_ids"].offsets()
        model_output = {"log_probs": torch.nested.nested_tensor_from_jagged(log_probs, cu_seqlens)}
        if calculate_entropy:
            model_output["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, cu_seqlens)
        for observer in head_observers(engine):
            model_output.update(observer.model_outputs())
        return model_output

    return prepare_model_outputs


@contextmanager
def vocab_pass_step(engine: Any, loss_function: Optional[Callable[..., Any]]) -> Iterator[None]:
    """Route one forward step of ``engine`` through the vocabulary pass (see the module docstring)."""
    _refuse_engine(engine)
    head = output_head(engine.module)
    state = _StepState(
        engine=engine,
        entropy_grad=torch.is_grad_enabled()
        and loss_function is not None
        and loss_entropy_path(loss_function) is not EntropyPath.DIVCLIP_FP32
    )
    with ExitStack() as stack:
        stack.enter_context(_attribute(head, "forward", functools.partial(_head_forward, head, state)))
        stack.enter_context(
            _attribute(engine, "prepare_model_inputs", _capture_inputs(engine, engine.prepare_model_inputs, state))
        )
        stack.enter_context(_attribute(engine, "prepare_model_outputs", _prepare_vocab_pass_outputs(engine)))
        yield


# ------------------------------------------------------------------------------------------------
# The hook into verl's engine
# ------------------------------------------------------------------------------------------------


def _wrap_forward_step(forward_step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(forward_step)
    def forward_step_with_vocab_pass(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        if not step_uses_vocab_pass(self, loss_function):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)
        if not engine_uses_vocab_pass(self):
            mark_engine_vocab_pass(self, True)  # an engine driven without TrainingWorker
        with vocab_pass_step(self, loss_function):
            return forward_step(self, micro_batch, loss_function=loss_function, forward_only=forward_only)

    setattr(forward_step_with_vocab_pass, _INSTALLED_MARK, True)
    return forward_step_with_vocab_pass


def _wrap_set_loss_fn(set_loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(set_loss_fn)  # keeps verl's @register dispatch attributes
    def set_loss_fn_marking_vocab_pass(self: Any, loss_fn: Any) -> Any:
        result = set_loss_fn(self, loss_fn)
        engine = getattr(self, "engine", None)
        if engine is not None:
            mark_engine_vocab_pass(engine, loss_uses_vocab_pass(loss_fn))
        return result

    setattr(set_loss_fn_marking_vocab_pass, _INSTALLED_MARK, True)
    return set_loss_fn_marking_vocab_pass


def install_vocab_pass() -> None:
    """Wrap ``FSDPEngineWithLMHead.forward_step`` and ``TrainingWorker.set_loss_fn`` (idempotent;
    inert until a loss opts in with :func:`with_vocab_pass` or an engine is marked)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker

    if not getattr(TrainingWorker.set_loss_fn, _INSTALLED_MARK, False):
        TrainingWorker.set_loss_fn = _wrap_set_loss_fn(TrainingWorker.set_loss_fn)
    if not getattr(FSDPEngineWithLMHead.forward_step, _INSTALLED_MARK, False):
        FSDPEngineWithLMHead.forward_step = _wrap_forward_step(FSDPEngineWithLMHead.forward_step)
