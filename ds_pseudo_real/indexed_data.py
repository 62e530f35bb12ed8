"""Megatron indexed datasets in the main job, read with megatron.core's ``GPTDataset`` and
``BlendedMegatronDatasetBuilder``: one prefix or a weighted blend, split into train / validation / test by
documents, sample order a function of the seed (the shuffle indices are cached under the run folder).

Batches are addressed like the byte corpus's, as a pure function of (step, rank): the micro-batch ``m`` of rank
``r`` in a world of ``W`` ranks holds the samples ``(m * W + r) * b`` ... ``+ b - 1`` of the split, so the ranks
never share a sample and a resumed run reads the same next samples as the uninterrupted one.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
import warnings
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

from .config import ConfigError

# megatron-core 0.16.1's optimizer and FSDP modules, imported with its datasets, warn at import that Transformer
# Engine and Apex are missing and they fall back to local kernels: kernels the datasets never run.
IMPORT_NOTES = re.escape("Transformer Engine and Apex are not installed")


@contextlib.contextmanager
def quiet_megatron_import() -> Iterator[None]:
    """While megatron.core is imported for its datasets: its :data:`IMPORT_NOTES` (UserWarnings from its own
    modules) are not shown; every other warning is."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=IMPORT_NOTES, category=UserWarning, module=r"megatron\.core\.")
        yield


def check_splits(prefixes: List[str], split: str, split_matrix) -> None:
    """Every dataset must give the training and validation splits at least one token: megatron.core cannot sample
    an empty split (it loops forever looking for enough epochs). Splits are by documents, as megatron.core cuts
    them."""
    with quiet_megatron_import():
        from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prefixes:
        dataset = IndexedDataset(prefix)  # its index is a memory map, closed when the dataset goes
        lengths = dataset.sequence_lengths.copy()
        del dataset
        for name, bounds in (("training", split_matrix[0]), ("validation", split_matrix[1])):
            begin, end = (int(round(bound * len(lengths))) for bound in bounds) if bounds else (0, 0)
            if end <= begin or int(lengths[begin:end].sum()) == 0:
                raise ConfigError(f"data.split {split!r}: the {name} split of {prefix} is empty ({len(lengths)} "
                                  f"documents, documents {begin}..{end} fall to it); give more documents or a "
                                  f"larger share")


class DatasetTokenizer:
    """What ``GPTDataset`` reads of a tokenizer: the vocabulary size, the end-of-document id, and identifiers for
    its cache key (the data are tokenized already)."""

    def __init__(self, vocab_size: int, eod: Optional[int]):
        self.vocab_size, self.eod = vocab_size, -1 if eod is None else eod
        self.unique_identifiers = {"class": "ds_pseudo_real", "vocab_size": vocab_size, "eod": self.eod}


class IndexedCorpus:
    """``train`` and ``val`` splits of ``GPTDataset`` samples of ``seq_len`` tokens (plus the next-token labels)."""

    def __init__(self, prefixes: List[str], weights: Optional[List[float]], split: str, seq_len: int, seed: int,
                 train_samples: int, val_samples: int, world_size: int, vocab_size: int, eod: Optional[int],
                 cache_dir: Path):
        try:
            with quiet_megatron_import():
                from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
                from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        except ImportError as error:
            raise ConfigError("data.type 'indexed' reads with megatron.core's GPTDataset: "
                              "pip install 'ds_pseudo_real[data]'") from error
        self.seq_len, self.world_size, self.vocab_size = seq_len, world_size, vocab_size
        tokenizer = DatasetTokenizer(vocab_size, eod)
        config = GPTDatasetConfig(
            random_seed=seed, sequence_length=seq_len, blend=(prefixes, weights), split=split,
            path_to_cache=str(cache_dir), tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
            eod_mask_loss=False, create_attention_mask=False)
        check_splits(prefixes, split, config.split_matrix)
        start = time.perf_counter()
        logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
        train, val, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [train_samples, val_samples, 0], lambda: True, config).build()
        self.splits = {"train": train, "val": val}
        self.build_seconds = time.perf_counter() - start

    def describe(self) -> str:
        train, val = self.splits["train"], self.splits["val"]
        return (f"indexed data: {len(train):,} training and {len(val):,} validation samples of {self.seq_len} tokens "
                f"(built in {self.build_seconds:.1f} s)")

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int, step: int,
              rank: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of micro-batch ``step`` of ``rank``. ``seed`` is the byte corpus's
        argument: here the order was fixed by the seed the splits were built with."""
        if seq_len != self.seq_len:
            raise ValueError(f"the indexed splits hold sequences of {self.seq_len} tokens, asked for {seq_len}")
        dataset = self.splits[split]
        first = (step * self.world_size + rank) * batch_size
        if first + batch_size > len(dataset):
            raise IndexError(f"the {split} split holds {len(dataset)} samples; micro-batch {step} of rank {rank} "
                             f"needs samples up to {first + batch_size}")
        samples = [dataset[i] for i in range(first, first + batch_size)]
        return (torch.stack([s["tokens"] for s in samples]), torch.stack([s["labels"] for s in samples]))
