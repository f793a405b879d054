"""Workers for ``test_strategy.py``: tiny LongNet LMs trained with ``SequenceParallelStrategy``
on spawned gloo process groups (``lab.workers.run_workers``), and the same runs on
one process.

Every run: a 2-layer, width-32 model with a dilated pattern whose branches span shards
(``(32, 1), (64, 2), (128, 4)``), sequences of 120 tokens (padded to 128 under sequence
parallelism), global batch 4, three AdamW steps with gradient clipping, then validation on 6
samples (not a multiple of the data-parallel size times the batch).

Every run is float64, modules built in float64 (``make_module``) and trained with
``precision="64-true"``. In float32 the comparison depends on the CPU: the mesh and the single
process add the same terms in other orders (split over shards, reduced across ranks, vectorised
at the CPU's SIMD width, so AVX2 and AVX-512 round differently), and AdamW divides each
gradient by its own running size, which turns the rounding of a near-zero gradient into a
change of its parameter of up to the learning rate times the rounding over AdamW's eps: three
float32 token-loss steps on a 2-core AMD EPYC with AVX2 only left ``out_proj.weight[27, 0]``
1.02e-6 from the single process, over the 1e-6 the test was written with. In float64 the
largest difference measured is 2.4e-15 (``test_strategy.ATOL`` says why it stays small).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from longnet.training import CausalLMModule
from longnet.training.parallel.strategy import SequenceParallelStrategy

SEQ_LEN = 120
GLOBAL_BATCH = 4
STEPS = 3
MODEL_OVERRIDES = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "max_positions": 128,
    "segment_lengths": [32, 64, 128],
    "dilation_rates": [1, 2, 4],
}
RETRIEVAL_OVERRIDES = {"attention_sinks": 2, "select_block": 8, "select_top_k": 2,
                       "neighbor_segments": 1}
"""The ``"retrieval"`` variant's branches beside the pattern (blocks cross shard edges)."""


class TokenWindows(Dataset):
    """``size`` samples of pseudo-text bytes (a fixed seed per split), shifted labels, the last
    few labels of every other sample ignored (-100) so token counts differ per sample; with
    ``documents``, each sample packs 2 to 6 documents of random lengths (``document_ids``)."""

    def __init__(self, size: int, seed: int, documents: bool = False) -> None:
        generator = torch.Generator().manual_seed(seed)
        vocab = torch.tensor(list(b"etaoin shrdlu.\n"), dtype=torch.long)
        picks = torch.randint(len(vocab), (size, SEQ_LEN + 1), generator=generator)
        self.tokens = vocab[picks]
        self.size = size
        self.document_ids = None
        if documents:
            starts = torch.rand(size, SEQ_LEN, generator=generator) < 0.03
            starts[:, 0] = False
            self.document_ids = starts.long().cumsum(dim=1)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.tokens[index]
        labels = tokens[1:].clone()
        if index % 2:
            labels[-(7 + index) :] = -100
        sample = {"input_ids": tokens[:-1], "labels": labels}
        if self.document_ids is not None:
            sample["document_ids"] = self.document_ids[index]
        return sample


class TinyData(L.LightningDataModule):
    def __init__(self, batch_size: int, eval_batch_size: int = 2, documents: bool = False) -> None:
        super().__init__()
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.train = TokenWindows(12, seed=1, documents=documents)
        self.val = TokenWindows(6, seed=2, documents=documents)

    @property
    def vocab_size(self) -> int:
        return 256

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.eval_batch_size)


