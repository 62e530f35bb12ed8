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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional, Tuple

import numpy as np
import torch


DEFAULT_MAX_BYTES = 8 << 20


def stdlib_source_files(root: Optional[Path] = None) -> List[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
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
DATA_TYPES = ("byte_corpus", "indexed")
DATA_KEYS = {"byte_corpus": ("type", "max_bytes"),
             "indexed": ("type", "prefix", "blend", "split", "cache_dir", "vocab_size", "eod")}
DEFAULT_SPLIT = "98,2,0"
BYTE_VOCAB = 256


@dataclass
class DataOptions:
    """The ``data`` section: the embedded byte corpus (default) or Megatron indexed datasets (one prefix, or a blend
    with weights, or without weights for shares proportional to size)."""

    type: str = "byte_corpus"
    max_bytes: Optional[int] = None
    prefixes: List[str] = field(default_factory=list)
    weights: Optional[List[float]] = None
    split: str = DEFAULT_SPLIT
    cache_dir: Optional[str] = None
    vocab_size: Optional[int] = None
    eod: Optional[int] = None

    def describe(self) -> str:
        if self.type == "byte_corpus":
            return "the embedded byte corpus (the Python standard library's sources)"
        blend = self.prefixes if self.weights is None else [f"{w:g} x {p}" for w, p in zip(self.weights, self.prefixes)]
        return f"indexed {', '.join(blend)}, split {self.split}"


def parse_data_section(ds_config: Mapping[str, Any]) -> DataOptions:
    """Validate ``data``; every problem is named by its key, all in one ``ConfigError``."""
    from .config import ConfigError

    section = ds_config.get("data", {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"invalid config:\n  data: expected an object, got {section!r}")
    kind = section.get("type", "indexed" if ("prefix" in section or "blend" in section) else "byte_corpus")
    if kind not in DATA_TYPES:
        raise ConfigError(f"invalid config:\n  data.type: got {kind!r}; expected one of {list(DATA_TYPES)}")
    errors = [f"data.{key}: unknown key for type {kind!r}; accepted: {list(DATA_KEYS[kind])}"
              for key in section if key not in DATA_KEYS[kind]]
    options = DataOptions(type=kind)
    for key in ("max_bytes", "vocab_size"):
        value = section.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            errors.append(f"data.{key}: got {value!r}; expected a positive integer")
        else:
            setattr(options, key, value)
    if kind == "indexed":
        errors += _parse_indexed(section, options)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return options


def _parse_indexed(section: Mapping[str, Any], options: DataOptions) -> List[str]:
    errors = []
    if ("prefix" in section) == ("blend" in section):
        return ["data: type 'indexed' needs either 'prefix' (one dataset) or 'blend' ([weight1, prefix1, weight2, "
                "prefix2, ...]), not both"]
    if "prefix" in section:
        if not isinstance(section["prefix"], str) or not section["prefix"]:
            return [f"data.prefix: got {section['prefix']!r}; expected the path prefix of PREFIX.bin/PREFIX.idx"]
        options.prefixes = [section["prefix"]]
    else:
        blend = section["blend"]
        if not isinstance(blend, list) or not blend:
            return [f"data.blend: got {blend!r}; expected [weight1, prefix1, weight2, prefix2, ...] or [prefix1, ...]"]
        if all(isinstance(item, str) for item in blend):
            options.prefixes = list(blend)
        elif len(blend) % 2 == 0 and all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0
                                         for w in blend[0::2]) and all(isinstance(p, str) for p in blend[1::2]):
            options.weights, options.prefixes = [float(w) for w in blend[0::2]], list(blend[1::2])
        else:
            return [f"data.blend: got {blend!r}; expected pairs of a positive weight and a prefix "
                    "([0.7, 'a', 0.3, 'b']) or prefixes only"]
    split = section.get("split", DEFAULT_SPLIT)
    parts = str(split).replace("/", ",").split(",")
    try:
        shares = [float(part) for part in parts]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        errors.append(f"data.split: got {split!r}; expected up to three non-negative shares of train, validation, "
                      f"test, e.g. {DEFAULT_SPLIT!r}")
    elif len(shares) < 2 or shares[1] == 0:
        errors.append(f"data.split: got {split!r}; the validation share is 0, and the main job evaluates on the "
                      f"held-out validation split (e.g. {DEFAULT_SPLIT!r})")
    options.split = str(split)
    if "cache_dir" in section and not isinstance(section["cache_dir"], str):
        errors.append(f"data.cache_dir: got {section['cache_dir']!r}; expected a folder path")
    options.cache_dir = section.get("cache_dir")
    eod = section.get("eod")
    if eod is not None and (not isinstance(eod, int) or isinstance(eod, bool) or eod < 0):
        errors.append(f"data.eod: got {eod!r}; expected a token id")
    options.eod = eod
    return errors


def indexed_vocabulary(options: DataOptions) -> Tuple[int, Optional[int]]:
    """The vocabulary size and end-of-document id of the indexed datasets, from each prefix's ``PREFIX.json``
    (written by ``ds-pseudo-real preprocess``) or the section's ``vocab_size``/``eod``; checks that every file is
    there and that the blend's datasets agree."""
    from .config import ConfigError
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
            print(f"[ds_pseudo_real] {bare}: no PREFIX.json; taking the vocabulary of {found[0][0]}", flush=True)
        return vocab, eod if options.eod is None else options.eod
    if options.vocab_size is None:
        raise ConfigError(f"data.vocab_size: {options.prefixes[0]}.json is missing (the dataset was not written by "
                          f"ds-pseudo-real preprocess): give the tokenizer's vocabulary size as data.vocab_size")
    return options.vocab_size, options.eod


def build_corpus(options: DataOptions, *, seq_len: int, seed: int, train_samples: int, val_samples: int,
                 world_size: int, cache_dir: Path, vocab_size: int, eod: Optional[int],
                 max_bytes: Optional[int] = None):
    """The corpus the main job reads; both kinds answer ``batch(split, batch_size, seq_len, seed, step, rank)``.
    ``max_bytes`` (the command line's) wins over the section's for the byte corpus."""
    if options.type == "byte_corpus":
        return ByteCorpus(max_bytes=max_bytes or options.max_bytes or DEFAULT_MAX_BYTES)
    from .indexed_data import IndexedCorpus

    return IndexedCorpus(options.prefixes, options.weights, options.split, seq_len, seed, train_samples, val_samples,
                         world_size, vocab_size, eod, Path(options.cache_dir) if options.cache_dir else cache_dir)
