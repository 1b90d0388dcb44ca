"""The one seam into verl's engine (:mod:`verl_ext.engine.seam`): guarded, wrapping each symbol once,
restoring every swap, refusing what it does not cover; and the one-of-each rules of the core it serves.

* The guard checks every verl symbol the seam touches: installed against deliberately altered copies of
  verl's classes (a renamed parameter, a missing method, a missing config field) it raises one message
  naming the symbol, the installed verl version and the supported one -- and wraps nothing.
* Installed on unaltered copies it wraps each symbol once (idempotent) and keeps verl's signature and
  dispatch attributes; verl's own classes are installed once per process.
* A step's swaps are applied together, refused when two features would swap one attribute, and restored
  on every exit path (also when the step raises); a second thread's step is refused while one holds the
  process-global swaps.
* An engine the seam does not cover (megatron and friends) is refused at ``set_loss_fn`` when the loss asks
  for any feature, naming the keys and the supported strategies; a loss that asks for nothing passes.
* One ERC rule: a NaN entropy ratio is outside the band in the loss, the gauge and the token dump.
* Registering the divclip modes refuses to overwrite a verl registry entry that is not the project's own.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch

import verl_ext.actor_loss  # noqa: F401  (installs the seam into verl, as a worker's unpickling does)
from verl_ext.engine import guard, seam
from verl_ext.engine.request import EngineRequest, declare, entropy_as_mask, request_of, with_vocab_pass
from verl_ext.engine.swap import Swap, swapped


def module_copies(**engine_attributes: Any) -> dict[str, Any]:
    """Stand-ins for verl's engine and worker modules holding subclasses of verl's classes (the real ones
    are never touched), each owning verl's own undecorated methods; ``engine_attributes`` are set on the
    engine copy (an altered verl)."""
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine_workers import TrainingWorker

    engine_class = type("FSDPEngineWithLMHead", (transformer_impl.FSDPEngineWithLMHead,), {})
    worker_class = type("TrainingWorker", (TrainingWorker,), {})
    for cls, names in ((engine_class, ("forward_step", "infer_batch")), (worker_class, ("set_loss_fn", "train_mini_batch", "train_batch"))):
        for name in names:
            current = getattr(cls, name)
            setattr(cls, name, getattr(current, seam.ORIGINAL_ATTR, current))
    for name, value in engine_attributes.items():
        setattr(engine_class, name, value)
    return {
        guard.ENGINE_MODULE: types.SimpleNamespace(FSDPEngineWithLMHead=engine_class,
                                                   logprobs_from_logits=transformer_impl.logprobs_from_logits),
        guard.WORKER_MODULE: types.SimpleNamespace(TrainingWorker=worker_class),
    }


def _altered_forward_step(self: Any, micro_batch: Any, loss_fn: Any, forward_only: bool) -> Any:  # a renamed parameter
    raise AssertionError("never called")


def test_install_refuses_an_altered_verl_naming_symbol_and_versions() -> None:
    modules = module_copies(forward_step=_altered_forward_step)
    engine_class = modules[guard.ENGINE_MODULE].FSDPEngineWithLMHead
    with pytest.raises(guard.VerlMismatchError) as error:
        seam.install(modules)
    message = str(error.value)
    assert f"{guard.ENGINE_MODULE}.FSDPEngineWithLMHead.forward_step" in message
    assert "(self, micro_batch, loss_fn, forward_only)" in message and "loss_function" in message
    assert f"Installed verl {guard.verl_version()}" in message and f"supported: verl {guard.SUPPORTED_VERL}" in message
    assert engine_class.forward_step is _altered_forward_step  # nothing was wrapped
    assert not hasattr(modules[guard.WORKER_MODULE].TrainingWorker.set_loss_fn, seam.ORIGINAL_ATTR)


def test_a_missing_method_and_a_missing_config_field_are_named() -> None:
    from verl.workers.engine.fsdp import transformer_impl

    missing = module_copies()
    engine_class = missing[guard.ENGINE_MODULE].FSDPEngineWithLMHead
    # a class without the private helper the vocabulary pass calls
    stripped = type("FSDPEngineWithLMHead", (), {name: getattr(engine_class, name) for name in
                                                 ("forward_step", "infer_batch", "prepare_model_inputs", "prepare_model_outputs",
                                                  "get_data_parallel_size", "get_data_parallel_rank")})
    missing[guard.ENGINE_MODULE].FSDPEngineWithLMHead = stripped
    with pytest.raises(guard.VerlMismatchError, match=r"FSDPEngineWithLMHead\._gather_and_unpad_packed .*has no attribute '_gather_and_unpad_packed'"):
        seam.install(missing)

    import dataclasses

    @dataclasses.dataclass
    class EngineConfigWithoutCheckpointing:
        use_torch_compile: bool = True

    symbol = next(s for s in guard.SYMBOLS if s.path == "FSDPEngineConfig")
    config_module = types.SimpleNamespace(FSDPEngineConfig=EngineConfigWithoutCheckpointing)
    with pytest.raises(guard.VerlMismatchError, match=r"FSDPEngineConfig .*declares no field entropy_checkpointing"):
        guard.check_symbol(symbol, {"verl.workers.config": config_module})
    assert transformer_impl.FSDPEngineWithLMHead._gather_and_unpad_packed  # verl itself untouched


def test_install_wraps_each_symbol_once_and_keeps_verls_signature() -> None:
    import inspect

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker

    modules = module_copies()
    engine_class = modules[guard.ENGINE_MODULE].FSDPEngineWithLMHead
    worker_class = modules[guard.WORKER_MODULE].TrainingWorker
    original = engine_class.forward_step
    seam.install(modules)
    seam.install(modules)  # idempotent: no second layer
    wrapper = engine_class.forward_step
    assert getattr(wrapper, seam.ORIGINAL_ATTR) is original
    assert not hasattr(getattr(wrapper, seam.ORIGINAL_ATTR), seam.ORIGINAL_ATTR)
    assert list(inspect.signature(wrapper).parameters) == ["self", "micro_batch", "loss_function", "forward_only"]
    for name in ("set_loss_fn", "train_mini_batch", "train_batch"):
        assert hasattr(getattr(worker_class, name), seam.ORIGINAL_ATTR), name
    # verl's own classes: installed once by the import above, and the guard still passes on them
    for cls, name in ((FSDPEngineWithLMHead, "forward_step"), (FSDPEngineWithLMHead, "infer_batch"), (TrainingWorker, "set_loss_fn")):
        inner = getattr(getattr(cls, name), seam.ORIGINAL_ATTR)
        assert not hasattr(inner, seam.ORIGINAL_ATTR), name
    guard.check_symbols()
    # verl's @register dispatch attributes survive the wrap (Ray dispatches set_loss_fn by them)
    assert vars(TrainingWorker.set_loss_fn).keys() >= vars(getattr(TrainingWorker.set_loss_fn, seam.ORIGINAL_ATTR)).keys() - {"__wrapped__"}


def test_swaps_are_restored_on_error_and_conflicts_refused() -> None:
    owner = types.SimpleNamespace(a=1)
    instance_only = types.SimpleNamespace()
    with pytest.raises(ZeroDivisionError):
        with swapped([Swap(owner, "a", 2, "x"), Swap(instance_only, "b", 3, "y")]):
            assert owner.a == 2 and instance_only.b == 3
            1 / 0
    assert owner.a == 1 and not hasattr(instance_only, "b")
    with pytest.raises(RuntimeError, match="twice in one step .*'first' and 'second'"):
        with swapped([Swap(owner, "a", 2, "first"), Swap(owner, "a", 3, "second")]):
            pass
    assert owner.a == 1


def test_a_second_thread_is_refused_while_a_step_holds_the_process_globals() -> None:
    errors: list[BaseException] = []
    inside, release = threading.Event(), threading.Event()

    def first() -> None:
        with seam._holding_process_globals(True):
            inside.set()
            release.wait(10)

    def second() -> None:
        try:
            with seam._holding_process_globals(True):
                pass
        except RuntimeError as error:
            errors.append(error)

    holder = threading.Thread(target=first)
    holder.start()
    inside.wait(10)
    other = threading.Thread(target=second)
    other.start()
    other.join(10)
    release.set()
    holder.join(10)
    assert len(errors) == 1 and "two threads of one process" in str(errors[0])
    with seam._holding_process_globals(True):  # free again, and re-entrant in one thread
        with seam._holding_process_globals(True):
            pass


class NotAnFSDPEngine:
    """What megatron's (or veomni's, torchtitan's) engine is to the seam: something else."""

    engine_config = types.SimpleNamespace(use_fused_kernels=False, use_torch_compile=False)


