"""verl's real actor stack (TrainingWorker -> FSDPEngineWithLMHead, FSDP2 on gloo) on the CPU platform.

Each job runs in new rank processes (tests/helpers.py::run_ranks), once per module, and
the tests assert on what the ranks returned:

* 1 rank: loss finite and parameters change; remove-padding on/off give the same log-probs, entropy
  and update; the detached-entropy path (verl_ext.entropy) gives verl's entropy values, no graph,
  and the same update for a loss that uses the entropy only as a mask.
* 2 ranks: the same update as 1 rank on the whole batch, and identical parameters on both ranks.
* run_ranks itself: ranks forked from its fork server, or spawned where the environment changed.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

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
from tests.helpers import EXACT_SGD, param_delta, run_ranks, shard_for_rank

SPEC = TinyQwen3Spec()
PROMPT_LENS = [3, 5, 4, 6]
RESPONSE_LENS = [9, 4, 7, 6]
BAND = (0.9, 1.1)  # entropy-ratio band of the masking test loss
SGD = EXACT_SGD  # update = -lr * grad, so "same update" means "same gradient"


class RecordingLoss:
    """Wraps a loss function and records the current entropy it was given (values, graph or not)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entropies: list[torch.Tensor] = []
        self.entropy_had_grad: list[bool] = []

    def __call__(self, config: Any, model_output: dict, data: Any, dp_group: Any = None) -> Any:
        entropy = model_output["entropy"]
        self.entropy_had_grad.append(bool(entropy.requires_grad))
        self.entropies.append(entropy.values().detach().clone())
        return self.inner(config=config, model_output=model_output, data=data, dp_group=dp_group)


