"""The key table from what the product reads (recipe/verl_key_reads.py, verl_ext/core/key_reads.py): every
verl key the recorder saw the product read has its row -- honoured, replaced or refused, never verl_reads --
and a short run with the recorder on reads only keys of the committed record, the core set among them."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from recipe import verl_keys
from recipe.verl_key_checks import compose_verl_schema, key_under, leaf_keys
from recipe.verl_key_reads import READ_KEYS_PATH, read_keys
from recipe.verl_keys import KeyClass, row_of
from tests.test_recipe_main import ERC, dry_run
from verl_ext.core.key_reads import RECORD_ENV, read_records

ACTOR = "actor_rollout_ref.actor"
READ_CLASSES = (KeyClass.HONOURED, KeyClass.REPLACED, KeyClass.REFUSED)


def test_every_recorded_key_has_its_row_and_none_is_verl_reads() -> None:
    keys = read_keys()
    assert len(keys) > 50, f"{READ_KEYS_PATH} records {len(keys)} keys: rerun python -m recipe.verl_key_reads"
    unrowed = {
        key: modules
        for key, modules in keys.items()
        if key not in verl_keys.NOT_CONFIG_KEYS and (row_of(key) is None or row_of(key).key_class not in READ_CLASSES)
    }
    assert not unrowed, (
        "the product reads these verl keys, yet their row says verl reads them alone (or no row covers them): "
        f"give each an honoured / replaced / refused row in recipe/verl_keys.py: {unrowed}"
    )


def test_every_recorded_key_is_a_key_of_verls_schema() -> None:
    schema = set(leaf_keys(compose_verl_schema()))
    read_in = {rule.key for rule in verl_keys.RULES if rule.read_in is not None}
    for key in read_keys():
        assert not verl_keys.is_divclip_key(key), key
        assert key in schema or any(key_under(key, r) for r in read_in) or key in verl_keys.NOT_CONFIG_KEYS, (
            f"{key}: recorded, but no leaf of verl's ppo_trainer schema (a row with read_in, or NOT_CONFIG_KEYS)"
        )


def test_no_row_says_verl_reads_what_the_product_never_reads_is_verls_alone() -> None:
    assert not [rule.key for rule in verl_keys.RULES if rule.key_class is KeyClass.VERL_READS]
    assert verl_keys.classify("data.train_files").key_class is KeyClass.VERL_READS
    assert "data.train_files" not in read_keys()


#: What a dry run of the default config with ERC must read (recipe.config_checks and the checks of the key
#: table, on the driver): the trainer mode and v1 switch, the strategy, the loss, the clip range, the entropy.
DRY_RUN_CORE = {
    "trainer.use_v1",
    "trainer.v1.trainer_mode",
    f"{ACTOR}.strategy",
    f"{ACTOR}.policy_loss.loss_mode",
    f"{ACTOR}.clip_ratio_low",
    f"{ACTOR}.clip_ratio_high",
    f"{ACTOR}.calculate_entropy",
    f"{ACTOR}.entropy_coeff",
    f"{ACTOR}.fsdp_config.entropy_checkpointing",
    "algorithm.rollout_correction.bypass_mode",
}


def test_a_dry_run_reads_only_recorded_keys_and_the_core_set(tmp_path: Path) -> None:
    proc = dry_run(*ERC, f"{ACTOR}.calculate_entropy=true", env={RECORD_ENV: str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = {key for key in read_records(tmp_path) if not verl_keys.is_divclip_key(key)}
    assert DRY_RUN_CORE <= recorded, DRY_RUN_CORE - recorded
    unknown = recorded - frozenset(read_keys())
    assert not unknown, f"read by the product but not in {READ_KEYS_PATH}: {unknown} (python -m recipe.verl_key_reads)"


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``verl_ext.core.key_reads`` as this process's recorder: its state fresh, and OmegaConf's readers and verl's
    ``BaseConfig.__getattribute__`` put back as they were after the test (``install`` replaces them)."""
    from omegaconf import DictConfig, OmegaConf
    from verl.base_config import BaseConfig

    from verl_ext.core import key_reads

    for name in ("__getattr__", "__getitem__", "get"):
        monkeypatch.setattr(DictConfig, name, DictConfig.__dict__[name])
    monkeypatch.setattr(OmegaConf, "select", OmegaConf.__dict__["select"])
    monkeypatch.setattr(BaseConfig, "__getattribute__", BaseConfig.__getattribute__)
    monkeypatch.setattr(key_reads, "_installed", [False])
    monkeypatch.setattr(key_reads, "_seen", set())
    return types.SimpleNamespace(
        key_reads=key_reads,
        install=lambda: key_reads.install(DictConfig, OmegaConf, BaseConfig),
        select=OmegaConf.select,
    )


def _run_as(module: str, code: str, **names: Any) -> dict[str, Any]:
    """``code`` run as if in ``module`` (the recorder attributes a read to its frame's module)."""
    scope = {"__name__": module, **names}
    exec(code, scope)  # noqa: S102 -- the test's own literal code
    return scope


