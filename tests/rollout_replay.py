"""A test-only entry point: ``recipe.main`` whose TaskRunner records each step's rollout batch or replays a
recorded one, so that two training runs can be compared from the old-log-prob pass on.

Two runs of the CPU smoke do not train on the same samples, in any trainer mode: the ``hf_cpu`` server draws every
request's tokens from one generator (``verl_ext/cpu/server.py``) in the order the agent loop's concurrent requests
reach it, which varies from run to run; in ``colocate_async`` also which prompt groups finish first (the warm-up
batch) and where an abort cuts a generation. What a step computes from its batch -- pi_old, advantages, the update,
the metrics -- is deterministic given the batch and the weights, so the runs are compared there.

``DIVCLIP_REPLAY_DIR`` (a folder) and ``DIVCLIP_REPLAY=record|replay``: before each step's
``_compute_old_log_prob`` the TaskRunner either saves the batch as TransferQueue holds it (every field, and the
samples' tags) to ``step<N>.pt``, or puts the saved batch back under the live batch's keys (the same number of
samples: ``train_batch_size * rollout.n``). Either way it appends to ``steps-<mode>.jsonl`` per step: the metric names
the step had before that point (``before_old_pass``: the live rollout's and reward's, which a replay does not
change), and, after the pass, how many samples' ``old_log_probs`` the pass left as placeholders (NaN: the rows
whose pi_old the update supplies, ``policy_loss.old_log_prob_from_update``) -- what the pass did not compute.

Run it in place of ``python -m recipe.main``: :func:`replay_env` points ``launch/run_smoke_cpu.sh``'s ``PYTHON`` at a
wrapper that does (tests/test_trainer_modes_cpu.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from recipe.trainer import DivClipTaskRunner

DIR_ENV, MODE_ENV = "DIVCLIP_REPLAY_DIR", "DIVCLIP_REPLAY"


def install(folder: Path, mode: str) -> None:
    """Wrap ``DivClipTrainer._compute_old_log_prob`` in this process (the TaskRunner's)."""
    import torch
    import transfer_queue as tq

    from recipe.trainer import DivClipTrainer

    if mode not in ("record", "replay"):
        raise ValueError(f"{MODE_ENV} must be record or replay, got {mode!r}")
    original = DivClipTrainer._compute_old_log_prob

    def compute_old_log_prob(self: Any, batch: Any, metrics: dict) -> Any:
        path = folder / f"step{self.global_steps}.pt"
        before = sorted(metrics)
        if mode == "record":
            fields = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id)
            torch.save({"fields": fields, "tags": list(batch.tags)}, path)
        else:
            saved = torch.load(path, weights_only=False)
            if len(saved["tags"]) != len(batch.keys):
                raise ValueError(f"{path}: {len(saved['tags'])} samples recorded, the live batch has {len(batch.keys)}")
            fields, tags = saved["fields"], saved["tags"]
            tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields, tags=tags)
            batch.tags = list(saved["tags"])
        batch = original(self, batch, metrics)
        old = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["old_log_probs"])
        placeholders = sum(bool(torch.isnan(row).any()) for row in old["old_log_probs"].unbind())
        with (folder / f"steps-{mode}.jsonl").open("a") as out:
            out.write(json.dumps({"step": self.global_steps, "before_old_pass": before, "placeholders": placeholders}))
            out.write("\n")
        return batch

    DivClipTrainer._compute_old_log_prob = compute_old_log_prob


def replay_env(folder: Path, mode: str) -> dict[str, str]:
    """The environment for ``launch/run_smoke_cpu.sh`` under which its ``-m recipe.main`` runs this module instead
    (``PYTHON`` a wrapper written into ``folder``), recording into or replaying from ``folder``."""
    wrapper = folder / "python.sh"
    python = sys.executable
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == -m && "$2" == recipe.main ]]; then shift 2; exec {python} -m tests.rollout_replay "$@"; fi\n'
        f'exec {python} "$@"\n'
    )
    wrapper.chmod(0o755)
    root = str(Path(__file__).resolve().parents[1])
    python_path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHON": str(wrapper), DIR_ENV: str(folder), MODE_ENV: mode, "PYTHONPATH": python_path}


def steps_log(folder: Path, mode: str) -> dict[int, dict[str, Any]]:
    """What :func:`install`'s wrapper wrote per step into ``steps-<mode>.jsonl``, by step."""
    lines = [json.loads(line) for line in (folder / f"steps-{mode}.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines}


class ReplayingTaskRunner(DivClipTaskRunner):
    """``recipe.trainer.DivClipTaskRunner`` that installs the wrapper in its own process before verl's ``run``."""

    def run(self, config: Any) -> Any:
        install(Path(os.environ[DIR_ENV]), os.environ[MODE_ENV])
        return super().run(config)


if __name__ == "__main__":
    import ray

    import recipe.trainer
    from recipe.main import main
    from tests.rollout_replay import ReplayingTaskRunner as ByModule  # pickled by reference, not as __main__'s

    recipe.trainer.DivClipTaskRunnerV1 = ray.remote(ByModule)  # recipe.main.run imports it from there
    main()
