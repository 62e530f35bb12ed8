"""The main job's data: the ``data`` section, and its default, the embedded corpus of the bytes of the Python
standard library's own source files (Megatron indexed datasets are in ``indexed_data``).

Every machine with Python has it, so the demo needs no download. Files are split into train and validation by a
hash of their relative path (deterministic, independent of file order), and batches are drawn as a pure function
of (seed, step, rank): resuming at step N reproduces the data order without saving sampler state.
"""
from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Any, List, Literal, Mapping, Optional, Tuple

import numpy as np
import torch
from pydantic import Field, field_validator, model_validator

from .config import ConfigError, SectionModel, validate_section
from .logs import logger


DEFAULT_MAX_BYTES = 8 << 20


def stdlib_source_files(root: Optional[Path] = None) -> List[Path]:
    """The ``.py`` files under ``root`` (default: the standard library) outside installed packages, in the order of
    their relative paths. The package folders are not entered at all: a walk that filtered them out afterwards took
    a second of every main job's start on a busy machine (30x the walk)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if name not in ("site-packages", "dist-packages")]
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_validation_file(relative_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < val_fraction


class ByteCorpus:
    """Train and validation byte streams, each capped at ``max_bytes`` (taken in file order)."""

    def __init__(self, root: Optional[Path] = None, val_fraction: float = 0.05, max_bytes: int = DEFAULT_MAX_BYTES):
        root = Path(root or sysconfig.get_paths()["stdlib"])
        train, val = [], []
        sizes = [0, 0]
        for path in stdlib_source_files(root):
            is_val = is_validation_file(path.relative_to(root).as_posix(), val_fraction)
            budget = max_bytes if not is_val else max(max_bytes * val_fraction, 1 << 16)
            if sizes[is_val] >= budget:
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            (val if is_val else train).append(data)
            sizes[is_val] += len(data)
        if not train or not val:
            raise RuntimeError(f"no Python source files found under {root}")
        self.train = torch.from_numpy(np.frombuffer(b"".join(train), dtype=np.uint8).copy())
        self.val = torch.from_numpy(np.frombuffer(b"".join(val), dtype=np.uint8).copy())

    def batch(self, split: str, batch_size: int, seq_len: int, seed: int, step: int, rank: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets, ``batch_size x seq_len`` int64, a pure function of its arguments."""
        data = self.train if split == "train" else self.val
        key = hashlib.sha256(f"{seed}/{split}/{step}/{rank}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).long()
        return window[:, :-1], window[:, 1:]


# ---- the main job's ``data`` section ----
DEFAULT_SPLIT = "98,2,0"
BYTE_VOCAB = 256


class DataSection(SectionModel):
    """The ``data`` section; which keys it takes depends on its ``type``."""

    @staticmethod
    def model_for(raw: Any) -> type:
        """The model of the section's ``type``, which defaults to ``indexed`` when it names a prefix or a blend
        (``validate_section`` refuses a section that is no object)."""
        if not isinstance(raw, Mapping):
            return DataSection
        kind = raw.get("type", "indexed" if ("prefix" in raw or "blend" in raw) else "byte_corpus")
        if kind not in DATA_SECTIONS:
            raise ConfigError(f"invalid config:\n  data.type: got {kind!r}; expected one of {list(DATA_SECTIONS)}")
        return DATA_SECTIONS[kind]

    @classmethod
    def unknown_key_message(cls) -> str:
        return f"unknown key for type {cls.model_fields['type'].default!r}; accepted: {list(cls.model_fields)}"


class ByteCorpusData(DataSection):
    """The embedded byte corpus (the default)."""

    type: Literal["byte_corpus"] = "byte_corpus"
    max_bytes: Optional[int] = Field(None, ge=1, strict=True)

    def describe(self) -> str:
        return "the embedded byte corpus (the Python standard library's sources)"


class IndexedData(DataSection):
    """Megatron indexed datasets: one ``prefix``, or a ``blend`` with weights, or without weights for shares
    proportional to size."""

    type: Literal["indexed"] = "indexed"
    prefix: Optional[str] = Field(None, min_length=1)
    blend: Optional[List[Any]] = None
    split: str = DEFAULT_SPLIT
    cache_dir: Optional[str] = None
    vocab_size: Optional[int] = Field(None, ge=1, strict=True)
    eod: Optional[int] = Field(None, ge=0, strict=True)

    @field_validator("blend")
    @classmethod
    def _prefixes_or_pairs(cls, blend: Optional[List[Any]]) -> Optional[List[Any]]:
        if blend is None:
            return None
        if not blend:
            raise ValueError("expected [weight1, prefix1, weight2, prefix2, ...] or [prefix1, ...]")
        if all(isinstance(item, str) for item in blend):
            return blend
        if len(blend) % 2 or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                                     for w in blend[0::2]) or not all(isinstance(p, str) for p in blend[1::2]):
            raise ValueError("expected pairs of a positive weight and a prefix ([0.7, 'a', 0.3, 'b']) or prefixes only")
        return blend

    @field_validator("split")
    @classmethod
    def _shares(cls, split: str) -> str:
        try:
            shares = [float(part) for part in split.replace("/", ",").split(",")]
        except ValueError:
            shares = []
        if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
            raise ValueError(f"expected up to three non-negative shares of train, validation, test, e.g. "
                             f"{DEFAULT_SPLIT!r}")
        if len(shares) < 2 or shares[1] == 0:
            raise ValueError(f"the validation share is 0, and the main job evaluates on the held-out validation "
                             f"split (e.g. {DEFAULT_SPLIT!r})")
        return split

    @model_validator(mode="after")
    def _one_source(self) -> "IndexedData":
        if (self.prefix is None) == (self.blend is None):
            raise ValueError("type 'indexed' needs either 'prefix' (one dataset) or 'blend' ([weight1, prefix1, "
                             "weight2, prefix2, ...]), not both")
        return self

    @property
    def prefixes(self) -> List[str]:
        if self.prefix is not None:
            return [self.prefix]
        return [item for item in self.blend if isinstance(item, str)]

    @property
    def weights(self) -> Optional[List[float]]:
        """The blend's weights; None for one prefix or prefixes only (shares proportional to size)."""
        if self.blend is None or all(isinstance(item, str) for item in self.blend):
            return None
        return [float(w) for w in self.blend[0::2]]

    def describe(self) -> str:
        blend = self.prefixes if self.weights is None else [f"{w:g} x {p}" for w, p in zip(self.weights, self.prefixes)]
        return f"indexed {', '.join(blend)}, split {self.split}"


