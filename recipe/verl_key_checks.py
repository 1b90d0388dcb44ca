"""verl's ``ppo_trainer`` schema, the leaves of a composed config, and the row of :mod:`recipe.verl_keys`' table.

The table's row (:class:`KeyRule`, its class :class:`KeyClass`) is declared here; the refusals its ``replaced`` and
``refused`` rows point at are rules of :mod:`verl_ext.config_rules` (the one home of every config rule).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from verl.workers.config import PolicyLossConfig

from verl_ext.config import DivClipPolicyLossConfig
from verl_ext.config_rules.policy import POLICY, ROLLOUT
from verl_ext.config_rules.verl_keys import verl_config_dir


def key_under(key: str, prefix: str) -> bool:
    """Whether ``key`` is ``prefix`` or below it (dotted)."""
    return key == prefix or key.startswith(prefix + ".")


#: The divclip policy-loss knobs: DivClipPolicyLossConfig's fields that verl's PolicyLossConfig lacks.
DIVCLIP_POLICY_KNOBS = tuple(
    sorted(
        {f.name for f in dataclasses.fields(DivClipPolicyLossConfig)}
        - {f.name for f in dataclasses.fields(PolicyLossConfig)}
    )
)
#: The project's own keys (configs/divclip_trainer.yaml): not verl's, so not in the table
#: of recipe.verl_keys.
DIVCLIP_PREFIXES = ("divclip", f"{ROLLOUT}.custom.validation", *(f"{POLICY}.{knob}" for knob in DIVCLIP_POLICY_KNOBS))


def is_divclip_key(key: str) -> bool:
    """Whether ``key`` is one of the project's own keys rather than verl's."""
    return any(key_under(key, prefix) for prefix in DIVCLIP_PREFIXES)


# -- A row of the rule table ---------------------------------------------------------------------


class KeyClass(str, enum.Enum):
    """What the divclip path does with a verl key (the sections of docs/verl_features.md)."""

    VERL_READS = "verl_reads"
    HONOURED = "honoured"
    REPLACED = "replaced"
    REFUSED = "refused"
    NO_EFFECT = "no_effect"


@dataclass(frozen=True)
class KeyRule:
    """One row of the table.

    Args:
        key: A dotted verl key, or a prefix of keys (``data`` covers ``data.train_files``).
        key_class: What the divclip path does with it.
        reason: One line: why the key is in its class.
        evidence: ``honoured`` only: the test(s) showing verl's effect on the divclip path.
        replaced_by: ``replaced`` only: the key whose value the divclip path uses instead.
        refused_when: The condition under which the key is refused before Ray starts (required for
            ``replaced`` and ``refused``; allowed on any class for a refused combination).
        check: The rule refusing it: a callable taking the composed config, or the name of another function of
            :mod:`verl_ext.config_rules` (``refused_when`` needs one of the two).
        read_in: For a key verl's schema does not declare (it needs ``+`` on the command line), the file
            under verl's package that reads it; the table's test checks the key's last part appears there.
    """

    key: str
    key_class: KeyClass
    reason: str
    evidence: Optional[str] = None
    replaced_by: Optional[str] = None
    refused_when: Optional[str] = None
    check: Optional[Callable[[DictConfig], None] | str] = None
    read_in: Optional[str] = None

    def __post_init__(self) -> None:
        where = f"KeyRule({self.key!r})"
        if not self.key or self.key != self.key.strip(".") or " " in self.key:
            raise ValueError(f"{where}: key must be a dotted config path")
        if not isinstance(self.key_class, KeyClass):
            raise ValueError(f"{where}: key_class must be a KeyClass, got {self.key_class!r}")
        if not self.reason:
            raise ValueError(f"{where}: reason is required")
        if (self.evidence is not None) != (self.key_class is KeyClass.HONOURED):
            raise ValueError(f"{where}: evidence is required for honoured rows and only for them")
        if (self.replaced_by is not None) != (self.key_class is KeyClass.REPLACED):
            raise ValueError(f"{where}: replaced_by is required for replaced rows and only for them")
        if self.key_class in (KeyClass.REPLACED, KeyClass.REFUSED) and self.refused_when is None:
            raise ValueError(f"{where}: a {self.key_class.value} row states refused_when")
        if (self.refused_when is not None) != (self.check is not None):
            raise ValueError(f"{where}: refused_when and check go together")


# -- verl's schema and the config's leaves -------------------------------------------------------


def compose_verl_schema() -> DictConfig:
    """verl's ``ppo_trainer`` config composed by Hydra from verl's installed config directory (for tests and
    the doc; needs no Hydra app running)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        return compose(config_name="ppo_trainer")


def leaf_keys(config: DictConfig | dict[str, Any]) -> Iterator[str]:
    """Every leaf key path of ``config``, dotted, in order. Lists and empty mappings are leaves;
    interpolations are not resolved (a leaf is where the config says something)."""
    tree = OmegaConf.to_container(config, resolve=False) if isinstance(config, DictConfig) else config

    def walk(node: Any, prefix: str) -> Iterator[str]:
        if isinstance(node, dict) and node:
            for name, child in node.items():
                yield from walk(child, f"{prefix}.{name}" if prefix else str(name))
        else:
            yield prefix

    yield from walk(tree, "")