def test_the_recorder_records_the_products_leaf_reads_by_key_and_module(
    recorder: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In one process, as the plugin installs it: a product module's leaf reads of a ``DictConfig`` (attribute,
    item, ``get``, ``OmegaConf.select`` from the root and from a sub-config, an empty mapping), of a bound verl
    dataclass config (its fields, a nested config's, verl's ``engine`` alias as ``fsdp_config``, through verl's
    ``get`` / ``[]``) and :func:`record`'s keys (the caller's module, or ``depth`` frames above it) are each written
    once, with the reading module. Not recorded: navigation to a subtree, private attributes, an unbound config's
    fields, and every read from a module outside the product (this test's)."""
    from omegaconf import DictConfig, OmegaConf

    from recipe.bench.harness import make_actor_config

    key_reads = recorder.key_reads
    folder = tmp_path / "not" / "yet"  # made on the first write, parents too
    monkeypatch.setenv(RECORD_ENV, str(folder))
    originals = (DictConfig.__dict__["get"], OmegaConf.select)
    recorder.install()
    installed = (DictConfig.__dict__["get"], OmegaConf.select)
    recorder.install()  # once per process: a second call wraps nothing again
    assert (DictConfig.__dict__["get"], OmegaConf.select) == installed
    assert (installed[0].__wrapped__, installed[1].__wrapped__) == originals
    cfg = OmegaConf.create({"a": {"b": 1, "c": {}, "d": 2, "e": 3, "f": {"g": 4}, "h": 5}, "n": 6})
    actor, unbound = make_actor_config(), make_actor_config()
    assert key_reads.bind(actor, ACTOR) is actor
    helper = _run_as("verl_ext.probe", "def helper(key_reads):\n    key_reads.record('r.above', depth=1)\n")["helper"]
    reads = """
cfg.a.b, cfg["a"]["d"], cfg.a.get("e"), OmegaConf.select(cfg, "a.f.g"), OmegaConf.select(cfg.a, "h"), cfg.a.c, cfg.a.b
assert (cfg.a.get("y", 7), cfg.a.get("z", default_value=8), OmegaConf.select(cfg, "a.zz", default=9)) == (7, 8, 9)
assert OmegaConf.select(cfg, "a.h") == 5 and OmegaConf.select(cfg, "a.f") == {"g": 4}
actor.clip_ratio_low, actor.policy_loss.loss_mode, actor.engine.param_offload, actor.get("ppo_epochs"), actor["shuffle"]
actor._frozen if hasattr(actor, "_frozen") else None
unbound.clip_ratio_high
key_reads.record("r.here", "r.also")
helper(key_reads)
"""
    names = dict(cfg=cfg, actor=actor, unbound=unbound, OmegaConf=OmegaConf, key_reads=key_reads, helper=helper)
    _run_as("recipe.probe", reads, **names)
    outside = "cfg.n, OmegaConf.select(cfg, 'n'), actor.ppo_micro_batch_size_per_gpu, key_reads.record('r.tests')"
    _run_as(__name__, outside, **names)
    expected = [
        *("a.b", "a.d", "a.e", "a.f.g", "a.h", "a.c", "a.y", "a.z", "a.zz"),
        *(f"{ACTOR}.{key}" for key in ("clip_ratio_low", "policy_loss.loss_mode", "fsdp_config.param_offload")),
        *(f"{ACTOR}.{key}" for key in ("ppo_epochs", "shuffle")),
        *("r.here", "r.also", "r.above"),
    ]
    assert read_records(folder) == {key: {"recipe.probe"} for key in expected}
    lines = [line for path in folder.glob("keys-*.tsv") for line in path.read_text().splitlines()]
    assert sorted(lines) == sorted(f"{key}\trecipe.probe" for key in expected)  # each once


def test_nothing_is_wrapped_or_recorded_without_the_variable(recorder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``DIVCLIP_RECORD_KEYS`` (unset or blank) ``install`` replaces none of the readers, ``bind`` leaves the
    config unmarked and ``record`` writes nothing (a read from the product then costs nothing)."""
    from omegaconf import DictConfig
    from verl.base_config import BaseConfig

    from recipe.bench.harness import make_actor_config

    before = [DictConfig.__dict__[name] for name in ("__getattr__", "__getitem__", "get")]
    for value in (None, "  "):
        if value is None:
            monkeypatch.delenv(RECORD_ENV, raising=False)
        else:
            monkeypatch.setenv(RECORD_ENV, value)
        assert recorder.key_reads.record_dir() is None
        recorder.install()
        assert [DictConfig.__dict__[name] for name in ("__getattr__", "__getitem__", "get")] == before
        assert "__getattribute__" not in BaseConfig.__dict__ or BaseConfig.__getattribute__ is object.__getattribute__
        actor = make_actor_config()
        assert recorder.key_reads.bind(actor, ACTOR) is actor and recorder.key_reads.ROOT_ATTR not in vars(actor)
        _run_as("recipe.probe", "key_reads.record('r.off')", key_reads=recorder.key_reads)
        assert not recorder.key_reads._seen


@pytest.mark.parametrize("compile_on", [True, False])
def test_the_fp32_entropy_is_compiled_where_the_engine_compiles(
    compile_on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """actor.fsdp_config.use_torch_compile (honoured): the seam reads it to choose the fp32 entropy."""
    import torch

    from verl_ext.core.entropy import entropy_fp32, entropy_fp32_compiled
    from verl_ext.engine.entropy_path import entropy_fn_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = types.SimpleNamespace(engine_config=types.SimpleNamespace(use_torch_compile=compile_on))
    assert entropy_fn_for(engine) is (entropy_fp32_compiled if compile_on else entropy_fp32)


def test_every_engine_attribute_the_guard_reads_names_the_verl_keys_it_carries() -> None:
    from verl_ext.engine.guard import ENGINE_ATTRIBUTE_KEYS, ENGINE_INSTANCE_ATTRIBUTES

    assert ENGINE_ATTRIBUTE_KEYS.keys() == ENGINE_INSTANCE_ATTRIBUTES.keys()
    schema = set(leaf_keys(compose_verl_schema()))
    carried = {key for keys in ENGINE_ATTRIBUTE_KEYS.values() for key in keys}
    assert carried and carried <= schema, carried - schema
    for path, keys in ENGINE_ATTRIBUTE_KEYS.items():
        assert bool(keys) == ENGINE_INSTANCE_ATTRIBUTES[path].startswith("read"), path  # what is read names its key
