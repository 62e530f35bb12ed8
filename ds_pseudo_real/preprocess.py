"""``ds-pseudo-real preprocess``: a jsonl file (one document per line) -> a Megatron indexed dataset.

Writes ``PREFIX.bin`` and ``PREFIX.idx`` with megatron.core's own ``IndexedDatasetBuilder`` (readable by
megatron.core's ``IndexedDataset`` and by Megatron-LM's ``--data-path``), plus ``PREFIX.json``, which records the
tokenizer, its vocabulary size and end-of-document token, so that the main job sizes the model's vocabulary from
the data. Each document is its tokens followed by the end-of-document token.

The input is read line by line (never loaded whole); ``--workers N`` tokenizes in N processes, in bounded blocks, and
the output is byte-identical whatever N. The outputs are written under temporary names and renamed at the end, so
an interrupted or failed run leaves no half-written dataset behind.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

METADATA_FORMAT = "ds_pseudo_real.indexed/1"
BYTES = "bytes"
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
LINES_PER_TASK = 256


class PreprocessError(ValueError):
    """Bad input or tokenizer: the message names the file, line or option."""


@dataclass
class Tokenizer:
    """``bytes`` (UTF-8 bytes, 256 ids, end of document 256) or a local Hugging Face tokenizer."""

    name: str
    vocab_size: int
    eod: int
    backend: object = None  # a tokenizers.Tokenizer, a transformers tokenizer, or None for bytes

    def encode(self, text: str) -> List[int]:
        if self.backend is None:
            return list(text.encode("utf-8"))
        ids = self.backend.encode(text, add_special_tokens=False)
        return ids if isinstance(ids, list) else ids.ids


def load_tokenizer(spec: str, eod_token: Optional[str] = None) -> Tokenizer:
    """``bytes``, a ``tokenizer.json`` file, or a local folder (its ``tokenizer.json``, else ``transformers``'
    ``AutoTokenizer`` with ``local_files_only``: never a download)."""
    if spec == BYTES:
        if eod_token is not None:
            raise PreprocessError("--eod-token applies to Hugging Face tokenizers; the bytes tokenizer's end of "
                                  "document is id 256")
        return Tokenizer(BYTES, 257, 256)
    path = Path(spec)
    if not path.exists():
        raise PreprocessError(f"--tokenizer {spec}: no such file or folder (give 'bytes', a tokenizer.json or a "
                              "local tokenizer folder)")
    file = path if path.is_file() else path / "tokenizer.json"
    name = str(path.resolve())
    if file.is_file():
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError as error:
            raise PreprocessError("--tokenizer: reading tokenizer.json needs the 'tokenizers' package "
                                  "(pip install 'ds_pseudo_real[data]')") from error
        backend = HFTokenizer.from_file(str(file))
        vocab = backend.get_vocab(with_added_tokens=True)
        return Tokenizer(name, backend.get_vocab_size(with_added_tokens=True), _eod_id(spec, vocab, eod_token), backend)
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise PreprocessError(f"--tokenizer {spec}: the folder has no tokenizer.json; reading it needs "
                              "'transformers' (pip install 'ds_pseudo_real[hf]')") from error
    try:
        backend = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise PreprocessError(f"--tokenizer {spec}: not a tokenizer folder ({error})") from error
    vocab = backend.get_vocab()
    if eod_token is None and backend.eos_token is not None:
        eod_token = backend.eos_token
    return Tokenizer(name, len(backend), _eod_id(spec, vocab, eod_token), backend)


def _eod_id(spec: str, vocab: dict, eod_token: Optional[str]) -> int:
    if eod_token is not None:
        if eod_token not in vocab:
            raise PreprocessError(f"--eod-token {eod_token!r} is not in the vocabulary of {spec}")
        return vocab[eod_token]
    for candidate in EOD_CANDIDATES:
        if candidate in vocab:
            return vocab[candidate]
    raise PreprocessError(f"--tokenizer {spec}: none of {list(EOD_CANDIDATES)} is in its vocabulary; "
                          "give the end-of-document token with --eod-token")


def token_dtype(vocab_size: int):
    """Megatron's choice: uint16 while every id fits, else int32."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def metadata_path(prefix: str) -> Path:
    return Path(prefix + ".json")


def read_metadata(prefix: str) -> Optional[dict]:
    path = metadata_path(prefix)
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PreprocessError(f"{path}: unreadable dataset description ({error})") from error
    if not isinstance(meta, dict) or meta.get("format") != METADATA_FORMAT:
        raise PreprocessError(f"{path}: not a ds-pseudo-real dataset description (format {METADATA_FORMAT})")
    return meta


# ---- worker side: each process loads the tokenizer once ----
_WORKER_TOKENIZER: Optional[Tokenizer] = None


def _init_worker(spec: str, eod_token: Optional[str]) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = load_tokenizer(spec, eod_token)


