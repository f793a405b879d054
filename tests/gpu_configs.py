"""The GPU chunk configs (``lab/configs/gpu/``) shrunk to run on the CPU in seconds."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SHRINK = 128
"""Every length of a GPU config is divided by this."""


def tiny_gpu_config(name: str, cache_dir: Path, steps: int = 3) -> dict:
    """``lab/configs/gpu/<name>.yaml`` on the CPU in float32 at 1/128 of its lengths: ``steps``
    steps, the curriculum's stages at steps 0, 1, 2 (the last from step 2 on), validation and
    test of one batch, no passkeys (too short for the task), a ``StepProfiler`` on step 1, and
    the standard library's packages alone (two of them held out) in place of every installed
    one."""
    config = yaml.safe_load((REPO / "lab" / "configs" / "gpu" / f"{name}.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", precision="32-true", max_steps=steps,
                   val_check_interval=steps, limit_val_batches=1, limit_test_batches=1,
                   enable_progress_bar=False)
    curriculum = next(c for c in trainer["callbacks"] if isinstance(c, dict)
                      and c["class_path"].endswith("LengthCurriculum"))["init_args"]
    for step, stage in enumerate(curriculum["stages"]):
        stage.update(step=step, seq_len=stage["seq_len"] // SHRINK)
    curriculum["passkey_fraction"] = 0.0
    for callback in trainer["callbacks"]:  # a profile of step 1, inside the short fit
        if isinstance(callback, dict) and callback["class_path"].endswith("StepProfiler"):
            callback["init_args"].update(start=1, steps=1)
    data = config["data"]["init_args"]
    data.update(seq_len=data["seq_len"] // SHRINK, cache_dir=str(cache_dir),
                packages=["stdlib"],
                held_out={"validation": ["stdlib/json"], "test": ["stdlib/email"]})
    return config


def tiny_pretrained_config(name: str, cache_dir: Path, base: Path, steps: int = 3,
                           overlay: str | None = None) -> dict:
    """:func:`tiny_gpu_config` of a recipe that fine-tunes a pretrained model, with ``base``
    (a small imported model folder with its tokenizer) in place of its ``pretrained`` model
    and tokenizer, the pattern, positions, RoPE extension and selected blocks at 1/128 of
    their lengths (blocks of at least 4 tokens), and LoRA of rank 4; ``overlay``: a config of
    ``lab/configs/gpu/`` given after it (``--config``), whose run name, base and overrides
    replace the recipe's."""
    config = tiny_gpu_config(name, cache_dir, steps)
    model = config["model"]["init_args"]
    if overlay is not None:
        extra = yaml.safe_load((REPO / "lab" / "configs" / "gpu" / f"{overlay}.yaml").read_text())
        config["trainer"]["logger"] = extra["trainer"]["logger"]
        model.update(pretrained=extra["model"]["init_args"]["pretrained"],
                     overrides=extra["model"]["init_args"]["overrides"])
    overrides = model["overrides"]
    overrides.update(max_positions=overrides["max_positions"] // SHRINK,
                     segment_lengths=[n // SHRINK for n in overrides["segment_lengths"]])
    if "select_block" in overrides:
        overrides["select_block"] = max(4, overrides["select_block"] // SHRINK)
    extension = overrides.get("rope_extension")
    if extension:
        extension["original_max_position_embeddings"] //= SHRINK
    model["pretrained"] = str(base)
    if model.get("lora"):
        model["lora"] = {**model["lora"], "r": 4, "alpha": 8.0}
    config["data"]["init_args"]["tokenizer"] = str(base)
    return config