def entropy_masked_pg_loss(config: Any, model_output: dict, data: Any, dp_group: Any = None) -> Any:
    """A PPO loss that uses the current entropy only as a mask (the shape of ERC): tokens whose
    H(pi_theta)/H(pi_old) leaves BAND get no gradient. Stands in for verl_ext.actor_loss here."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    entropy = no_padding_2_padding(model_output["entropy"], data)
    config.global_batch_info.update(
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor,
    )
    padded = data.select("response_mask", "old_log_probs", "advantages", "entropy").to_padded_tensor()
    ratio = entropy.detach() / padded["entropy"].clamp_min(1e-8)
    keep = padded["response_mask"].bool() & (ratio > BAND[0]) & (ratio < BAND[1])
    pg_loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=padded["old_log_probs"],
        log_prob=log_prob,
        advantages=padded["advantages"],
        response_mask=keep,
        loss_agg_mode=config.loss_agg_mode,
        config=config,
        rollout_is_weights=None,
    )
    return pg_loss, {}


def _update(model_path: str, options: WorkerOptions, loss: Any, batch: Any, detached: bool = False) -> dict:
    """Fresh worker from the checkpoint, one update; returns metrics, update and the recorded entropy."""
    from verl_ext.engine import seam
    from verl_ext.engine.request import entropy_as_mask

    worker = build_actor_worker(model_path, options)
    recorder = RecordingLoss(loss)
    loss_fn: Any = functools.partial(recorder, config=make_actor_config())
    if detached:
        seam.install()
        loss_fn = entropy_as_mask(loss_fn)
    worker.set_loss_fn(loss_fn)
    before = full_params(worker)
    metrics = update_actor(worker, batch, calculate_entropy=True)
    return {
        "metrics": metrics,
        "delta": param_delta(before, full_params(worker)),
        "entropy": torch.cat(recorder.entropies),
        "entropy_had_grad": recorder.entropy_had_grad,
    }


def job_single_rank(rank: int, world_size: int, model_path: str) -> dict[str, Any]:
    from verl.workers.utils.losses import ppo_loss

    batch = make_rollout_batch(PROMPT_LENS, RESPONSE_LENS, SPEC.vocab_size, seed=1)
    out: dict[str, Any] = {}

    # Default verl actor: AdamW, verl's ppo_loss.
    worker = build_actor_worker(model_path, WorkerOptions())
    worker.set_loss_fn(ppo_loss_fn(make_actor_config()))
    before = full_params(worker)
    out["adamw_metrics"] = update_actor(worker, batch, calculate_entropy=True)
    out["adamw_delta"] = param_delta(before, full_params(worker))

    # pi_old from the model itself, then a pi_old entropy scaled so part of the tokens leave BAND.
    olds = {}
    for rmpad in (True, False):
        w = build_actor_worker(model_path, WorkerOptions(use_remove_padding=rmpad, **SGD))
        olds[rmpad] = compute_log_prob(w, batch)
    out["old_rmpad"] = {k: v.values() for k, v in olds[True].items()}
    out["old_padded"] = {k: v.values() for k, v in olds[False].items()}
    gen = torch.Generator().manual_seed(7)
    scale = [0.8 + 0.4 * torch.rand(n, generator=gen) for n in RESPONSE_LENS]
    batch["old_log_probs"] = olds[True]["old_log_probs"]
    batch["entropy"] = torch.nested.as_nested_tensor(
        [e * s for e, s in zip(olds[True]["entropy"].unbind(), scale, strict=False)], layout=torch.jagged
    )
    out["mask_batch"] = batch

    for rmpad in (True, False):
        opts = WorkerOptions(use_remove_padding=rmpad, **SGD)
        out[f"ppo_rmpad{rmpad}"] = _update(model_path, opts, ppo_loss, batch)
        out[f"masked_rmpad{rmpad}"] = _update(model_path, opts, entropy_masked_pg_loss, batch)
        out[f"masked_detached_rmpad{rmpad}"] = _update(model_path, opts, entropy_masked_pg_loss, batch, detached=True)
    # verl's chunked entropy option must not change what the detached path computes either.
    chunked = WorkerOptions(entropy_from_logits_with_chunking=True, **SGD)
    out["masked_detached_chunked"] = _update(model_path, chunked, entropy_masked_pg_loss, batch, detached=True)
    return out


def job_two_ranks(rank: int, world_size: int, model_path: str, batch: Any) -> dict[str, Any]:
    from verl.workers.utils.losses import ppo_loss

    out = {}
    for name, loss, detached in (("ppo", ppo_loss, False), ("masked_detached", entropy_masked_pg_loss, True)):
        res = _update(model_path, WorkerOptions(**SGD), loss, shard_for_rank(batch, rank, world_size), detached)
        out[name] = {"delta": res["delta"], "metrics": res["metrics"], "entropy_had_grad": res["entropy_had_grad"]}
    return out


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_qwen3(Path(tmp_path_factory.mktemp("tiny_qwen3")), SPEC, seed=0)


@pytest.fixture(scope="module")
def single(model_path: str) -> dict[str, Any]:
    return run_ranks(job_single_rank, 1, model_path)[0]


@pytest.fixture(scope="module")
def two(model_path: str, single: dict[str, Any]) -> list[dict[str, Any]]:
    return run_ranks(job_two_ranks, 2, model_path, single["mask_batch"])


def _assert_same_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _changed(delta: dict[str, torch.Tensor]) -> int:
    return sum(int((d != 0).any()) for d in delta.values())


def test_one_rank_update_is_finite_and_moves_parameters(single: dict[str, Any]) -> None:
    metrics = single["adamw_metrics"]
    for key in ("loss", "grad_norm", "actor/pg_loss"):
        assert all(math.isfinite(float(v)) for v in metrics[key]), (key, metrics[key])
    assert float(metrics["grad_norm"][0]) > 0
    delta = single["adamw_delta"]
    assert all(torch.isfinite(d).all() for d in delta.values())
    # every trained tensor moves: the batch touches all layers and some embedding rows
    assert _changed(delta) == len(delta), [k for k, d in delta.items() if not (d != 0).any()]


def test_remove_padding_does_not_change_log_probs_entropy_or_update(single: dict[str, Any]) -> None:
    for key in ("old_log_probs", "entropy"):
        torch.testing.assert_close(single["old_rmpad"][key], single["old_padded"][key], rtol=1e-5, atol=1e-5)
    for loss in ("ppo", "masked"):
        a, b = single[f"{loss}_rmpadTrue"], single[f"{loss}_rmpadFalse"]
        assert _changed(a["delta"]) > 0
        _assert_same_delta(a["delta"], b["delta"], atol=1e-6)
        assert float(a["metrics"]["loss"][0]) == pytest.approx(float(b["metrics"]["loss"][0]), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("rmpad", [True, False])
def test_detached_entropy_matches_verl_values_without_a_graph(single: dict[str, Any], rmpad: bool) -> None:
    verl_path, detached = single[f"masked_rmpad{rmpad}"], single[f"masked_detached_rmpad{rmpad}"]
    assert all(verl_path["entropy_had_grad"]), "verl's path should compute the entropy with autograd"
    assert not any(detached["entropy_had_grad"]), "the detached path must not build an entropy graph"
    torch.testing.assert_close(detached["entropy"], verl_path["entropy"].float(), rtol=1e-5, atol=1e-5)
    # the same entropy as the pi_old pass (same weights, forward only)
    on_response = _response_positions()
    torch.testing.assert_close(verl_path["entropy"][on_response], single["old_rmpad"]["entropy"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rmpad", [True, False])
def test_detached_entropy_mask_gives_verls_update(single: dict[str, Any], rmpad: bool) -> None:
    verl_path, detached = single[f"masked_rmpad{rmpad}"], single[f"masked_detached_rmpad{rmpad}"]
    # the scaled pi_old entropy puts some but not all tokens outside the band: the mask is real
    on_response = _response_positions()
    ratio = verl_path["entropy"][on_response] / single["mask_batch"]["entropy"].values()
    inside = ((ratio > BAND[0]) & (ratio < BAND[1])).float().mean().item()
    assert 0.1 < inside < 0.9, inside
    _assert_same_delta(detached["delta"], verl_path["delta"], atol=1e-7)
    # and the mask matters: the update differs from plain PPO on the same batch
    ppo = single[f"ppo_rmpad{rmpad}"]["delta"]
    assert any(not torch.allclose(ppo[k], verl_path["delta"][k], atol=1e-6) for k in ppo)


def _response_positions() -> torch.Tensor:
    """Boolean mask over the engine's flat per-position outputs selecting the response predictions:
    response token j of a sample with prompt length p is predicted at position p + j - 1."""
    parts = []
    for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=False):
        m = torch.zeros(p + r, dtype=torch.bool)
        m[p - 1 : p - 1 + r] = True
        parts.append(m)
    return torch.cat(parts)


def test_detached_entropy_respects_verl_chunking_option(single: dict[str, Any]) -> None:
    a, b = single["masked_detached_chunked"], single["masked_detached_rmpadTrue"]
    torch.testing.assert_close(a["entropy"], b["entropy"], rtol=1e-6, atol=1e-6)
    _assert_same_delta(a["delta"], b["delta"], atol=1e-7)


def test_two_ranks_match_one_rank_and_each_other(single: dict[str, Any], two: list[dict[str, Any]]) -> None:
    rank0, rank1 = two
    for name, reference in (("ppo", single["ppo_rmpadTrue"]), ("masked_detached", single["masked_detached_rmpadTrue"])):
        _assert_same_delta(rank0[name]["delta"], rank1[name]["delta"], atol=0.0)
        assert _changed(rank0[name]["delta"]) > 0
        _assert_same_delta(rank0[name]["delta"], reference["delta"], atol=1e-6)
        assert all(math.isfinite(float(v)) for v in rank0[name]["metrics"]["loss"])
    assert not any(rank0["masked_detached"]["entropy_had_grad"] + rank1["masked_detached"]["entropy_had_grad"])


def job_rendezvous(rank: int, world_size: int) -> dict[str, Any]:
    """Join the ranks' process group as verl does (``env://``) and sum the ranks."""
    import os

    torch.distributed.init_process_group("gloo")
    total = torch.tensor([float(rank)])
    torch.distributed.all_reduce(total)
    return {"sum": float(total), "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}


def test_ranks_rendezvous_on_the_store_the_caller_serves() -> None:
    """run_ranks binds the rendezvous port itself (a store it serves while the ranks run) and the ranks join it as
    clients: no port is found free in one process and bound in another (test_two_ranks_match_one_rank once lost
    that race to EADDRINUSE). A rank that tried to bind the caller's port would fail here."""
    assert run_ranks(job_rendezvous, 2) == [{"sum": 1.0, "agent_store": "True"}] * 2


# run_ranks' fork server: ranks forked from a server that imported torch and verl once, spawned where the caller's
# environment changed since that server started; either way a fresh process per rank.

_PROBE_VAR = "DIVCLIP_TEST_RUN_RANKS_PROBE"


def job_process_facts(rank: int, world_size: int) -> dict[str, Any]:
    import os
    import sys

    import recipe.bench.harness as harness

    first = not hasattr(harness, "_probe_mark")
    harness._probe_mark = True  # a later job sees this only if its process were reused
    return {
        "pid": os.getpid(),
        "parent": os.getppid(),
        "verl_loaded": "verl" in sys.modules,
        "probe": os.environ.get(_PROBE_VAR),
        "first": first,
    }


def test_ranks_fork_from_a_server_started_under_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    forked = run_ranks(job_process_facts, 2)
    again = run_ranks(job_process_facts, 1)
    server = forked[0]["parent"]
    # forked from one server (not this process), fresh processes every call, nothing kept from the last job
    assert {r["parent"] for r in forked + again} == {server} != {os.getpid()}
    assert len({r["pid"] for r in forked + again}) == 3 and all(r["first"] for r in forked + again)
    assert all(r["verl_loaded"] and r["probe"] is None for r in forked + again)
    monkeypatch.setenv(_PROBE_VAR, "changed")
    changed = run_ranks(job_process_facts, 2)
    # a changed environment: a new server, started from this process under it, and its ranks see the change
    new_server = changed[0]["parent"]
    assert {r["parent"] for r in changed} == {new_server} and new_server not in (server, os.getpid())
    assert {r["probe"] for r in changed} == {"changed"}
    assert run_ranks(job_process_facts, 1)[0]["parent"] == new_server  # the same environment: the same server
    monkeypatch.delenv(_PROBE_VAR)
    back = run_ranks(job_process_facts, 1)[0]
    assert back["probe"] is None and back["parent"] not in (new_server, os.getpid())


def test_ranks_spawn_after_a_change_where_the_fork_server_cannot_be_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    from multiprocessing import forkserver

    from tests import helpers

    class Server:  # a fork server as CPython's, its stops counted
        stops = 0

        def _stop(self) -> None:
            Server.stops += 1

    started = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    monkeypatch.setattr(helpers, "_fork_server_env", started)
    monkeypatch.setattr(forkserver, "_forkserver", Server())
    assert helpers._start_method() == "forkserver" and Server.stops == 0  # the same environment: the same server
    monkeypatch.setenv(_PROBE_VAR, "changed")
    assert helpers._start_method() == "forkserver" and Server.stops == 1  # changed: that server stopped, a new one
    assert helpers._fork_server_env == {**started, _PROBE_VAR: "changed"}
    monkeypatch.setattr(forkserver, "_forkserver", object())  # a Python whose server has no _stop
    monkeypatch.setenv(_PROBE_VAR, "changed again")
    # every call, as the env stays changed
    assert helpers._start_method() == "spawn" and helpers._start_method() == "spawn"
    assert helpers._fork_server_env[_PROBE_VAR] == "changed"  # the server it cannot stop is still the one recorded
