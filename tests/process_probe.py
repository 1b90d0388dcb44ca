"""A test-only module that every process of a training run imports (``VERL_USE_EXTERNAL_MODULES``, read by
``import verl``), recording which of verl's classes and module globals the process has patched.

With ``DIVCLIP_PROBE_DIR`` set, a daemon thread writes ``<pid>.json`` there every half second until the process
ends: the process title (Ray names an actor's process ``ray::<Class>...``), whether the engine seam's wrappers sit
on verl's ``TrainingWorker`` / ``FSDPEngineWithLMHead``, whether verl's two module globals are the seam's
dispatchers, the classes in verl's trainer registry, and which project modules the process imported. It imports
nothing itself: each verl module is looked at only if the process imported it (a module it never imported holds
nothing patched). tests/test_smoke_cpu.py reads the records of a smoke run.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

DIR_ENV = "DIVCLIP_PROBE_DIR"
ORIGINAL_ATTR = "__divclip_original__"  # what verl_ext.engine.swap sets on each wrapper (checked by the test)
SEAM_METHODS = {
    "verl.workers.engine_workers": ("TrainingWorker", ("set_loss_fn", "train_mini_batch", "train_batch")),
    "verl.workers.engine.fsdp.transformer_impl": ("FSDPEngineWithLMHead", ("infer_batch", "forward_step")),
}
SEAM_GLOBALS = {
    "verl.utils.torch_functional": "entropy_from_logits",
    "verl.workers.engine.fsdp.transformer_impl": "logprobs_from_logits",
}
PROJECT_MODULES = ("verl_ext.actor_loss", "verl_ext.engine.seam", "recipe.trainer")


def title() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return " ".join(sys.argv)


def record() -> dict[str, Any]:
    """This process's view of verl now (see the module docstring)."""
    wrapped: dict[str, bool] = {}
    for module_name, (class_name, methods) in SEAM_METHODS.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        for method in methods:
            wrapped[f"{class_name}.{method}"] = cls is not None and hasattr(vars(cls).get(method), ORIGINAL_ATTR)
    for module_name, name in SEAM_GLOBALS.items():
        wrapped[f"{module_name}.{name}"] = hasattr(getattr(sys.modules.get(module_name), name, None), ORIGINAL_ATTR)
    registry = getattr(sys.modules.get("verl.trainer.ppo.v1.trainer_base"), "TRAINER_REGISTRY", None)
    return {
        "pid": os.getpid(),
        "title": title(),
        "wrapped": wrapped,
        "trainers": None if registry is None else {mode: cls.__name__ for mode, cls in registry.items()},
        "modules": [name for name in PROJECT_MODULES if name in sys.modules],
        "time": time.time(),
    }


def _write_forever(folder: Path) -> None:
    target = folder / f"{os.getpid()}.json"
    while True:
        try:
            tmp = target.with_suffix(".tmp")
            tmp.write_text(json.dumps(record()))
            os.replace(tmp, target)
        except Exception:  # noqa: BLE001 -- a probe never breaks the process it watches
            pass
        time.sleep(0.5)


if os.environ.get(DIR_ENV):
    _folder = Path(os.environ[DIR_ENV])
    _folder.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=_write_forever, args=(_folder,), name="divclip-process-probe", daemon=True).start()