DATA_SECTIONS = {section.model_fields["type"].default: section for section in (ByteCorpusData, IndexedData)}


def parse_data_section(ds_config: Mapping[str, Any]) -> DataSection:
    """The validated ``data`` section (the byte corpus when absent)."""
    section = ds_config.get("data", {})
    return validate_section(DataSection.model_for(section), "data", section)


def indexed_vocabulary(options: IndexedData) -> Tuple[int, Optional[int]]:
    """The vocabulary size and end-of-document id of the indexed datasets, from each prefix's ``PREFIX.json``
    (written by ``ds-pseudo-real preprocess``) or the section's ``vocab_size``/``eod``; checks that every file is
    there and that the blend's datasets agree."""
    from .preprocess import PreprocessError, read_metadata

    errors, found = [], []
    for prefix in options.prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not Path(prefix + ext).is_file()]
        if missing:
            tried = "" if Path(prefix).is_absolute() else (
                f"looked for {' and '.join(os.path.abspath(path) for path in missing)}: a relative prefix is read "
                f"from the working directory, {os.getcwd()}, not from the config's folder; ")
            errors.append(f"data: {' and '.join(missing)} missing ({tried}a dataset is PREFIX.bin and PREFIX.idx, "
                          f"as written by ds-pseudo-real preprocess or Megatron's preprocess_data.py)")
            continue
        try:
            meta = read_metadata(prefix)
        except PreprocessError as error:
            errors.append(f"data: {error}")
            continue
        if meta is not None:
            found.append((prefix, meta["vocab_size"], meta["eod"], meta["tokenizer"]))
    if errors:
        raise ConfigError("invalid data:\n  " + "\n  ".join(errors))
    vocabularies = {(vocab, eod, tokenizer) for _, vocab, eod, tokenizer in found}
    if len(vocabularies) > 1:
        listing = "; ".join(f"{p}: {t} ({v} tokens)" for p, v, _, t in found)
        raise ConfigError(f"data.blend: the datasets were tokenized differently ({listing}); a blend needs one "
                          f"tokenizer")
    if found:
        vocab, eod, _ = vocabularies.pop()
        if options.vocab_size is not None and options.vocab_size != vocab:
            raise ConfigError(f"data.vocab_size: got {options.vocab_size}; {found[0][0]}.json says the tokenizer "
                              f"has {vocab} tokens")
        if len(found) < len(options.prefixes):
            bare = [p for p in options.prefixes if p not in {f[0] for f in found}]
            logger.info(f"{bare}: no PREFIX.json; taking the vocabulary of {found[0][0]}")
        return vocab, eod if options.eod is None else options.eod
    if options.vocab_size is None:
        raise ConfigError(f"data.vocab_size: {options.prefixes[0]}.json is missing (the dataset was not written by "
                          f"ds-pseudo-real preprocess): give the tokenizer's vocabulary size as data.vocab_size")
    return options.vocab_size, options.eod


def build_corpus(options: DataSection, *, seq_len: int, seed: int, train_samples: int, val_samples: int,
                 world_size: int, cache_dir: Path, vocab_size: int, eod: Optional[int],
                 max_bytes: Optional[int] = None):
    """The corpus the main job reads; both kinds answer ``batch(split, batch_size, seq_len, seed, step, rank)``.
    ``max_bytes`` (the command line's) wins over the section's for the byte corpus."""
    if options.type == "byte_corpus":
        return ByteCorpus(max_bytes=max_bytes or options.max_bytes or DEFAULT_MAX_BYTES)
    from .indexed_data import IndexedCorpus

    return IndexedCorpus(options.prefixes, options.weights, options.split, seq_len, seed, train_samples, val_samples,
                         world_size, vocab_size, eod, Path(options.cache_dir) if options.cache_dir else cache_dir)
