"""The ``hf_cpu`` rollout backend and the Ray CPU resource check, in isolation (no trainer).

* Sampling and batched generation (``generate_batch``): greedy batched generation with left
  padding and a KV cache equals a cache-free token-by-token reference for every prompt; the
  returned log-probs are the model's; top-k / top-p / temperature masks; EOS and max_tokens.
* ``HFCpuServer`` driven directly in asyncio (no Ray): concurrent requests are batched, outputs
  follow verl's ``TokenOutput`` contract, bad sampling params fail loudly.
* Partial rollout, as verl's async trainers drive it: a batch stops at a token boundary; an abort hands
  each waiting request its tokens so far, their log-probs and the weight version; requests wait while
  generation is paused (or are rejected at once after ``reject_request=True``); a request parked during a
  weight update generates with the new weights and reports their version; verl's own
  ``FullyAsyncLLMServerClient`` merges a rollout aborted at version 5 and finished at version 6.
* Weight sync through the real Ray path: a server launched by ``HFCpuReplica.launch_servers``
  on a local (loopback) Ray, and ``HFCpuServerAdapter.update_weights`` fed a weight generator
  as ``ActorRolloutRefWorker.update_weights`` feeds it: the server ends with exactly the sent
  weights, and its greedy outputs change.
* Registration in verl's registries, and ``enable_cpu_ray`` (no-op off the cpu platform, the
  CPU-count check on it, signature guard).

Runs in well under 2 minutes on 2 cores (the Ray test starts a 2-CPU local cluster once; the
partial-rollout tests take ~5 s).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from recipe.smoke.task import build_tokenizer, save_model_and_tokenizer  # noqa: E402
from verl_ext.cpu import rollout as hf_cpu  # noqa: E402
from verl_ext.cpu import server as hf_server  # noqa: E402
from verl_ext.cpu.rollout import register_cpu_rollout  # noqa: E402
from verl_ext.cpu.sampling import (  # noqa: E402
    SamplingSpec,
    generate_batch,
    process_logits,
    sampling_spec_from_params,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_model_and_tokenizer(tmp_path_factory.mktemp("hf_cpu") / "model")


@pytest.fixture(scope="module")
def model(model_dir: str) -> torch.nn.Module:
    return hf_server.load_hf_model(model_dir, "float32")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


def _prompt(tokenizer: Any, digits: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": digits}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _rollout_config(**overrides: Any) -> Any:
    from verl.workers.config import RolloutConfig

    kwargs: dict[str, Any] = dict(
        name="hf_cpu", tensor_model_parallel_size=1, prompt_length=16, response_length=8, dtype="float32"
    )
    kwargs.update(overrides)
    return RolloutConfig(**kwargs)


def _model_config(model_dir: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create({"path": model_dir})


# ----------------------------------------------------------------------------------------------
# Sampling and generation
# ----------------------------------------------------------------------------------------------


def test_sampling_params_follow_vllm_conventions() -> None:
    spec = sampling_spec_from_params(
        {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
    )
    assert spec.greedy and spec.top_k == -1 and not spec.want_logprobs
    spec = sampling_spec_from_params({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "logprobs": True, "max_tokens": 3})
    assert (spec.temperature, spec.top_p, spec.top_k, spec.want_logprobs) == (0.7, 0.9, 5, True)
    with pytest.raises(NotImplementedError, match="stop"):
        sampling_spec_from_params({"temperature": 1.0, "stop": ["x"]})
    with pytest.raises(ValueError, match="top_p"):
        sampling_spec_from_params({"top_p": 0.0})


def test_process_logits_masks_top_k_and_top_p() -> None:
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(process_logits(logits, SamplingSpec(temperature=1.0, top_k=2)))
    assert kept.tolist() == [[True, True, False, False, False]]
    probs = torch.softmax(logits, -1)[0]  # 0.64, 0.24, 0.09, ...
    kept = torch.isfinite(process_logits(logits, SamplingSpec(temperature=1.0, top_p=float(probs[0]) + 1e-3)))
    assert kept.tolist() == [[True, True, False, False, False]]
    kept = torch.isfinite(process_logits(logits, SamplingSpec(temperature=1.0, top_p=0.01)))
    assert kept.tolist() == [[True, False, False, False, False]]  # the top token always stays
    scaled = process_logits(logits, SamplingSpec(temperature=2.0))
    assert torch.allclose(scaled, logits / 2)


def _reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Cache-free, unpadded greedy decoding (the definition the batched path must match)."""
    ids = list(prompt)
    out, logps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            out.append(token)
            logps.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return out, logps