def make_module(loss_reduction: str = "token", retrieval: bool = False) -> CausalLMModule:
    """The seeded module, its parameters float64 from the start: Lightning restores a
    checkpoint before ``64-true`` converts the module, so a module built in float32 would
    round the resumed parameters to float32 (5.96e-8 = 2**-24 on the weights near 1)."""
    L.seed_everything(1234, verbose=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return CausalLMModule(
            model="longnet-tiny",
            overrides=MODEL_OVERRIDES | (RETRIEVAL_OVERRIDES if retrieval else {}),
            learning_rate=1e-3,
            warmup_steps=1,
            total_steps=STEPS,
            loss_reduction=loss_reduction,
        )
    finally:
        torch.set_default_dtype(previous)


def trainer_kwargs() -> dict[str, Any]:
    """The runs' settings (float64: see the module's docstring)."""
    return dict(
        accelerator="cpu",
        precision="64-true",
        max_steps=STEPS,
        val_check_interval=STEPS,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def result(trainer: L.Trainer, module: CausalLMModule) -> dict[str, Any]:
    return {
        # numpy arrays travel through the launcher's queue by value
        "params": {k: v.detach().cpu().numpy().copy()
                   for k, v in module.model.state_dict().items()},
        "val_loss": float(trainer.callback_metrics["val/loss"]),
        "val_tokens": float(trainer.callback_metrics["val/tokens"]),
        "global_step": trainer.global_step,
    }


def single_device_run(loss_reduction: str = "token", variant: str = "plain") -> dict[str, Any]:
    """The reference: one process, the whole global batch; ``variant``: ``"plain"``,
    ``"documents"`` (packed documents) or ``"retrieval"`` (the model with retrieval branches)."""
    torch.set_num_threads(1)
    module = make_module(loss_reduction, variant == "retrieval")
    trainer = L.Trainer(devices=1, **trainer_kwargs())
    trainer.fit(module, datamodule=TinyData(GLOBAL_BATCH, documents=variant == "documents"))
    return result(trainer, module)


def sequence_parallel_run(rank: int, world_size: int, device: torch.device,
                          sequence_parallel_size: int, checkpoint_dir: str | None = None,
                          loss_reduction: str = "token", load_balance: bool = True,
                          variant: str = "plain") -> dict:
    """One rank of a ``(world_size / sp, sp)`` mesh on the launcher's process group.

    With ``checkpoint_dir``: also save a checkpoint at step 2 (all ranks take part), resume a
    fresh model and trainer from it, and report how far the resumed step-3 parameters are from
    the uninterrupted ones (``resume_max_diff``).
    """
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    data_parallel = world_size // sequence_parallel_size

    def strategy() -> SequenceParallelStrategy:
        return SequenceParallelStrategy(sequence_parallel_size=sequence_parallel_size,
                                        load_balance=load_balance, process_group_backend="gloo")

    kwargs = trainer_kwargs()
    folder = None
    if checkpoint_dir is not None:
        folder = os.path.join(checkpoint_dir, f"sp{sequence_parallel_size}-{loss_reduction}-"
                              f"{'zigzag' if load_balance else 'contiguous'}-{variant}")
        kwargs.update(enable_checkpointing=True, callbacks=[ModelCheckpoint(
            dirpath=folder, filename="{step}", every_n_train_steps=2, save_top_k=-1)])
    documents = variant == "documents"
    module = make_module(loss_reduction, variant == "retrieval")
    used = strategy()
    trainer = L.Trainer(devices=world_size, strategy=used, **kwargs)
    trainer.fit(module, datamodule=TinyData(GLOBAL_BATCH // data_parallel, documents=documents))
    out = result(trainer, module)
    out["mesh"] = tuple(used.device_mesh.mesh.shape)
    out["layout"] = used.sequence_layout
    out["sp_ranks"] = sorted(torch.distributed.get_process_group_ranks(
        used.sequence_parallel_group))
    if folder is not None:
        resumed = make_module(loss_reduction, variant == "retrieval")
        trainer = L.Trainer(devices=world_size, strategy=strategy(), **trainer_kwargs())
        trainer.fit(resumed, datamodule=TinyData(GLOBAL_BATCH // data_parallel,
                                                 documents=documents),
                    ckpt_path=os.path.join(folder, "step=2.ckpt"))
        out["resume_max_diff"] = max(
            (a - b).abs().max().item()
            for a, b in zip(module.model.state_dict().values(),
                            resumed.model.state_dict().values()))
        out["resume_global_step"] = trainer.global_step
    return out


def sequence_parallel_runs(rank: int, world_size: int, device: torch.device,
                           runs: tuple[tuple[int, str, bool, str], ...],
                           checkpoint_dir: str | None = None) -> list[dict]:
    """:func:`sequence_parallel_run` for each ``(sequence-parallel size, loss reduction,
    load_balance, variant)``, one after another in the same processes (one spawn for
    several meshes)."""
    return [sequence_parallel_run(rank, world_size, device, sp, checkpoint_dir, reduction,
                                  balance, variant)
            for sp, reduction, balance, variant in runs]
