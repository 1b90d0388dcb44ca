"""verl features on the divclip path, each through verl's real ``TrainingWorker`` on the CPU platform
(FSDP2 on gloo), one spawned rank per feature. Every run installs the divclip actor loss and the engine seam
(:mod:`verl_ext.engine.seam`); a verl feature it does not refuse before Ray must show the same effect as on
verl's own path.

* **LoRA** (``actor_rollout_ref.model.lora_rank > 0``, the ATR paper's setting):

  - the divclip actor loss in verl's ``vanilla`` mode without pack_old_log_prob_as_update and verl's own
    ``ppo_loss`` give bit-identical parameter updates over two steps (exact SGD, fp32, fixed micro-batches
    equal in both passes: both losses call the same verl functions on the same micro-batches), with only
    the adapter training;
  - with pack_old_log_prob_as_update (the default) under verl's default bf16 and dynamic batching at a 2:1 token
    budget, the on-policy gauge reads exactly 0 and ``path/pack_old_log_prob_as_update`` 1 in ``kl3`` and in ERC, on
    every step (the adapter at its initialisation and trained);
  - the control: the same steps with verl's own packing of the old pass (``pack_old_log_prob_as_update=false``)
    at 24/48, 24/72 and 40/80 tokens: the path reads 0 and the gauge > 0 on at least one (packing, step),
    where the aligned arm of the same packings reads exactly 0 (the kernels' noise the alignment removes:
    which packings show it depends on the machine's kernels, so the claim is "at least one");
  - the reference-policy pass verl runs on the actor's engine under LoRA (``no_lora_adapter=True``,
    between the old-log-prob pass and the update, without the update's packing key) leaves the old
    pass's packing record alone: the update still finds it aligned and the gauge reads 0; its
    log-probs are the base model's, bit for bit (a worker without the adapter, packed alike), and differ
    from the adapted policy's.

* **verl's fused kernels** (``actor_rollout_ref.model.use_fused_kernels=true``, torch backend): the
  entropy of both passes comes from verl's fused kernel (the kernel runs in both passes, the path
  records no fp32 entropy, ERC's on-policy ratio is exactly 1); the divclip ``vanilla`` loss matches
  ``ppo_loss`` bit for bit; the gauge is 0 with pack_old_log_prob_as_update in ERC and ``kl3``, and in its control
  (verl's own packing of the old pass at 24/48 and 40/80 tokens) > 0 on at least one packing. verl's fused
  forward reads ``lm_head.weight`` inside the model's root FSDP2 unit, which holds the head only when the
  embeddings are tied (verl wraps an untied head as its own unit, and the kernel then fails on a sharded
  weight whatever the loss); the test model therefore ties them, as Qwen3 0.6B-4B do.

* **The critic** (``algorithm.adv_estimator=gae``): verl's value engine (``FSDPEngineWithValueHead``)
  subclasses the engine the seam wraps. A critic worker with verl's ``value_loss`` installed as verl's
  trainer installs it computes exactly what it computes with verl's original functions put back: the same
  values, parameter update and loss, bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch

from recipe.bench.harness import (
    TinyQwen3Spec,
    WorkerOptions,
    build_actor_worker,
    compute_log_prob,
    full_params,
    make_actor_config,
    make_rollout_batch,
    ppo_loss_fn,
    save_tiny_qwen3,
    update_actor,
)
from tests.helpers import EXACT_SGD, param_delta, run_ranks
from tests.test_onpolicy import divclip_loss  # the divclip actor loss as DivClipTrainer installs it
from verl_ext.engine.swap import Swap, swapped

SPEC = TinyQwen3Spec(tie_word_embeddings=True)  # verl's fused forward under FSDP2 needs the head in the root unit
PROMPT_LENS = [3, 5, 4, 6, 2, 7, 5, 3]
RESPONSE_LENS = [12, 9, 14, 6, 10, 8, 11, 7]
GAUGE = "actor/divclip/onpolicy/"
PATH = "actor/divclip/path/"
ERC = dict(loss_mode="clip", erc_beta_low=0.05, erc_beta_high=0.05)
ON_POLICY_MODES: dict[str, dict[str, Any]] = {"kl3": dict(loss_mode="kl3"), "erc": ERC}
LORA = dict(lora_rank=8, lora_alpha=16)  # target_modules: verl's default, all linear layers but the head
FUSED = dict(use_fused_kernels=True, fused_kernels_backend="torch")
#: verl's default bf16 (mixed_precision=None), dynamic batching with the log-prob pass at twice the update's budget
#: (24/48 tokens: where verl's own packing of the old pass shows the kernels' noise under LoRA on the CPU this was
#: written on, see the control in job_lora)
BF16_DYNAMIC_2_TO_1 = dict(
    mixed_precision=None, use_dynamic_bsz=True, max_token_len_per_gpu=24, infer_max_token_len_per_gpu=48
)
#: more token budgets (update / log-prob pass) for the controls: on the 2-core CPU these were written on, verl's own
#: packing showed the noise under LoRA at 24/48 and 24/72 on the trained adapter's step (0.03125), not at 40/80;
#: with the fused kernel at every one (1e-4 to 4e-3)
LORA_CONTROL_BUDGETS = {"24/72": (24, 72), "40/80": (40, 80)}
FUSED_CONTROL_BUDGETS = {"24/48": (24, 48), "40/80": (40, 80)}
MINI_BATCH, LOADER_SEED = 4, 11  # two shuffled update mini-batches of the 8 rows


def verl_ppo_loss() -> Any:
    """verl's own ``ppo_loss`` in ``vanilla`` mode with the same clip range."""
    from verl.workers.config import PolicyLossConfig

    return ppo_loss_fn(
        make_actor_config(policy_loss=PolicyLossConfig(loss_mode="vanilla"), clip_ratio_low=0.2, clip_ratio_high=0.28)
    )