def test_an_uncovered_engine_is_refused_not_marked() -> None:
    def loss(**_: Any) -> None: ...

    engine = NotAnFSDPEngine()
    for asked, keys in ((entropy_as_mask(loss, entropy_coeff=0.0), "erc_beta_low/erc_beta_high"),
                        (with_vocab_pass(loss), "policy_loss.vocab_pass"),
                        (declare(loss, pack_as_update=True), "pack_old_log_prob_as_update")):
        with pytest.raises(ValueError, match=rf"{keys}.*covers verl's FSDPEngineWithLMHead .*\['fsdp', 'fsdp2'\].*NotAnFSDPEngine"):
            seam.set_features(engine, request_of(asked))
        assert seam.features_of(engine) is None
    # a loss that asks for nothing (verl's own ppo_loss) runs on any engine
    assert seam.set_features(engine, request_of(loss)).request == EngineRequest()


def test_the_worker_refuses_before_installing_the_loss() -> None:
    from verl.workers.engine_workers import TrainingWorker

    worker = TrainingWorker.__new__(TrainingWorker)  # no process group: only set_loss_fn is exercised
    worker.engine, worker.loss_fn = NotAnFSDPEngine(), None

    def loss(**_: Any) -> None: ...

    with pytest.raises(ValueError, match="pack_old_log_prob_as_update.*NotAnFSDPEngine"):
        TrainingWorker.set_loss_fn(worker, declare(loss, pack_as_update=True))
    assert worker.loss_fn is None  # refused before verl's set_loss_fn ran
    TrainingWorker.set_loss_fn(worker, loss)
    assert worker.loss_fn is loss


