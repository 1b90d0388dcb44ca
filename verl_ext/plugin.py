"""verl plugin (the ``verl.plugins`` entry point): registers the divclip loss modes in every process that imports
verl, Ray workers included. verl swallows plugin import errors at DEBUG level, so entry points call
:func:`require_registered` first.
"""

from __future__ import annotations

import os

import verl_ext.registry  # noqa: F401  (registers the modes with verl's POLICY_LOSS_REGISTRY)
from verl_ext.core import key_reads

# With DIVCLIP_RECORD_KEYS=<dir>: record the verl keys the product reads, in every process (off otherwise).
if key_reads.record_dir() is not None:
    from omegaconf import DictConfig, OmegaConf
    from verl.base_config import BaseConfig

    key_reads.install(DictConfig, OmegaConf, BaseConfig)

# With VERL_PLATFORM=cpu: the CPU platform, resource check and rollout. The test is
# verl_ext.cpu.cpu_platform_selected's, inlined: importing that package would load it on every GPU node too.
if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    from verl_ext.cpu import setup_cpu_process

    setup_cpu_process()

ENTRY_POINT_NAME = "divclip"
ENTRY_POINT_VALUE = "verl_ext.plugin"


def require_registered() -> None:
    """Raise with the cause unless every process that runs ``import verl`` gets the modes: this process's registry,
    and the ``verl.plugins`` entry point installed and not disabled by ``VERL_USE_EXTERNAL_PLUGINS``."""
    from importlib.metadata import entry_points

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    # imported here, not only by verl's plugin loader: a failure to register (a verl entry the project would
    # shadow) raises with its own message instead of the loader's DEBUG line
    from verl_ext.core.region import CONSTRAINTS

    missing = sorted(set(CONSTRAINTS) - set(POLICY_LOSS_REGISTRY))
    if not CONSTRAINTS or missing:
        raise RuntimeError(
            f"verl_ext policy losses are not registered with verl (missing: {missing or 'all'}). "
            "Is verl-divclip installed in this environment (`pip install -e .`) so that its "
            "`verl.plugins` entry point runs, and is VERL_USE_EXTERNAL_PLUGINS not 'none'?"
        )
    installed = [ep for ep in entry_points(group="verl.plugins") if ep.value == ENTRY_POINT_VALUE]
    if not installed:
        raise RuntimeError(
            f"the `verl.plugins` entry point {ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE} is not installed, so Ray "
            "workers that only `import verl` will not know the divclip modes: install the project "
            "(`pip install -e .`) in the environment every node uses"
        )
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    allowed = {name.strip() for name in policy.split(",") if name.strip()}
    if policy == "none" or (policy != "auto" and installed[0].name not in allowed):
        raise RuntimeError(
            f"VERL_USE_EXTERNAL_PLUGINS={policy!r} keeps verl from loading the '{installed[0].name}' plugin in "
            f"Ray workers: unset it, or include '{installed[0].name}' in the list"
        )