def with_old(batch: Any, old: dict[str, torch.Tensor], noise: float = 0.0, seed: int = 0) -> Any:
    """``batch`` with pi_old's log-probs and entropy; ``noise`` perturbs the log-probs so ratios spread over the
    clip band."""
    data = batch.clone()
    log_probs = old["old_log_probs"]
    if noise:
        gen = torch.Generator().manual_seed(seed)
        log_probs = torch.nested.as_nested_tensor(
            [lp + noise * torch.randn(lp.shape, generator=gen) for lp in log_probs.unbind()], layout=torch.jagged
        )
    data["old_log_probs"], data["entropy"] = log_probs, old["entropy"]
    return data


def ref_log_prob(worker: Any, batch: Any, no_lora_adapter: bool = True) -> torch.Tensor:
    """The reference pass as verl's trainer runs it on the actor's engine under LoRA
    (``trainer_base._compute_ref_log_prob`` with ``ref_in_actor``): no entropy, no loss, no update packing
    key, the adapter disabled. Returns the response-layout log-probs (nested)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    data = batch.clone()
    tu.assign_non_tensor(data, calculate_entropy=False, compute_loss=False, temperature=1.0)
    if no_lora_adapter:
        tu.assign_non_tensor(data, no_lora_adapter=True)
    return response_from_nested(worker.infer_batch(data)["log_probs"], batch["response_mask"])


def parity_run(model_path: str, options: WorkerOptions, loss: Any, batch: Any) -> dict[str, Any]:
    """Two steps (old-log-prob pass, then one update on perturbed pi_old) of a fresh worker with ``loss``."""
    torch.manual_seed(1)  # the same lora_A initialisation in every worker
    worker = build_actor_worker(model_path, options)
    worker.set_loss_fn(loss)
    initial = full_params(worker)
    deltas, metrics = [], []
    for step in range(2):
        old = compute_log_prob(worker, batch)
        before = full_params(worker)
        metrics.append(update_actor(worker, with_old(batch, old, noise=0.3, seed=step), calculate_entropy=False))
        deltas.append(param_delta(before, full_params(worker)))
    return {"initial": initial, "deltas": deltas, "metrics": metrics}


def parity_pair(model_path: str, options: WorkerOptions) -> dict[str, dict[str, Any]]:
    """:func:`parity_run` with the divclip loss in verl's ``vanilla`` mode (no engine feature asked: verl's packing)
    and with verl's ``ppo_loss``, on one batch and identically initialised workers."""
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=3)
    return {
        "divclip": parity_run(model_path, options, divclip_loss(dict(loss_mode="vanilla"), aligned=False), batch),
        "verl": parity_run(model_path, options, verl_ppo_loss(), batch),
    }


