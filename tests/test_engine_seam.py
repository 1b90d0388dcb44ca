"""The one seam into verl's engine (:mod:`verl_ext.engine.seam`): guarded, wrapping each symbol once,
restoring every swap, refusing what it does not cover; and the one-of-each rules of the core it serves.

* The guard checks every verl symbol the seam touches: installed against deliberately altered copies of
  verl's classes (a renamed parameter, a missing method, a missing config field) it raises one message
  naming the symbol, the installed verl version and the supported one -- and wraps nothing.
* What the seam reads of verl is checked too, each mismatch named with both versions: an unsupported verl
  release is refused unless ``DIVCLIP_ALLOW_UNSUPPORTED_VERL=1``; an engine attribute verl renamed (when
  the features are set, and at each read); an ``infer_batch`` result without a key pack_old_log_prob_as_update
  reassembles. (verl's source is not parsed: the version pin fixes what its functions read inside.)
* Installed on unaltered copies it wraps each symbol once (idempotent) and keeps verl's signature and
  dispatch attributes; verl's own classes are installed once per process.
* A step's swaps are applied together, refused when two features would swap one attribute, and restored
  on every exit path (also when the step raises). verl's module globals are overridden through dispatchers
  installed once, per thread: real forward steps of two engines in two threads, one overriding them, each
  compute what they compute alone.
* An engine the seam does not cover (megatron and friends) is refused at ``set_loss_fn`` when the loss asks
  for any feature, naming the keys and the supported strategies; a loss that asks for nothing passes.
* One ERC rule: a NaN entropy ratio is outside the band in the loss, the gauge and the token dump.
* Registering the divclip modes refuses to overwrite a verl registry entry that is not the project's own.
"""

from __future__ import annotations

import functools
import threading
import types
from typing import Any

import pytest
import torch

from recipe.bench.features import with_vocab_pass
from verl_ext.engine import guard, seam
from verl_ext.engine.request import EngineRequest, declare, entropy_as_mask, request_of
from verl_ext.engine.swap import Swap, swapped

seam.install()  # into verl's own classes, as an actor worker does when its loss arrives