def test_batched_greedy_matches_unbatched_reference(model: torch.nn.Module, tokenizer: Any) -> None:
    # prompts of different lengths: exercises left padding, position ids and the KV cache
    prompts = [_prompt(tokenizer, d) for d in ("7", "4071", "123456", "99")]
    results = generate_batch(
        model,
        prompts,
        [6] * len(prompts),
        SamplingSpec(temperature=0.0, want_logprobs=True),
        eos_ids=[],
        pad_id=tokenizer.pad_token_id,
        logprobs_mode="raw_logprobs",
    )
    for prompt, (tokens, logps, finish) in zip(prompts, results, strict=True):
        ref_tokens, ref_logps = _reference_greedy(model, prompt, 6)
        assert tokens == ref_tokens
        assert logps == pytest.approx(ref_logps, abs=1e-4)
        assert finish == "length"


def test_sampled_logprobs_are_the_models(model: torch.nn.Module, tokenizer: Any) -> None:
    prompt = _prompt(tokenizer, "4071")
    gen = torch.Generator().manual_seed(0)
    [(tokens, logps, _)] = generate_batch(
        model,
        [prompt],
        [5],
        SamplingSpec(temperature=1.0, want_logprobs=True),
        eos_ids=[],
        pad_id=tokenizer.pad_token_id,
        generator=gen,
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    expected = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
    assert logps == pytest.approx(expected.tolist(), abs=1e-4)


def test_eos_and_max_tokens(model: torch.nn.Module, tokenizer: Any) -> None:
    prompt = _prompt(tokenizer, "55")
    [(greedy, _, _)] = generate_batch(model, [prompt], [6], SamplingSpec(temperature=0.0), eos_ids=[], pad_id=0)
    eos = greedy[2]  # declare the 3rd greedy token an EOS id: generation must stop right there
    first = greedy.index(eos)
    [(tokens, logps, finish)] = generate_batch(
        model, [prompt], [6], SamplingSpec(temperature=0.0), eos_ids=[eos], pad_id=0
    )
    assert tokens == greedy[: first + 1] and finish == "stop" and logps is None
    [(tokens, _, finish)] = generate_batch(
        model, [prompt], [6], SamplingSpec(temperature=0.0), eos_ids=[eos], pad_id=0, ignore_eos=True
    )
    assert tokens == greedy and finish == "length"
    results = generate_batch(model, [prompt, prompt], [2, 4], SamplingSpec(temperature=0.0), eos_ids=[], pad_id=0)
    assert [len(t) for t, _, _ in results] == [2, 4]


# ----------------------------------------------------------------------------------------------
# The server, without Ray
# ----------------------------------------------------------------------------------------------


def test_server_batches_concurrent_requests(model_dir: str, tokenizer: Any) -> None:
    from verl.workers.rollout.replica import RolloutMode, TokenOutput

    server = hf_server.HFCpuServer(
        _rollout_config(calculate_log_probs=True), _model_config(model_dir), RolloutMode.HYBRID, 0
    )
    prompt = _prompt(tokenizer, "4071")
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def run() -> list[TokenOutput]:
        await server.set_global_steps(3)
        return await asyncio.gather(
            *[server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id=str(i)) for i in range(32)]
        )

    outputs = asyncio.run(run())
    assert server.stats["requests"] == 32 and server.stats["batches"] <= 2  # one wave, batched
    for out in outputs:
        assert 1 <= len(out.token_ids) <= 8  # response_length
        assert len(out.log_probs) == len(out.token_ids)
        assert out.stop_reason == "completed" and out.extra_fields["global_steps"] == 3
        if len(out.token_ids) < 8:
            assert out.token_ids[-1] in server.eos_ids
    assert len({tuple(o.token_ids) for o in outputs}) > 1  # sampled, not greedy

    async def bad() -> None:
        await server.generate(prompt_ids=prompt, sampling_params={"temperature": 1.0, "n": 2})

    with pytest.raises(NotImplementedError):
        asyncio.run(bad())