# ------------------------------------------------------------------------------------------------
# One of each: the NaN rule, the registry
# ------------------------------------------------------------------------------------------------


def test_a_nan_entropy_ratio_is_masked_everywhere() -> None:
    from verl_ext.config import DivClipPolicyLossConfig
    from verl_ext.core.erc import entropy_ratio, entropy_ratio_band, outside_band
    from verl_ext.core.gauge import on_policy_gauge

    old_entropy = torch.tensor([[0.5, 0.5, 0.5]])
    entropy = torch.tensor([[0.5, float("nan"), 0.5]])
    mask = torch.tensor([[1, 1, 0]])
    policy = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
    rho = entropy_ratio(old_entropy, entropy, mask, policy.erc_eps)
    assert rho[0, 0] == 1.0 and torch.isnan(rho[0, 1]) and rho[0, 2] == 1.0  # padding is exactly 1
    assert outside_band(rho, 0.05, 0.05).tolist() == [[False, True, False]]
    band = entropy_ratio_band(old_entropy, entropy, mask, policy, torch.float32)
    assert band.outside.tolist() == [[False, True, False]] and float(band.n_above) == float(band.n_below) == 1.0
    gauge = on_policy_gauge(torch.zeros(1, 3), torch.zeros(1, 3), mask, 0.2, 0.28, old_entropy, entropy, (0.05, 0.05, 1e-8))
    assert gauge["onpolicy/erc_masked_frac"] == 0.5  # the NaN token of the two valid ones


def test_registering_refuses_to_shadow_a_verl_loss() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_ext import registry

    assert registry.is_own_mode("kl3") and not registry.is_own_mode("vanilla")
    registry.register_modes()  # idempotent on its own entries
    ours = POLICY_LOSS_REGISTRY["gppo"]

    def verls_future_gppo(**_: Any) -> None: ...

    POLICY_LOSS_REGISTRY["gppo"] = verls_future_gppo
    try:
        with pytest.raises(RuntimeError, match=r"already registers a policy loss named 'gppo' .*verls_future_gppo.*would shadow it"):
            registry.register_modes()
        assert POLICY_LOSS_REGISTRY["gppo"] is verls_future_gppo  # left as verl had it
    finally:
        POLICY_LOSS_REGISTRY["gppo"] = ours


def test_defining_a_constraint_twice_is_refused() -> None:
    from verl_ext.core.region import define_constraint

    with pytest.raises(ValueError, match="constraint 'kl3' is already defined"):
        define_constraint("kl3")(lambda inputs: None)