def on_policy_step(
    worker: Any,
    batch: Any,
    erc: bool,
    ref_pass: bool = False,
    aligned: bool = True,
    phase: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """One training step in the trainer's order: the old-log-prob pass with the update's packing key, the
    reference pass (``ref_pass``), then the update told it follows that pass (``aligned``; without it the
    trainer's opt-out, verl's own packing: no key, nothing to follow)."""
    from verl_ext.engine.packing import UPDATE_FOLLOWS_OLD_PASS_KEY, PackingMismatchError, UpdatePacking

    mark = phase or (lambda _name: None)
    packing = UpdatePacking(mini_batch_size=MINI_BATCH, seed=LOADER_SEED, shuffle=True) if aligned else None
    mark("old")
    old = compute_log_prob(worker, batch, packing=packing)
    ref = ref_log_prob(worker, batch) if ref_pass else None
    mark("update")
    found = {"old_log_probs": old["old_log_probs"].values(), "ref_log_probs": None if ref is None else ref.values()}
    try:
        metrics = update_actor(
            worker,
            with_old(batch, old),
            calculate_entropy=erc,
            mini_batch_size=MINI_BATCH,
            shuffle=True,
            seed=LOADER_SEED,
            extra_info={UPDATE_FOLLOWS_OLD_PASS_KEY: aligned},
        )
    except PackingMismatchError as error:  # the update found no (or another) packing record: reported by the test
        return {**found, "metrics": {}, "mismatch": str(error)}
    finally:
        mark("done")
    return {**found, "metrics": {k: [float(v) for v in vals] for k, vals in metrics.items() if isinstance(vals, list)}}


def bf16_dynamic(budgets: tuple[int, int]) -> dict[str, Any]:
    """verl's default bf16 with dynamic batching at ``budgets`` (update, log-prob pass) tokens per micro-batch."""
    return dict(
        mixed_precision=None,
        use_dynamic_bsz=True,
        max_token_len_per_gpu=budgets[0],
        infer_max_token_len_per_gpu=budgets[1],
    )


def aligned_and_control(
    model_path: str, features: dict[str, Any], budgets: tuple[int, int], batch: Any, steps: int
) -> dict[str, list[dict[str, Any]]]:
    """``steps`` kl3 steps of a fresh worker (``features`` at ``budgets``), once with pack_old_log_prob_as_update and
    once with verl's own packing of the old pass (the control), from the same initialisation."""
    out = {}
    for arm, aligned in (("aligned", True), ("control", False)):
        torch.manual_seed(1)
        worker = build_actor_worker(model_path, WorkerOptions(**features, **bf16_dynamic(budgets), **EXACT_SGD))
        worker.set_loss_fn(divclip_loss(dict(loss_mode="kl3"), aligned=aligned))
        out[arm] = [on_policy_step(worker, batch, False, aligned=aligned) for _ in range(steps)]
    return out


# ------------------------------------------------------------------------------------------------
# The jobs (one spawned rank each)
# ------------------------------------------------------------------------------------------------


def job_lora(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """LoRA (rank 8, all linear layers): the parity pair in fp32; three steps per on-policy mode under bf16 with
    dynamic batching at 2:1, the third with the reference pass; the control; the base model's log-probs."""
    out: dict[str, Any] = {"parity": parity_pair(model_path, WorkerOptions(**LORA, **EXACT_SGD))}
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=5)
    bf16 = WorkerOptions(**LORA, **BF16_DYNAMIC_2_TO_1, **EXACT_SGD)
    for name, mode in ON_POLICY_MODES.items():
        torch.manual_seed(1)
        worker = build_actor_worker(model_path, bf16)
        worker.set_loss_fn(divclip_loss(mode))
        erc = "erc_beta_low" in mode
        # the adapter at its initialisation (lora_B = 0), trained once, and trained twice with the ref pass in between
        out[name] = [
            on_policy_step(worker, batch, erc),
            on_policy_step(worker, batch, erc),
            on_policy_step(worker, batch, erc, ref_pass=True),
        ]
    # the control: the same three kl3 steps with verl's own packing of the old pass (the opt-out)
    torch.manual_seed(1)
    worker = build_actor_worker(model_path, bf16)
    worker.set_loss_fn(divclip_loss(dict(loss_mode="kl3"), aligned=False))
    out["control"] = [on_policy_step(worker, batch, False, ref_pass=step == 2, aligned=False) for step in range(3)]
    # the two arms at more token budgets (the adapter at init and trained once)
    out["packings"] = {
        name: aligned_and_control(model_path, LORA, budgets, batch, steps=2)
        for name, budgets in LORA_CONTROL_BUDGETS.items()
    }
    base = build_actor_worker(model_path, WorkerOptions(**BF16_DYNAMIC_2_TO_1, **EXACT_SGD))  # no adapter
    base.set_loss_fn(
        divclip_loss(dict(loss_mode="kl3"))
    )  # packs a keyless pass as the LoRA worker's ref pass: one in-order mini-batch
    out["base_log_probs"] = ref_log_prob(base, batch, no_lora_adapter=False).values()
    return out


@contextmanager
def counting_fused_kernel(calls: dict[str, int], phase: list[str]) -> Iterator[None]:
    """Count verl's fused linear-cross-entropy forward (log-probs and entropy from the hidden states) per phase."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    original = FusedLinearForPPO.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls[phase[0]] = calls.get(phase[0], 0) + 1
        return original(self, *args, **kwargs)

    with swapped([Swap(FusedLinearForPPO, "forward", forward, "counting the fused kernel")]):
        yield


def job_fused(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """verl's fused kernels (torch backend): the parity pair in fp32; one step per on-policy mode under bf16 with
    dynamic batching at 2:1, counting the fused kernel's calls per pass."""
    from recipe.bench.features import entropy_path_of

    out: dict[str, Any] = {"parity": parity_pair(model_path, WorkerOptions(**FUSED, **EXACT_SGD))}
    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=5)
    for name, mode in ON_POLICY_MODES.items():
        worker = build_actor_worker(model_path, WorkerOptions(**FUSED, **BF16_DYNAMIC_2_TO_1, **EXACT_SGD))
        worker.set_loss_fn(divclip_loss(mode))
        calls: dict[str, int] = {}
        phase = ["build"]
        with counting_fused_kernel(calls, phase):
            step = on_policy_step(
                worker, batch, "erc_beta_low" in mode, phase=lambda name, phase=phase: phase.__setitem__(0, name)
            )
        out[name] = {**step, "fused_calls": calls, "entropy_path": entropy_path_of(worker.engine).value}
    # the control: one kl3 step with verl's own packing of the old pass, beside the aligned arm, per token budget
    out["packings"] = {
        name: aligned_and_control(model_path, FUSED, budgets, batch, steps=1)
        for name, budgets in FUSED_CONTROL_BUDGETS.items()
    }
    return out