def test_server_honours_a_request_max_tokens_above_response_length(model_dir: str, tokenizer: Any) -> None:
    """Per-benchmark validation lengths (recipe.validation.length) send max_tokens above
    rollout.response_length (8 here); the server serves it, within max_model_len."""
    from verl.workers.rollout.replica import RolloutMode

    server = hf_server.HFCpuServer(
        _rollout_config(ignore_eos=True, max_model_len=40), _model_config(model_dir), RolloutMode.HYBRID, 0
    )
    prompt = _prompt(tokenizer, "4071")
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}

    async def run() -> list[list[int]]:
        outs = await asyncio.gather(
            server.generate(prompt_ids=prompt, sampling_params=dict(greedy), request_id="default"),
            server.generate(prompt_ids=prompt, sampling_params={**greedy, "max_tokens": 20}, request_id="long"),
            server.generate(prompt_ids=prompt, sampling_params={**greedy, "max_tokens": 1000}, request_id="room"),
        )
        return [o.token_ids for o in outs]

    default, long, room = asyncio.run(run())
    assert len(default) == 8 and len(long) == 20 and long[:8] == default
    assert len(room) == 40 - len(prompt)  # max_model_len - prompt, as vLLM's server clamps


def test_greedy_requests_leave_the_sampling_stream_alone(model: torch.nn.Module, tokenizer: Any) -> None:
    """The server draws every sampled token from one generator, so sampled validation shifts the
    draws of later training rollouts; greedy validation (val_kwargs.temperature=0, the CPU smoke's)
    draws nothing, so training samples are the same at any validation length."""
    prompt = _prompt(tokenizer, "4071")
    gen = torch.Generator().manual_seed(7)
    before = gen.get_state().clone()
    generate_batch(
        model, [prompt] * 3, [12, 12, 16], SamplingSpec(temperature=0.0), eos_ids=[], pad_id=0, generator=gen
    )
    assert torch.equal(gen.get_state(), before)
    generate_batch(model, [prompt], [4], SamplingSpec(temperature=1.0), eos_ids=[], pad_id=0, generator=gen)
    assert not torch.equal(gen.get_state(), before)


# ----------------------------------------------------------------------------------------------
# Partial rollout: abort, pause, resume with new weights (what verl's async trainers need)
# ----------------------------------------------------------------------------------------------

GREEDY_WITH_LOGPROBS = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": True}


def test_generate_batch_stops_at_a_token_boundary(model: torch.nn.Module, tokenizer: Any) -> None:
    prompts = [_prompt(tokenizer, "4071"), _prompt(tokenizer, "55")]
    asked = []

    def stop_before_the_fourth_step() -> bool:
        asked.append(1)
        return len(asked) > 3

    results = generate_batch(
        model,
        prompts,
        [8, 2],
        SamplingSpec(temperature=0.0, want_logprobs=True),
        eos_ids=[],
        pad_id=0,
        logprobs_mode="raw_logprobs",
        should_stop=stop_before_the_fourth_step,
    )
    (tokens, logps, finish), (short, _, short_finish) = results
    ref_tokens, ref_logps = _reference_greedy(model, prompts[0], 3)
    assert (tokens, finish) == (ref_tokens, "abort") and logps == pytest.approx(ref_logps, abs=1e-4)
    assert len(short) == 2 and short_finish == "length"  # finished before the stop: complete, not aborted


def _server(model_dir: str, **config: Any) -> Any:
    from verl.workers.rollout.replica import RolloutMode

    return hf_server.HFCpuServer(
        _rollout_config(ignore_eos=True, **config), _model_config(model_dir), RolloutMode.STANDALONE, 0
    )


def _hold_decoding_at_step(server: Any, step: int) -> threading.Event:
    """Make the server's ``step``-th forward pass (the one sampling token ``step``) wait until an abort asks
    the batch to stop, so that the abort lands after exactly ``step`` tokens. Returns the event set on arrival."""
    arrived = threading.Event()
    forward = server.model.forward
    calls = []

    def held_forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == step:
            arrived.set()
            assert server._stop_decoding.wait(timeout=30), "no abort arrived"
        return forward(*args, **kwargs)

    server.model.forward = held_forward
    return arrived


async def _until(event: threading.Event) -> None:
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError("the server never reached the held decoding step")


def _perturbed_weights(model_dir: str, seed: int) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """New weights (and a model holding them) as an actor update would produce."""
    torch.manual_seed(seed)
    new_model = hf_server.load_hf_model(model_dir, "float32")
    weights = {
        k: v + 0.5 * torch.randn_like(v) if v.is_floating_point() else v for k, v in new_model.state_dict().items()
    }
    new_model.load_state_dict(weights)
    return weights, new_model