def module_copies(**engine_attributes: Any) -> dict[str, Any]:
    """Stand-ins for verl's engine and worker modules holding subclasses of verl's classes (the real ones
    are never touched), each owning verl's own undecorated methods; ``engine_attributes`` are set on the
    engine copy (an altered verl)."""
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine_workers import TrainingWorker

    engine_class = type("FSDPEngineWithLMHead", (transformer_impl.FSDPEngineWithLMHead,), {})
    worker_class = type("TrainingWorker", (TrainingWorker,), {})
    for cls, names in (
        (engine_class, ("forward_step", "infer_batch")),
        (worker_class, ("set_loss_fn", "train_mini_batch", "train_batch")),
    ):
        for name in names:
            current = getattr(cls, name)
            setattr(cls, name, getattr(current, seam.ORIGINAL_ATTR, current))
    for name, value in engine_attributes.items():
        setattr(engine_class, name, value)
    return {
        guard.ENGINE_MODULE: types.SimpleNamespace(
            FSDPEngineWithLMHead=engine_class, logprobs_from_logits=transformer_impl.logprobs_from_logits
        ),
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
    stripped = type(
        "FSDPEngineWithLMHead",
        (),
        {
            name: getattr(engine_class, name)
            for name in (
                "forward_step",
                "infer_batch",
                "prepare_model_inputs",
                "prepare_model_outputs",
                "get_data_parallel_size",
                "get_data_parallel_rank",
            )
        },
    )
    missing[guard.ENGINE_MODULE].FSDPEngineWithLMHead = stripped
    with pytest.raises(
        guard.VerlMismatchError,
        match=r"FSDPEngineWithLMHead\._gather_and_unpad_packed .*has no attribute '_gather_and_unpad_packed'",
    ):
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
    for cls, name in (
        (FSDPEngineWithLMHead, "forward_step"),
        (FSDPEngineWithLMHead, "infer_batch"),
        (TrainingWorker, "set_loss_fn"),
    ):
        inner = getattr(getattr(cls, name), seam.ORIGINAL_ATTR)
        assert not hasattr(inner, seam.ORIGINAL_ATTR), name
    guard.check_symbols()
    # verl's @register dispatch attributes survive the wrap (Ray dispatches set_loss_fn by them)
    assert vars(TrainingWorker.set_loss_fn).keys() >= vars(
        getattr(TrainingWorker.set_loss_fn, seam.ORIGINAL_ATTR)
    ).keys() - {"__wrapped__"}


# ------------------------------------------------------------------------------------------------
# What the seam reads of verl: the release, the keys in verl's source, the engine's attributes, the
# result layout -- each refused with one message naming it and both versions
# ------------------------------------------------------------------------------------------------


def assert_names_the_versions(message: str) -> None:
    assert f"Installed verl {guard.verl_version()}" in message and f"supported: verl {guard.SUPPORTED_VERL}" in message


def test_an_unsupported_verl_is_refused_unless_the_user_overrides(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import verl

    monkeypatch.setattr(verl, "__version__", "0.9.2")
    modules = module_copies()
    worker_class = modules[guard.WORKER_MODULE].TrainingWorker
    for value in (None, "0", "yes"):  # unset, off, or anything but 1
        if value is None:
            monkeypatch.delenv(guard.ALLOW_UNSUPPORTED_VERL_ENV, raising=False)
        else:
            monkeypatch.setenv(guard.ALLOW_UNSUPPORTED_VERL_ENV, value)
        with pytest.raises(guard.VerlMismatchError) as error:
            seam.install(modules)
        message = str(error.value)
        assert "written for verl 0.9.1; installed verl 0.9.2 is refused" in message, value
        assert f"{guard.ALLOW_UNSUPPORTED_VERL_ENV}=1" in message and "pip install 'verl==0.9.1'" in message
        assert not hasattr(worker_class.set_loss_fn, seam.ORIGINAL_ATTR)  # nothing was wrapped
    monkeypatch.setenv(guard.ALLOW_UNSUPPORTED_VERL_ENV, "1")
    with caplog.at_level("WARNING", logger=guard.__name__):
        seam.install(modules)
    assert hasattr(worker_class.set_loss_fn, seam.ORIGINAL_ATTR)
    assert any(
        "verl 0.9.2 is installed" in r.getMessage() and f"{guard.ALLOW_UNSUPPORTED_VERL_ENV}=1" in r.getMessage()
        for r in caplog.records
    )


def engine_of(modules: dict[str, Any], **attributes: Any) -> Any:
    """An instance of the altered engine class holding what verl's ``__init__`` sets (no process group);
    ``attributes`` replace those, ``None`` removes one (a verl that renamed it)."""
    from verl.workers.config import FSDPEngineConfig

    engine_class = modules[guard.ENGINE_MODULE].FSDPEngineWithLMHead
    engine = engine_class.__new__(engine_class)
    values: dict[str, Any] = dict(
        engine_config=FSDPEngineConfig(strategy="fsdp2"),
        model_config=types.SimpleNamespace(use_fused_kernels=False),
        use_ulysses_sp=False,
        module=torch.nn.Module(),
        compute_entropy_from_logits=lambda logits: logits,
    )
    values.update(attributes)
    for attribute, value in values.items():
        if value is not None:
            setattr(engine, attribute, value)
    return engine


@pytest.mark.parametrize(
    "attributes, named",
    [
        (
            dict(use_ulysses_sp=None),
            r"FSDPEngineWithLMHead\.use_ulysses_sp \(read: pi_old's top-k refuses Ulysses.*"
            r"but the engine instance has no attribute 'use_ulysses_sp'",
        ),
        (
            dict(engine_config=types.SimpleNamespace(entropy_checkpointing=False)),
            r"FSDPEngineWithLMHead\.engine_config\.use_torch_compile \(read: .*but its engine_config "
            r"\(SimpleNamespace\) has no attribute 'use_torch_compile'",
        ),
        (
            dict(model_config=types.SimpleNamespace()),
            r"FSDPEngineWithLMHead\.model_config\.use_fused_kernels \(read: the vocabulary pass refuses verl's fused "
            r"kernels\), but its model_config \(SimpleNamespace\) has no attribute 'use_fused_kernels'",
        ),
    ],
)
def test_an_engine_attribute_verl_renamed_is_named_when_features_are_set(
    attributes: dict[str, Any], named: str
) -> None:
    modules = module_copies()
    seam.install(modules)
    assert seam.set_features(engine_of(modules), EngineRequest(vocab_pass=True)).request.vocab_pass  # verl's own: fine
    engine = engine_of(modules, **attributes)
    with pytest.raises(guard.VerlMismatchError, match=named) as error:
        seam.set_features(engine, EngineRequest(entropy_as_mask=True))
    assert_names_the_versions(str(error.value))
    assert seam.features_of(engine) is None


def test_the_features_read_the_engine_without_a_silent_default() -> None:
    """Where a feature reads the engine (also on a path no feature request checked first: pi_old's top-k
    under a loss that asks for nothing), a renamed attribute raises instead of reading as False."""
    from verl_ext.engine.entropy_path import entropy_fn_for, entropy_swaps
    from verl_ext.engine.topk_capture import refuse_ulysses
    from verl_ext.engine.vocab_pass_step import refuse_fused_kernels

    modules = module_copies()
    for read, attributes, name in (
        (refuse_ulysses, dict(use_ulysses_sp=None), "use_ulysses_sp"),
        (refuse_fused_kernels, dict(model_config=types.SimpleNamespace()), "use_fused_kernels"),
        (entropy_fn_for, dict(engine_config=types.SimpleNamespace(entropy_checkpointing=False)), "use_torch_compile"),
        (
            lambda engine: entropy_swaps(engine, lambda logits: logits),
            dict(engine_config=types.SimpleNamespace()),
            "entropy_checkpointing",
        ),
    ):
        with pytest.raises(guard.VerlMismatchError, match=f"has no attribute '{name}'"):
            read(engine_of(modules, **attributes))
    with pytest.raises(KeyError, match="not a row of guard.ENGINE_INSTANCE_ATTRIBUTES"):
        guard.engine_attribute(engine_of(modules), "use_remove_padding")  # every read is a row of the table


def test_an_infer_batch_result_without_a_key_is_named_at_the_first_call() -> None:
    """pack_old_log_prob_as_update checks verl's result before reassembling it: a VerlMismatchError naming the key,
    not a KeyError inside the reassembly."""
    from tensordict import TensorDict

    from verl_ext.engine.packing import infer_as_update

    engine = types.SimpleNamespace(
        engine_config=types.SimpleNamespace(max_token_len_per_gpu=64, micro_batch_size_per_gpu=2)
    )
    data = TensorDict({"input": torch.zeros(4, 3)}, batch_size=[4])

    def renamed_loss(engine: Any, part: Any, loss_function: Any) -> dict[str, Any]:
        return {"model_output": {}, "losses": [], "metrics": {}}

    with pytest.raises(
        guard.VerlMismatchError,
        match=r"FSDPEngineWithLMHead\.infer_batch \(its result's model_output, loss, metrics reassembled by "
        r"pack_old_log_prob_as_update\), but its result has no key 'loss' \(it has \['losses', 'metrics', "
        r"'model_output'\]\)",
    ) as error:
        infer_as_update(engine, data, None, renamed_loss)
    assert_names_the_versions(str(error.value))
    assert infer_as_update(engine, data, None, lambda *_: None) is None  # a rank without outputs


def test_swaps_are_restored_on_error_and_conflicts_refused() -> None:
    owner = types.SimpleNamespace(a=1)
    instance_only = types.SimpleNamespace()
    with pytest.raises(ZeroDivisionError):
        with swapped([Swap(owner, "a", 2, "x"), Swap(instance_only, "b", 3, "y")]):
            assert owner.a == 2 and instance_only.b == 3
            raise ZeroDivisionError("the step fails inside the swaps")
    assert owner.a == 1 and not hasattr(instance_only, "b")
    with pytest.raises(RuntimeError, match="twice in one step .*'first' and 'second'"):
        with swapped([Swap(owner, "a", 2, "first"), Swap(owner, "a", 3, "second")]):
            pass
    assert owner.a == 1


def job_steps_in_two_threads(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """Real forward steps (the old-log-prob pass: log-probs and entropies) of three engines in one process, two at
    a time in two threads: ``erc`` overrides verl's module globals for its steps (the fp32 entropy), ``plain_a`` /
    ``plain_b`` (verl's own loss) override nothing but call them. The first step is held inside its model forward
    until the second has run."""
    from verl.workers.utils.losses import ppo_loss

    from recipe.bench.harness import (
        WorkerOptions,
        build_actor_worker,
        compute_log_prob,
        make_actor_config,
        make_rollout_batch,
    )
    from verl_ext.actor_loss import build_actor_loss
    from verl_ext.config import DivClipPolicyLossConfig

    batch = make_rollout_batch([3, 4], [5, 6], 512, seed=1)
    # the padded path: there verl calls the module-global entropy_from_logits (remove-padding calls the engine's own)
    workers = {
        name: build_actor_worker(model_path, WorkerOptions(use_remove_padding=False))
        for name in ("erc", "plain_a", "plain_b")
    }
    erc = DivClipPolicyLossConfig(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
    workers["erc"].set_loss_fn(build_actor_loss(make_actor_config(policy_loss=erc, calculate_entropy=True)))
    for name in ("plain_a", "plain_b"):
        workers[name].set_loss_fn(functools.partial(ppo_loss, config=make_actor_config()))

    def log_probs_and_entropy(name: str) -> torch.Tensor:
        out = compute_log_prob(workers[name], batch)
        return torch.cat([out["old_log_probs"].values(), out["entropy"].values()])

    alone = {name: log_probs_and_entropy(name) for name in workers}

    def overlap(first: str, second: str) -> dict[str, Any]:
        inside, release = threading.Event(), threading.Event()
        outcome: dict[str, Any] = {}

        def hold(module: Any, args: Any) -> None:
            inside.set()
            release.wait(30)

        hook = workers[first].engine.module.register_forward_pre_hook(hold)

        def run(name: str) -> None:
            try:
                outcome[name] = log_probs_and_entropy(name)
            except RuntimeError as error:
                outcome[name] = error

        holder = threading.Thread(target=run, args=(first,))
        holder.start()
        assert inside.wait(30)
        hook.remove()  # the second engine's forward must not wait on the first's hook
        other = threading.Thread(target=run, args=(second,))
        other.start()
        other.join(60)
        release.set()
        holder.join(60)
        return outcome

    import verl.utils.torch_functional as verl_F

    before = verl_F.entropy_from_logits
    results = {pair: overlap(*pair) for pair in (("erc", "plain_a"), ("plain_a", "erc"), ("plain_a", "plain_b"))}
    return {"alone": alone, "results": results, "globals_restored": verl_F.entropy_from_logits is before}


def test_steps_of_two_threads_run_side_by_side_each_with_its_own_functions(tmp_path: Any) -> None:
    """Two real forward steps at once in two threads of one process, one of them overriding verl's module
    globals for its step (ERC's fp32 entropy): each computes exactly what it computes alone -- the override
    is dispatched to its own thread only -- and the globals stay the seam's dispatchers."""
    from recipe.bench.harness import TinyQwen3Spec, save_tiny_qwen3
    from tests.helpers import run_ranks

    out = run_ranks(job_steps_in_two_threads, 1, save_tiny_qwen3(tmp_path / "model", TinyQwen3Spec()))[0]
    results, alone = out["results"], out["alone"]
    assert not torch.equal(alone["erc"], alone["plain_a"])  # the fp32 entropy differs from verl's: a leak would show
    for pair, outcome in results.items():
        for name in pair:
            assert isinstance(outcome[name], torch.Tensor), (pair, name, outcome[name])
            assert torch.equal(outcome[name], alone[name]), (pair, name)
    assert out["globals_restored"]


def test_a_module_global_override_is_seen_by_its_own_thread_only() -> None:
    """The dispatcher installed once in place of a module global calls the override of the step running in
    the calling thread, verl's function elsewhere and after the step; a module-global swap without the
    dispatcher is refused instead of rebinding the global for every thread."""
    from verl_ext.engine.swap import install_dispatch

    module = types.ModuleType("verl_module")
    module.f = lambda: "verl"
    install_dispatch(module, "f")
    install_dispatch(module, "f")  # idempotent
    seen: dict[str, str] = {}
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with swapped([Swap(module, "f", lambda: "step", "test")]):
            seen["holder"] = module.f()
            inside.set()
            release.wait(10)
        seen["holder_after"] = module.f()

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(10)
    seen["other_thread"] = module.f()
    release.set()
    holder.join(10)
    assert seen == {"holder": "step", "other_thread": "verl", "holder_after": "verl"}
    bare = types.ModuleType("bare_module")
    bare.f = lambda: "verl"
    with pytest.raises(RuntimeError, match="dispatcher for bare_module.f is not installed"):
        with swapped([Swap(bare, "f", lambda: "step", "test")]):
            pass
    assert bare.f() == "verl"


class NotAnFSDPEngine:
    """What megatron's (or veomni's, torchtitan's) engine is to the seam: something else."""

    engine_config = types.SimpleNamespace(use_fused_kernels=False, use_torch_compile=False)


def test_an_uncovered_engine_is_refused_not_marked() -> None:
    def loss(**_: Any) -> None: ...

    engine = NotAnFSDPEngine()
    for asked, keys in (
        (entropy_as_mask(loss), "erc_beta_low/erc_beta_high"),
        (with_vocab_pass(loss), "policy_loss.vocab_pass"),
        (declare(loss, pack_old_log_prob_as_update=True), "pack_old_log_prob_as_update"),
    ):
        with pytest.raises(
            ValueError, match=rf"{keys}.*covers verl's FSDPEngineWithLMHead .*\['fsdp', 'fsdp2'\].*NotAnFSDPEngine"
        ):
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
        TrainingWorker.set_loss_fn(worker, declare(loss, pack_old_log_prob_as_update=True))
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
    gauge = on_policy_gauge(
        torch.zeros(1, 3), torch.zeros(1, 3), mask, 0.2, 0.28, old_entropy, entropy, (0.05, 0.05, 1e-8)
    )
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
        with pytest.raises(
            RuntimeError,
            match=r"already registers a policy loss named 'gppo' \(tests\.test_engine_seam\.test_registering_refuses"
            r"_to_shadow_a_verl_loss\.<locals>\.verls_future_gppo\); the divclip entry 'gppo' would shadow it",
        ):
            registry.register_modes()
        assert POLICY_LOSS_REGISTRY["gppo"] is verls_future_gppo  # left as verl had it
    finally:
        POLICY_LOSS_REGISTRY["gppo"] = ours


def test_defining_a_constraint_twice_is_refused() -> None:
    from verl_ext.core.region import define_constraint

    with pytest.raises(ValueError, match="constraint 'kl3' is already defined"):
        define_constraint("kl3")(lambda inputs: None)
