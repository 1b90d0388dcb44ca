"""``python -m recipe.sft [--dry-run] +sft=<name> [hydra overrides...]``: the SFT stage before RL.

Composes ``configs/sft_trainer.yaml`` with ``configs/sft/<name>.yaml``, checks it, trains with verl's own
``SFTTrainer`` (under ``torchrun`` for several GPUs) and merges the last checkpoint into one Hugging Face model
in ``divclip.merged_dir``, the RL scripts' ``MODEL_PATH`` (docs/experiments.md, "SFT stage"; ``merge``:
:func:`merge_main`).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from recipe.main import CONFIG_DIR, hydra_argv

MESSAGES_COLUMN = "messages"


class SFTConfigError(ValueError):
    """A config or input the SFT stage cannot run with; the message names the key or file."""


def validate(config: DictConfig) -> None:
    """Checks that need no data: LoRA settings and the output folder."""
    model = config.model
    if int(model.get("lora_rank", 0) or 0) > 0 and not model.get("lora_alpha"):
        raise SFTConfigError("model.lora_alpha must be set when model.lora_rank > 0")
    if config.data.get("max_length") is None or int(config.data.max_length) < 1:
        raise SFTConfigError(f"data.max_length must be a positive integer, got {config.data.get('max_length')!r}")
    from verl.utils.config import omega_conf_to_dataclass

    for key in ("engine", "optim", "checkpoint"):
        try:
            omega_conf_to_dataclass(config[key])
        except Exception as exc:  # hydra wraps the dataclass' own error
            raise SFTConfigError(f"{key}: {exc}") from exc
    merged = config.divclip.get("merged_dir")
    if merged is not None and not str(merged).strip():
        raise SFTConfigError("divclip.merged_dir is empty; give a folder or null (no merge)")


def check_train_files(config: DictConfig) -> None:
    """Each training parquet exists and has the chat column (before any model is loaded)."""
    import pyarrow.parquet as pq

    files = config.data.train_files
    files = [files] if isinstance(files, str) else list(files)
    column = config.data.get("messages_key", MESSAGES_COLUMN)
    for file in files:
        path = Path(str(file))
        if not path.is_file():
            raise SFTConfigError(
                f"data.train_files: {path} does not exist (python -m data_prep openmathreasoning writes it)"
            )
        try:
            names = pq.read_schema(path).names
        except Exception as exc:  # pyarrow raises several types for a non-parquet file
            raise SFTConfigError(f"data.train_files: {path} is not a readable parquet file ({exc})") from exc
        if column not in names:
            raise SFTConfigError(
                f"data.train_files: {path} has no {column!r} column (data.messages_key); columns: {names}"
            )


def _init_process_group(device: str) -> None:
    """torchrun's environment if present, else a single local process; gloo on CPU, verl's
    ``cpu:gloo,<device>:<nccl>`` backend otherwise."""
    import torch.distributed

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    with socket.socket() as sock:  # a free port
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(int(sock.getsockname()[1])))
    if device == "cpu":
        torch.distributed.init_process_group(backend="gloo")
    else:
        from verl.utils.distributed import initialize_global_process_group

        initialize_global_process_group()


def latest_checkpoint(default_local_dir: str) -> Path:
    """``<default_local_dir>/global_step_<N>`` of the newest checkpoint verl recorded."""
    root = Path(default_local_dir)
    tracker = root / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        step_dir = root / f"global_step_{tracker.read_text().strip()}"
        if step_dir.is_dir():
            return step_dir
    steps = sorted(root.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if not steps:
        raise SFTConfigError(f"trainer.default_local_dir: no global_step_* checkpoint under {root}")
    return steps[-1]


def _shard_dir(step_dir: Path) -> Path:
    """The folder holding the FSDP model shards (verl puts them in the step folder or a subfolder)."""
    for candidate in (step_dir, *sorted(p for p in step_dir.iterdir() if p.is_dir())):
        if any(candidate.glob("model_world_size_*_rank_0.pt")):
            return candidate
    raise SFTConfigError(f"{step_dir}: no model_world_size_*_rank_0.pt shard (was the model saved?)")


def _config_dtype(config_json: Path) -> str:
    import json

    try:
        config = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SFTConfigError(f"{config_json}: unreadable model config ({exc})") from exc
    dtype = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SFTConfigError(f"{config_json}: unsupported dtype {dtype!r}")
    return str(dtype)


def merge_checkpoint(step_dir: str | os.PathLike[str], target_dir: str | os.PathLike[str]) -> Path:
    """One Hugging Face model folder from a LoRA SFT checkpoint (verl's merger, then peft's merge).

    Written to a temporary sibling and renamed, so an interrupted merge never leaves a half model
    under ``target_dir``; an existing ``target_dir`` is replaced only once the new one is complete.
    """
    if not Path(step_dir).is_dir():  # a bad path is refused before torch, transformers and verl are imported
        raise SFTConfigError(f"checkpoint {step_dir} is not a folder")
    shards = _shard_dir(Path(step_dir))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    target = Path(target_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".merging")
    gathered = staging / "gathered"
    shutil.rmtree(staging, ignore_errors=True)
    hf_config = shards / "huggingface"
    merger = FSDPModelMerger(
        ModelMergerConfig(
            operation="merge",
            backend="fsdp",
            local_dir=str(shards),
            target_dir=str(gathered),
            hf_model_config_path=str(hf_config),
        )
    )
    merger.merge_and_save()
    merger.cleanup()
    # the base model's own dtype (Qwen3: bfloat16); verl's merger gathers everything in bfloat16
    dtype = _config_dtype(hf_config / "config.json")
    model = AutoModelForCausalLM.from_pretrained(gathered, dtype=getattr(torch, dtype))
    adapter = gathered / "lora_adapter"
    if adapter.is_dir():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    final = staging / "model"
    model.save_pretrained(final)
    AutoTokenizer.from_pretrained(gathered).save_pretrained(final)
    if adapter.is_dir():  # kept for inspection: the adapter that was folded in
        shutil.copytree(adapter, final / "lora_adapter")
    previous = target.with_name(target.name + ".previous")
    if target.exists():
        shutil.rmtree(previous, ignore_errors=True)
        target.rename(previous)
    final.rename(target)
    shutil.rmtree(previous, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return target


def run(config: DictConfig) -> None:
    validate(config)
    if config.divclip.dry_run:
        OmegaConf.resolve(config)
        sys.stdout.write(OmegaConf.to_yaml(config))
        return
    check_train_files(config)
    import torch
    import torch.distributed
    from verl.trainer.sft_trainer import SFTTrainer
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    _init_process_group(str(config.trainer.device))
    # verl's SFT trainer seeds its data order but not the global RNG that peft draws the LoRA A
    # matrices from: without this, two runs of the same config start from different adapters.
    torch.manual_seed(int(config.trainer.get("seed", None) or config.engine.get("seed", 42)))
    try:
        SFTTrainer(config=config).fit()
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0 and config.divclip.merged_dir:
            step_dir = latest_checkpoint(config.trainer.default_local_dir)
            merged = merge_checkpoint(step_dir, config.divclip.merged_dir)
            print(f"merged {step_dir} -> {merged} (MODEL_PATH for the RL stage)")
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


@hydra.main(config_path=CONFIG_DIR, config_name="sft_trainer", version_base=None)
def _hydra_main(config: DictConfig) -> None:
    try:
        run(config)
    except SFTConfigError as exc:  # inside Hydra's task: its own handler would exit 1 with a traceback hint
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def merge_main(argv: list[str]) -> int:
    """``python -m recipe.sft merge --checkpoint DIR --output DIR``: any verl FSDP checkpoint with a
    LoRA adapter (an SFT step folder, or an RL run's ``global_step_N/actor``) as one merged HF model,
    e.g. to evaluate ATR checkpoints with ``python -m recipe.eval generate`` (verl's own
    ``model_merger`` writes the adapter beside the base weights, which vLLM would then ignore)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m recipe.sft merge", description=merge_main.__doc__)
    parser.add_argument("--checkpoint", required=True, help="verl checkpoint folder (global_step_N or its actor/)")
    parser.add_argument("--output", required=True, help="folder for the merged Hugging Face model")
    args = parser.parse_args(argv)
    try:
        merged = merge_checkpoint(args.checkpoint, args.output)
    except SFTConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {args.checkpoint} -> {merged}")
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        sys.exit(merge_main(argv[1:]))
    sys.argv = [sys.argv[0]] + hydra_argv(argv)
    _hydra_main()


if __name__ == "__main__":
    main()