async def _load_weights(server: Any, weights: dict[str, torch.Tensor], global_steps: int) -> None:
    await server.begin_weight_update()
    await server.load_weight_bucket(list(weights.items()))
    await server.finish_weight_update(global_steps)


def test_abort_returns_partial_tokens_logprobs_and_version(
    model_dir: str, model: torch.nn.Module, tokenizer: Any
) -> None:
    server = _server(model_dir)
    prompt = _prompt(tokenizer, "4071")
    arrived = _hold_decoding_at_step(server, 3)

    async def run() -> tuple[Any, dict[str, Any]]:
        await server.set_global_steps(5)
        request = asyncio.create_task(
            server.generate(
                prompt_ids=prompt, sampling_params={**GREEDY_WITH_LOGPROBS, "max_tokens": 8}, request_id="r0"
            )
        )
        await _until(arrived)
        aborted = await server.abort_all_requests()
        assert request.done()  # every in-flight request has its answer when the abort returns
        return request.result(), aborted

    output, aborted = asyncio.run(run())
    ref_tokens, ref_logps = _reference_greedy(model, prompt, 3)
    assert output.token_ids == ref_tokens and output.log_probs == pytest.approx(ref_logps, abs=1e-4)
    assert output.stop_reason == "aborted" and output.extra_fields["global_steps"] == 5
    assert aborted == {"aborted_count": 1, "request_ids": ["r0"]}
    assert server.get_stats()["aborted_requests"] == 1


def test_requests_wait_while_paused_and_are_rejected_when_asked(model_dir: str, tokenizer: Any) -> None:
    server = _server(model_dir)
    prompt = _prompt(tokenizer, "123")
    params = {**GREEDY_WITH_LOGPROBS, "max_tokens": 4}

    async def run() -> tuple[Any, Any, Any, Any]:
        assert await server.abort_all_requests() == {"aborted_count": 0, "request_ids": []}
        parked = asyncio.create_task(server.generate(prompt_ids=prompt, sampling_params=dict(params)))
        await asyncio.sleep(0.3)
        assert not parked.done()  # waits for resume_generation
        await server.resume_generation()
        completed = await asyncio.wait_for(parked, timeout=30)
        await server.abort_all_requests()
        parked_then_rejected = asyncio.create_task(server.generate(prompt_ids=prompt, sampling_params=dict(params)))
        await asyncio.sleep(0.1)
        await server.abort_all_requests(reject_request=True)  # the server leaves rotation (separate_async)
        rejected = await asyncio.wait_for(server.generate(prompt_ids=prompt, sampling_params=dict(params)), timeout=1)
        parked_then_rejected = await asyncio.wait_for(parked_then_rejected, timeout=1)
        await server.resume_generation()  # a resume restores admission
        after = await asyncio.wait_for(server.generate(prompt_ids=prompt, sampling_params=dict(params)), timeout=30)
        return completed, rejected, parked_then_rejected, after

    completed, rejected, parked_then_rejected, after = asyncio.run(run())
    assert completed.stop_reason == "completed" and len(completed.token_ids) == 4
    for output in (rejected, parked_then_rejected):
        assert output.stop_reason == "aborted" and output.token_ids == [] and output.log_probs == []
        assert output.extra_fields["global_steps"] is None  # no tokens, no version
    assert after.token_ids == completed.token_ids
    assert server.get_stats()["rejected_requests"] == 2


def test_a_request_parked_during_a_weight_update_uses_the_new_weights(model_dir: str, tokenizer: Any) -> None:
    server = _server(model_dir)
    prompt = _prompt(tokenizer, "98765")
    new_weights, new_model = _perturbed_weights(model_dir, seed=2)

    async def run() -> Any:
        await server.set_global_steps(5)
        await server.abort_all_requests()
        parked = asyncio.create_task(
            server.generate(prompt_ids=prompt, sampling_params={**GREEDY_WITH_LOGPROBS, "max_tokens": 6})
        )
        await asyncio.sleep(0.1)
        await _load_weights(server, new_weights, global_steps=6)
        await server.resume_generation()
        return await asyncio.wait_for(parked, timeout=30)

    output = asyncio.run(run())
    new_tokens, new_logps = _reference_greedy(new_model, prompt, 6)
    assert output.token_ids == new_tokens and output.log_probs == pytest.approx(new_logps, abs=1e-4)
    assert output.extra_fields["global_steps"] == 6