CRITIC_MINI_BATCH = 4


def critic_config() -> Any:
    """The critic's config as verl's trainer binds it into ``value_loss`` (fsdp2, token-mean, value clip 0.5)."""
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(
        strategy="fsdp2", ppo_mini_batch_size=CRITIC_MINI_BATCH, ppo_micro_batch_size_per_gpu=2, cliprange_value=0.5
    )


def compute_values(worker: Any, batch: Any) -> torch.Tensor:
    """The critic's pass, mirroring ``trainer_base._compute_values``: response-layout values (nested)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import response_from_nested

    data = batch.clone()
    tu.assign_non_tensor(data, compute_loss=False, temperature=1.0)
    return response_from_nested(worker.infer_batch(data)["values"], batch["response_mask"])


def update_critic(worker: Any, batch: Any) -> dict[str, Any]:
    """One critic update, mirroring ``trainer_base._update_critic`` (two mini-batches, one epoch)."""
    from verl.utils import tensordict_utils as tu

    data = batch.clone()
    tu.assign_non_tensor(
        data,
        global_batch_size=CRITIC_MINI_BATCH,
        mini_batch_size=CRITIC_MINI_BATCH,
        epochs=1,
        seed=0,
        dataloader_kwargs={"shuffle": False},
        temperature=1.0,
    )
    return dict(tu.get(worker.train_mini_batch(data), "metrics"))


def seam_wrapped() -> list[tuple[type, str]]:
    """The verl class attributes the seam wraps (docs/engine.md, "What is wrapped")."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    from verl.workers.engine_workers import TrainingWorker

    return [(TrainingWorker, name) for name in ("set_loss_fn", "train_mini_batch", "train_batch")] + [
        (FSDPEngineWithLMHead, name) for name in ("infer_batch", "forward_step")
    ]