def _encode_lines(task: Tuple[str, int, List[str]]) -> List[np.ndarray]:
    json_key, first_line, lines = task
    tokenizer = _WORKER_TOKENIZER
    dtype = token_dtype(tokenizer.vocab_size)
    out = []
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise PreprocessError(f"line {number}: not JSON ({error})") from None
        text = record.get(json_key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise PreprocessError(f"line {number}: no string under the key {json_key!r} "
                                  f"(keys: {sorted(record) if isinstance(record, dict) else type(record).__name__})")
        out.append(np.array(tokenizer.encode(text) + [tokenizer.eod], dtype=dtype))
    return out


def _tasks(handle, json_key: str) -> Iterator[Tuple[Tuple[str, int, List[str]], int]]:
    """Blocks of lines with the 1-based number of their first line, and the bytes read so far."""
    lines, first, number, read = [], 1, 0, 0
    for line in handle:
        number += 1
        read += len(line)
        lines.append(line.decode("utf-8", errors="replace"))
        if len(lines) == LINES_PER_TASK:
            yield (json_key, first, lines), read
            lines, first = [], number + 1
    if lines:
        yield (json_key, first, lines), read


class Progress:
    """A bar by bytes of input read, with documents/s; redrawn in place on a terminal, a line every 10 % else."""

    def __init__(self, total_bytes: int, stream=sys.stderr):
        self.total = max(total_bytes, 1)
        self.stream = stream
        self.start = time.perf_counter()
        self.tty = stream.isatty()
        self.last_tenth = -1

    def update(self, read: int, documents: int, tokens: int, final: bool = False) -> None:
        fraction = min(read / self.total, 1.0)
        tenth = int(fraction * 10)
        if not (self.tty or final or self.last_tenth < tenth < 10):
            return
        self.last_tenth = tenth
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        bar = "#" * int(fraction * 30)
        line = (f"[{bar:<30}] {fraction:4.0%} {documents:,} documents, {tokens:,} tokens | {documents / elapsed:,.0f} "
                f"documents/s, {read / elapsed / 2**20:.1f} MiB/s")
        self.stream.write(("\r" + line if self.tty else line + "\n") + ("\n" if final and self.tty else ""))
        self.stream.flush()


def _indexed_dataset_builder():
    from .indexed_data import quiet_megatron_import

    try:
        with quiet_megatron_import():
            from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError as error:
        raise PreprocessError("preprocess writes with megatron.core's IndexedDatasetBuilder: "
                              "pip install 'ds_pseudo_real[data]'") from error
    return IndexedDatasetBuilder


def _add_documents(builder, source: Path, json_key: str, tokenizer: str, eod_token: Optional[str], workers: int,
                   progress: Progress) -> Tuple[int, int]:
    """Every document of ``source`` tokenized (by ``workers`` processes) into ``builder``: (documents, tokens)."""
    documents = tokens = 0
    pool = (multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tokenizer, eod_token))
            if workers > 1 else None)
    try:
        if pool is None:
            _init_worker(tokenizer, eod_token)
        with open(source, "rb") as handle:
            for block in _blocks(_tasks(handle, json_key), 4 * workers):
                tasks = [task for task, _ in block]
                results = pool.map(_encode_lines, tasks) if pool else [_encode_lines(t) for t in tasks]
                for arrays in results:
                    for array in arrays:
                        builder.add_document(array, [array.size])
                        documents += 1
                        tokens += array.size
                progress.update(block[-1][1], documents, tokens)
    finally:
        if pool is not None:
            pool.terminate()
    return documents, tokens


def preprocess(input_path: str, output_prefix: str, tokenizer: str = BYTES, json_key: str = "text",
               workers: int = 1, eod_token: Optional[str] = None, progress_stream=sys.stderr) -> dict:
    """Tokenize ``input_path`` into ``output_prefix``.{bin,idx,json}; returns the description written."""
    builder_class = _indexed_dataset_builder()
    source = Path(input_path)
    if not source.is_file():
        raise PreprocessError(f"--input {input_path}: no such file")
    if workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {workers}")
    tok = load_tokenizer(tokenizer, eod_token)  # fails here, in the parent, on a bad tokenizer
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    tmp_bin, tmp_idx = output_prefix + ".bin.partial", output_prefix + ".idx.partial"
    builder = builder_class(tmp_bin, dtype=dtype)
    progress = Progress(source.stat().st_size, progress_stream)
    start = time.perf_counter()
    try:
        documents, tokens = _add_documents(builder, source, json_key, tokenizer, eod_token, workers, progress)
        if documents == 0:
            raise PreprocessError(f"--input {input_path}: no documents (every line is empty)")
        builder.finalize(tmp_idx)
    except BaseException:
        builder.data_file.close()
        for path in (tmp_bin, tmp_idx):
            if os.path.exists(path):
                os.remove(path)
        raise
    progress.update(progress.total, documents, tokens, final=True)
    os.replace(tmp_bin, output_prefix + ".bin")
    os.replace(tmp_idx, output_prefix + ".idx")
    description = {"format": METADATA_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eod": tok.eod,
                   "dtype": np.dtype(dtype).name, "documents": documents, "tokens": tokens,
                   "input": str(source.resolve()), "json_key": json_key}
    metadata_path(output_prefix).write_text(json.dumps(description, indent=1) + "\n")
    elapsed = time.perf_counter() - start
    print(f"wrote {output_prefix}.bin/.idx/.json: {documents:,} documents, {tokens:,} tokens, vocabulary "
          f"{tok.vocab_size} ({tok.name}), {elapsed:.1f} s, {documents / max(elapsed, 1e-9):,.0f} documents/s",
          flush=True)
    return description


def _blocks(items: Iterator, size: int) -> Iterator[list]:
    block = []
    for item in items:
        block.append(item)
        if len(block) == size:
            yield block
            block = []
    if block:
        yield block


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ds-pseudo-real preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="a jsonl file, one document per line")
    parser.add_argument("--json-key", default="text", help="the key of each line's text (default: text)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    parser.add_argument("--tokenizer", default=BYTES,
                        help="'bytes' (UTF-8 bytes, needs nothing) or a local Hugging Face tokenizer: a "
                             "tokenizer.json file or a folder (default: bytes)")
    parser.add_argument("--eod-token", default=None,
                        help=f"the end-of-document token of a Hugging Face tokenizer (default: its eos token, else "
                             f"the first of {list(EOD_CANDIDATES)} in its vocabulary)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args.tokenizer, args.json_key, args.workers, args.eod_token)
    except PreprocessError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