def test_fully_async_client_merges_a_rollout_across_a_weight_update(
    model_dir: str, model: torch.nn.Module, tokenizer: Any
) -> None:
    """verl's FullyAsyncLLMServerClient (its abort/resume loop, unchanged) against the server: the rollout is
    aborted after 3 tokens, the weights change while generation is paused, and the client's re-sent request
    continues from prompt + partial with the new weights; one response of 8 tokens spans versions 5..6."""
    from omegaconf import OmegaConf
    from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient

    server = _server(model_dir)
    prompt = _prompt(tokenizer, "4071")
    new_weights, new_model = _perturbed_weights(model_dir, seed=3)
    arrived = _hold_decoding_at_step(server, 3)

    class ClientOfOneServer(FullyAsyncLLMServerClient):
        """The load balancer replaced by the one server (no Ray); the resume loop is verl's."""

        async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
            return "hf_cpu-replica-0", SimpleNamespace(
                generate=SimpleNamespace(remote=lambda **kw: server.generate(**kw))
            )

        def _release_server(self, server_id: str, request_id: Any = None) -> None:
            return None

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "hf_cpu", "response_length": 8}}})
    client = ClientOfOneServer(config=config)

    async def run() -> Any:
        await server.set_global_steps(5)
        rollout = asyncio.create_task(
            client.generate("sample-0", prompt_ids=prompt, sampling_params=dict(GREEDY_WITH_LOGPROBS))
        )
        await _until(arrived)
        await server.abort_all_requests()  # colocate_async's on_sample_end
        await _load_weights(server, new_weights, global_steps=6)  # on_step_end: naive weight sync...
        await server.resume_generation()  # ...then resume_generation_replicas
        return await asyncio.wait_for(rollout, timeout=60)

    output = asyncio.run(run())
    old_tokens, old_logps = _reference_greedy(model, prompt, 3)
    new_tokens, new_logps = _reference_greedy(new_model, prompt + old_tokens, 5)
    assert output.token_ids == old_tokens + new_tokens
    assert output.log_probs == pytest.approx(old_logps + new_logps, abs=1e-4)
    assert new_tokens != _reference_greedy(model, prompt + old_tokens, 5)[0]  # the new weights did change the rest
    assert output.extra_fields["min_global_steps"] == 5 and output.extra_fields["max_global_steps"] == 6
    assert output.extra_fields["global_steps"] == 6 and output.stop_reason == "length"


# ----------------------------------------------------------------------------------------------
# Weight sync through Ray (replica -> server actor; adapter -> server), as in the trainer
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def local_ray() -> Any:
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is already initialised in this process")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(_ROOT)}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def test_weight_sync_changes_rollout_outputs(
    local_ray: Any, model_dir: str, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    register_cpu_rollout()
    replica = hf_cpu.HFCpuReplica(
        replica_rank=0, config=_rollout_config(), model_config=_model_config(model_dir), gpus_per_node=1
    )
    asyncio.run(replica.init_hybrid(SimpleNamespace(workers=[])))  # no actor workers: server on this node
    server = replica.server_handle
    assert replica.server_address.startswith("hf_cpu-replica-0")

    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "logprobs": False}
    prompts = [_prompt(tokenizer, d) for d in ("4071", "123", "98765")]

    def outputs() -> list[list[int]]:
        return [
            local_ray.get(server.generate.remote(prompt_ids=p, sampling_params=dict(greedy))).token_ids for p in prompts
        ]

    before = outputs()
    assert before == outputs()  # greedy is deterministic

    # new weights, streamed the way ActorRolloutRefWorker.update_weights streams the engine's
    new_weights, _ = _perturbed_weights(model_dir, seed=1)

    monkeypatch.setenv("RANK", "0")
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import HFModelConfig

    # in the actor worker the adapter gets the dataclass (ActorRolloutRefWorker.init_model)
    hf_model_config = omega_conf_to_dataclass(_model_config(model_dir), dataclass_type=HFModelConfig)
    adapter = hf_cpu.HFCpuServerAdapter(config=_rollout_config(), model_config=hf_model_config, device_mesh=None)
    assert adapter.replica_rank == 0 and adapter.is_leader_rank

    async def sync() -> None:
        await adapter.release()
        await adapter.resume(tags=["weights"])
        await adapter.update_weights(((k, v) for k, v in new_weights.items()), global_steps=7)

    asyncio.run(sync())
    synced = local_ray.get(server.get_weights.remote())
    assert set(synced) == set(new_weights)
    for name, tensor in new_weights.items():
        assert torch.equal(synced[name], tensor), name
    stats = local_ray.get(server.get_stats.remote())
    assert stats["weight_updates"] == 1 and stats["global_steps"] == 7
    after = outputs()
    assert after != before

    # a weight the rollout model does not have is an error, not a silent skip
    async def bad_sync() -> None:
        await adapter.update_weights(iter([("model.nonexistent.weight", torch.zeros(1))]))

    with pytest.raises(Exception, match="nonexistent"):
        asyncio.run(bad_sync())