@contextmanager
def verls_own_functions() -> Iterator[None]:
    """verl's original functions in place of the seam's wrappers for the block (each wrapper keeps verl's
    function as ``__divclip_original__``), the wrappers re-installed after it."""
    from verl_ext.engine.seam import ORIGINAL_ATTR

    with swapped(
        [
            Swap(owner, name, getattr(vars(owner)[name], ORIGINAL_ATTR), "verl's own function")
            for owner, name in seam_wrapped()
        ]
    ):
        yield


@contextmanager
def counting_seam_steps(count: list[int]) -> Iterator[None]:
    """Count the forward steps that go through the seam (its ``_forward_step``, which its wrapper calls by name)."""
    from verl_ext.engine import seam

    original = seam._forward_step

    def forward_step(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    with mock.patch.object(seam, "_forward_step", forward_step):  # a module attribute: no dispatcher, a plain patch
        yield


def job_critic(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    """Two identically initialised critic workers, one run with the seam's wrappers and one with verl's own
    functions put back: ``value_loss`` installed, the values pass, one update (two mini-batches, exact SGD)."""
    from verl.workers.utils.losses import value_loss

    from verl_ext.engine.seam import ORIGINAL_ATTR

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=7)
    gen = torch.Generator().manual_seed(9)
    returns = torch.nested.as_nested_tensor([torch.randn(n, generator=gen) for n in RESPONSE_LENS], layout=torch.jagged)
    out: dict[str, Any] = {}
    for arm in ("seam", "verl"):
        torch.manual_seed(2)  # the same value head in both arms
        worker = build_actor_worker(model_path, WorkerOptions(model_type="value_model", **EXACT_SGD))
        steps = [0]
        with verls_own_functions() if arm == "verl" else nullcontext(), counting_seam_steps(steps):
            wrapped = all(hasattr(getattr(owner, name), ORIGINAL_ATTR) for owner, name in seam_wrapped())
            worker.set_loss_fn(functools.partial(value_loss, config=critic_config()))  # as verl's trainer installs it
            values = compute_values(worker, batch)
            data = batch.clone()
            data["values"], data["returns"] = values, returns
            before = full_params(worker)
            metrics = update_critic(worker, data)
        out[arm] = {
            "engine": type(worker.engine).__name__,
            "wrapped": wrapped,
            "seam_steps": steps[0],
            "values": values.values(),
            "initial": before,
            "delta": param_delta(before, full_params(worker)),
            "metrics": {
                k: [float(v) for v in vals] if isinstance(vals, list) else float(vals) for k, vals in metrics.items()
            },
        }
    out["reinstalled"] = all(hasattr(getattr(owner, name), ORIGINAL_ATTR) for owner, name in seam_wrapped())
    return out


# ------------------------------------------------------------------------------------------------
# Fixtures and checks
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3_verl_features")), SPEC, seed=0)


@pytest.fixture(scope="module")
def lora(tiny_model: str) -> dict[str, Any]:
    return run_ranks(job_lora, 1, tiny_model)[0]


@pytest.fixture(scope="module")
def fused(tiny_model: str) -> dict[str, Any]:
    return run_ranks(job_fused, 1, tiny_model)[0]


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same parameter names, every tensor equal to the bit (names of the differing ones in the message)."""
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, different


def assert_divclip_vanilla_is_ppo_loss(parity: dict[str, dict[str, Any]]) -> None:
    """:func:`parity_pair`'s two runs: same start, bit-identical updates and loss metrics on both steps, which
    clip some tokens and move the policy."""
    ours, verl = parity["divclip"], parity["verl"]
    assert_bit_identical(ours["initial"], verl["initial"])  # both workers start from the same weights
    for step in range(2):
        assert_bit_identical(ours["deltas"][step], verl["deltas"][step])
        for key in ("loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert ours["metrics"][step][key] == verl["metrics"][step][key], (step, key)
    assert sum(map(float, verl["metrics"][0]["actor/pg_clipfrac"])) > 0  # the perturbed pi_old clips some tokens
    assert any((d != 0).any() for d in verl["deltas"][1].values())


def assert_on_policy(step: dict[str, Any], erc: bool) -> None:
    """The update ran on the old pass's packing record; the gauge of its first mini-batch reads exactly 0; every
    micro-batch was found aligned."""
    assert "mismatch" not in step, step["mismatch"]
    metrics = step["metrics"]
    assert metrics[GAUGE + "log_ratio_abs_max"] == [0.0] and metrics[GAUGE + "ratio_clipfrac"] == [0.0], metrics
    if erc:
        assert metrics[GAUGE + "erc_ratio_dev_max"] == [0.0] and metrics[GAUGE + "erc_masked_frac"] == [0.0], metrics
    assert set(metrics[PATH + "pack_old_log_prob_as_update"]) == {1.0} and set(metrics[PATH + "seam"]) == {1.0}, metrics


# --- LoRA ---------------------------------------------------------------------------------------


def test_lora_divclip_vanilla_updates_bit_identically_to_verls_ppo_loss(lora: dict[str, Any]) -> None:
    """Same micro-batches, same verl functions: the two losses' updates agree to the bit, and only the adapter moves."""
    parity = lora["parity"]
    assert_divclip_vanilla_is_ppo_loss(parity)
    delta = parity["verl"]["deltas"][1]
    adapter = {name for name in delta if "lora_" in name}
    assert adapter and all((delta[name] == 0).all() for name in delta if name not in adapter)  # only the adapter trains
    assert all((delta[name] != 0).any() for name in adapter)  # lora_A too, once lora_B has left 0


@pytest.mark.parametrize("mode", list(ON_POLICY_MODES))
def test_lora_bf16_dynamic_2_to_1_is_exactly_on_policy(lora: dict[str, Any], mode: str) -> None:
    """Every step (adapter at init, trained once, trained twice with the ref pass) is found aligned and reads 0."""
    for step in lora[mode]:
        assert_on_policy(step, erc=mode == "erc")
        assert set(step["metrics"][PATH + "entropy_fp32"]) == {1.0 if mode == "erc" else 0.0}


def assert_control_shows_the_noise(arms: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[tuple[str, int], float]:
    """Per packing, the control (verl's own packing of the old pass) is not found aligned (path 0) and its gauge
    reads, the aligned arm is exactly on-policy; over all packings and steps the control's gauge is > 0 at least
    once: the kernels' noise, which the aligned arm of the same packings does not show. Returns the control's gauges."""
    noise = {}
    for packing, arm in arms.items():
        for step, (aligned, control) in enumerate(zip(arm["aligned"], arm["control"], strict=False)):
            assert_on_policy(aligned, erc=False)
            assert "mismatch" not in control, control["mismatch"]
            assert set(control["metrics"][PATH + "pack_old_log_prob_as_update"]) == {0.0}, control["metrics"]
            noise[packing, step] = control["metrics"][GAUGE + "log_ratio_abs_max"][0]
            assert math.isfinite(noise[packing, step])
    assert max(noise.values()) > 0, noise
    return noise


def test_lora_control_verls_own_packing_shows_the_noise_the_alignment_removes(lora: dict[str, Any]) -> None:
    """With ``pack_old_log_prob_as_update=false`` the update finds no packing of the old pass as the update (path 0)
    and the gauge reads > 0 on at least one of the packings and steps (24/48 with the ref pass on its third step,
    24/72, 40/80), where the aligned kl3 arm reads exactly 0 on every one."""
    arms = {"24/48": {"aligned": lora["kl3"], "control": lora["control"]}, **lora["packings"]}
    assert_control_shows_the_noise(arms)


@pytest.mark.parametrize("mode", list(ON_POLICY_MODES))
def test_lora_reference_pass_keeps_the_packing_and_reads_the_base_model(lora: dict[str, Any], mode: str) -> None:
    """The ref pass between the old pass and the update leaves the packing record; its log-probs are the base
    model's."""
    step = lora[mode][2]  # old pass, ref pass (adapter disabled), update; the adapter trained twice before
    assert_on_policy(step, erc=mode == "erc")
    # the base model's log-probs, bit for bit: the same micro-batches (one in-order mini-batch at the update's
    # budget) through the same base weights, peft's disabled layer calling its base Linear
    assert torch.equal(step["ref_log_probs"], lora["base_log_probs"])
    assert not torch.equal(step["ref_log_probs"], step["old_log_probs"])  # the trained adapter changes pi_old


# --- fused kernels ------------------------------------------------------------------------------


def test_fused_kernels_divclip_vanilla_updates_bit_identically_to_verls_ppo_loss(fused: dict[str, Any]) -> None:
    """With the fused kernel's log-probs the two losses' updates agree to the bit (fp32, exact SGD)."""
    assert_divclip_vanilla_is_ppo_loss(fused["parity"])


@pytest.mark.parametrize("mode", list(ON_POLICY_MODES))
def test_fused_kernels_serve_both_passes_exactly_on_policy(fused: dict[str, Any], mode: str) -> None:
    """The fused kernel runs in the old pass and the update; no step takes the fp32 entropy; the gauge reads 0."""
    result = fused[mode]
    assert result["fused_calls"].get("old", 0) > 0 and result["fused_calls"].get("update", 0) > 0, result["fused_calls"]
    assert_on_policy(result, erc=mode == "erc")
    assert set(result["metrics"][PATH + "entropy_fp32"]) == {0.0}  # no pass took the fp32 entropy
    assert result["entropy_path"] == ("fused_kernel" if mode == "erc" else "verl")


def test_fused_kernels_control_verls_own_packing_shows_the_noise_the_alignment_removes(fused: dict[str, Any]) -> None:
    """The fused kernel's log-probs with verl's own packing of the old pass: path 0 and the gauge > 0 on at least
    one packing (24/48, 40/80), where the aligned arm at the same packing reads exactly 0."""
    assert_control_shows_the_noise(fused["packings"])


# --- the critic ---------------------------------------------------------------------------------


def test_the_critic_computes_the_same_with_and_without_the_seam(tiny_model: str) -> None:
    """verl's value engine under the seam's wrappers: values, update and loss bit-identical to verl's own functions."""
    result = run_ranks(job_critic, 1, tiny_model)[0]
    seam, verl = result["seam"], result["verl"]
    assert seam["engine"] == verl["engine"] == "FSDPEngineWithValueHead"
    assert seam["wrapped"] and not verl["wrapped"] and result["reinstalled"]
    assert seam["seam_steps"] > 0 and verl["seam_steps"] == 0  # the seam arm went through the seam, verl's did not
    assert_bit_identical(seam["initial"], verl["initial"])
    assert torch.equal(seam["values"], verl["values"])
    assert_bit_identical(seam["delta"], verl["delta"])
    assert any((d != 0).any() for d in verl["delta"].values())
    assert seam["metrics"]["loss"] == verl["metrics"]["loss"]
    assert seam["metrics"]["critic/vf_loss"] == verl["metrics"]["critic/vf_loss"]
