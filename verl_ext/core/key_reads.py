"""An opt-in recorder of the verl config keys the product's code reads, the source of ``recipe.verl_keys``' rows
for them. With ``DIVCLIP_RECORD_KEYS=<dir>``, :func:`install` (from the plugin) wraps verl's config readers so that
each read from a product module appends key and module to ``<dir>/keys-<pid>.tsv``; :func:`bind` and
:func:`record` cover dataclass configs and engine attributes. Without the variable nothing is wrapped.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

RECORD_ENV = "DIVCLIP_RECORD_KEYS"
"""Set to a folder to record the verl keys the product reads (one ``keys-<pid>.tsv`` per process)."""

PRODUCT_PACKAGES = ("recipe", "verl_ext")
"""The product: a read from a module of these packages is recorded."""

ROOT_ATTR = "_divclip_config_key"
"""The attribute :func:`bind` sets on a verl dataclass config: the dotted key it was built from."""

FIELD_ALIASES = {"engine": "fsdp_config"}
"""verl's ``ActorConfig.engine`` is the same object as its ``fsdp_config`` (the key in verl's schema)."""

_seen: set[tuple[str, str]] = set()
_installed = [False]


def record_dir() -> Optional[Path]:
    """The folder named by :data:`RECORD_ENV`, or ``None`` when recording is off."""
    raw = os.environ.get(RECORD_ENV, "").strip()
    return Path(raw) if raw else None


def _reader(depth: int) -> Optional[str]:
    """The module of the frame ``depth`` levels above the caller, skipping verl's ``BaseConfig.get`` and
    ``__getitem__`` (they read through ``getattr``), if it is a module of the product; else ``None``."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__") in ("verl.base_config", __name__):
        frame = frame.f_back
    module = frame.f_globals.get("__name__", "") if frame is not None else ""
    return module if module.split(".")[0] in PRODUCT_PACKAGES else None


def _write(key: str, module: str) -> None:
    folder = record_dir()
    if folder is None or (key, module) in _seen:
        return
    _seen.add((key, module))
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"keys-{os.getpid()}.tsv", "a", encoding="utf-8") as out:
        out.write(f"{key}\t{module}\n")


def record(*keys: str, depth: int = 0) -> None:
    """Record ``keys`` as read by the product module ``depth`` frames above the caller (0: the caller), for
    reads the wrapped readers cannot see (engine attributes, batch fields carrying a config key)."""
    if record_dir() is None:
        return
    module = _reader(depth + 1)
    if module is not None:
        for key in keys:
            _write(key, module)


def bind(config: Any, key: str) -> Any:
    """Tell the recorder that the verl dataclass ``config`` was built from the config at ``key`` (its
    fields' reads are then recorded as ``key.<field>``); returns ``config``. A no-op when recording is off."""
    if record_dir() is not None and config is not None and hasattr(config, "__dataclass_fields__"):
        object.__setattr__(config, ROOT_ATTR, key)
    return config


def install(dict_config: type, omegaconf: type, base_config: type) -> None:
    """Wrap the readers of OmegaConf's ``DictConfig``, ``omegaconf.select`` and verl's ``BaseConfig`` (handed in:
    this package imports neither) when :data:`RECORD_ENV` is set, once per process."""
    if record_dir() is None or _installed[0]:
        return
    _installed[0] = True
    _wrap_dictconfig(dict_config, omegaconf)
    _wrap_base_config(base_config)


def _is_leaf(value: Any, dict_type: type) -> bool:
    return not isinstance(value, dict_type) or len(value) == 0


def _wrap_dictconfig(dict_type: Any, omegaconf: Any) -> None:
    def reader(original: Any) -> Any:
        def read(self: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            value = original(self, key, *args, **kwargs)
            if isinstance(key, str) and _is_leaf(value, dict_type):
                module = _reader(1)
                if module is not None:
                    _write(self._get_full_key(key), module)
            return value

        read.__wrapped__ = original
        return read

    for name in ("__getattr__", "__getitem__", "get"):
        setattr(dict_type, name, reader(getattr(dict_type, name)))
    select = omegaconf.select

    def recorded_select(cfg: Any, key: str, **kwargs: Any) -> Any:
        value = select(cfg, key, **kwargs)
        module = _reader(1) if _is_leaf(value, dict_type) else None
        if module is not None and isinstance(cfg, dict_type):
            root = cfg._get_full_key("")
            _write(f"{root}.{key}" if root else key, module)
        return value

    recorded_select.__wrapped__ = select
    omegaconf.select = staticmethod(recorded_select)


def _wrap_base_config(base: Any) -> None:
    original = base.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        value = original(self, name)
        if name.startswith("_"):
            return value
        root = original(self, "__dict__").get(ROOT_ATTR)
        if root is None or name not in type(self).__dataclass_fields__:
            return value
        key = f"{root}.{FIELD_ALIASES.get(name, name)}"
        if isinstance(value, base):
            if ROOT_ATTR not in original(value, "__dict__"):
                object.__setattr__(value, ROOT_ATTR, key)
            return value
        module = _reader(1)
        if module is not None:
            _write(key, module)
        return value

    base.__getattribute__ = __getattribute__


def read_records(folder: Path) -> dict[str, set[str]]:
    """``key -> the product modules that read it`` from every ``keys-*.tsv`` under ``folder``."""
    keys: dict[str, set[str]] = {}
    for path in sorted(folder.glob("**/keys-*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                key, _, module = line.partition("\t")
                keys.setdefault(key, set()).add(module)
    return keys