# ----------------------------------------------------------------------------------------------
# Registration and the Ray CPU resource check
# ----------------------------------------------------------------------------------------------


def test_registered_where_verl_looks() -> None:
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    register_cpu_rollout()
    register_cpu_rollout()  # idempotent
    assert get_rollout_replica_class("hf_cpu") is hf_cpu.HFCpuReplica
    assert get_rollout_class("hf_cpu", "async") is hf_cpu.HFCpuServerAdapter


def test_enable_cpu_ray_only_on_cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.single_controller.ray.base import ResourcePoolManager

    from verl_ext.cpu import ray_resources

    monkeypatch.delenv("VERL_PLATFORM", raising=False)
    assert ray_resources.enable_cpu_ray() is False
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    assert ray_resources.enable_cpu_ray() is True and ray_resources.enable_cpu_ray() is True
    assert getattr(ResourcePoolManager._check_resource_available, "__verl_ext_cpu__", False)


def test_cpu_resource_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pools' device slots come from the ``cpu_device`` resource, one node per node entry, each slot's
    bundle with max_colocate_count CPUs, one CPU spare; every refusal says how to fix it."""
    import ray

    from verl_ext.cpu import DEVICE_RESOURCE, ray_resources

    def nodes(*resources: dict[str, float]) -> None:
        monkeypatch.setattr(
            ray._private.state, "available_resources_per_node", lambda: {f"n{i}": r for i, r in enumerate(resources)}
        )

    one_node = SimpleNamespace(resource_pool_spec={"global_pool": [2]}, max_colocate_count=3)
    assert ray_resources.required_cpus(one_node.resource_pool_spec, 3) == 7
    nodes({"CPU": 16.0})  # no device resource: a Ray started without it
    with pytest.raises(
        ValueError,
        match=rf"offers 0 '{DEVICE_RESOURCE}' slots.*ray_init.resources=\{{cpu_device:N\}}.*ray start --resources",
    ):
        ray_resources._check_cpu_resources_available(one_node)
    nodes({"CPU": 6.0, DEVICE_RESOURCE: 2.0})
    with pytest.raises(ValueError, match="ray_init.num_cpus"):  # the bundles fit, no CPU spare
        ray_resources._check_cpu_resources_available(one_node)
    nodes({"CPU": 8.0, DEVICE_RESOURCE: 2.0})
    ray_resources._check_cpu_resources_available(one_node)

    two_nodes = SimpleNamespace(resource_pool_spec={"global_pool": [1, 1]}, max_colocate_count=3)
    nodes({"CPU": 16.0, DEVICE_RESOURCE: 2.0})  # enough slots, but one node: the ranks could not spread
    with pytest.raises(ValueError, match="needs its own node"):
        ray_resources._check_cpu_resources_available(two_nodes)
    nodes({"CPU": 6.0, DEVICE_RESOURCE: 1.0}, {"CPU": 3.0, DEVICE_RESOURCE: 1.0})
    ray_resources._check_cpu_resources_available(two_nodes)
    assert ray_resources.unplaceable_nodes([2, 1], [(1.0, 9.0), (2.0, 3.0)], 3) == [2]  # 2 slots need 6 CPUs


def test_resource_check_patch_refuses_unknown_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.single_controller.ray import base

    from verl_ext.cpu import ray_resources

    class FakeManager:
        def _check_resource_available(self, strict: bool = True) -> None:  # a changed verl signature
            return None

    monkeypatch.setattr(base, "ResourcePoolManager", FakeManager)
    with pytest.raises(RuntimeError, match="expected \\['self'\\]"):
        ray_resources._patch_resource_check()
