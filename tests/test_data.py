"""Real data in the main job: ``ds-pseudo-real preprocess`` (jsonl -> megatron.core indexed dataset), the ``data``
section (megatron.core's GPTDataset / BlendedMegatronDatasetBuilder), its errors, and resume exactness on it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds_pseudo_real.config import ConfigError
from ds_pseudo_real.data import IndexedData, indexed_vocabulary, parse_data_section
from ds_pseudo_real.report import read_records
from conftest import REPO, free_port, python_path, run_two_ranks

pytest.importorskip("megatron.core", reason="indexed data need megatron-core (the test extra installs it)")
from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402

from ds_pseudo_real.indexed_data import IndexedCorpus  # noqa: E402
from ds_pseudo_real.preprocess import preprocess  # noqa: E402

DOCS = ["Hello, world.", "Zweite Zeile mit Umlauten: äöü ß", "", "third document\nwith a newline", "€ and 🙂"]


def write_jsonl(path: Path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as handle:
        for text in texts:
            handle.write((json.dumps({key: text, "id": 1}) if text else "   ") + "\n")
    return path


def cli(*args):
    env = dict(os.environ, PYTHONPATH=python_path())
    return subprocess.run([sys.executable, "-m", "ds_pseudo_real.cli", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def words_corpus(path: Path, documents: int, seed: int = 0, words=("alpha", "beta", "gamma", "delta")):
    rng = np.random.default_rng(seed)
    return write_jsonl(path, [" ".join(rng.choice(words, size=rng.integers(5, 60))) for _ in range(documents)])


def test_preprocess_bytes_writes_a_dataset_megatron_core_reads(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", DOCS, key="content")
    proc = cli("preprocess", "--input", str(source), "--json-key", "content", "--output-prefix",
               str(tmp_path / "out" / "docs"), "--tokenizer", "bytes")
    assert proc.returncode == 0, proc.stderr
    assert "documents/s" in proc.stderr and "100%" in proc.stderr  # the progress bar
    assert "4 documents" in proc.stdout
    # nothing else: megatron-core's import-time notes that Transformer Engine and Apex are missing say nothing here
    assert [line for line in proc.stderr.splitlines() if "documents/s" not in line] == []
    dataset = IndexedDataset(str(tmp_path / "out" / "docs"))
    texts = [t for t in DOCS if t]  # the blank line is no document
    assert len(dataset) == 4 and dataset.document_indices.tolist() == [0, 1, 2, 3, 4]
    for i, text in enumerate(texts):
        assert dataset[i].tolist() == list(text.encode("utf-8")) + [256]
    assert dataset[0].dtype == np.uint16
    meta = json.loads((tmp_path / "out" / "docs.json").read_text())
    assert meta["vocab_size"] == 257 and meta["eod"] == 256 and meta["tokenizer"] == "bytes"
    assert meta["documents"] == 4 and meta["tokens"] == sum(len(t.encode()) + 1 for t in texts)


def test_only_megatrons_known_import_notes_are_silenced():
    import warnings

    from ds_pseudo_real.indexed_data import quiet_megatron_import

    note = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet_megatron_import():
            warnings.warn_explicit(note, UserWarning, "optimizer/__init__.py", 24, module="megatron.core.optimizer")
            warnings.warn_explicit(note, UserWarning, "elsewhere.py", 1, module="some_other_package")
            warnings.warn_explicit("index file is stale", UserWarning, "x.py", 1, module="megatron.core.datasets")
            warnings.warn_explicit(note, DeprecationWarning, "x.py", 1, module="megatron.core.optimizer")
        warnings.warn_explicit(note, UserWarning, "optimizer/__init__.py", 24, module="megatron.core.optimizer")
    assert [(str(w.message), w.category) for w in shown] == [
        (note, UserWarning), ("index file is stale", UserWarning), (note, DeprecationWarning), (note, UserWarning)]


def test_preprocess_with_a_local_tokenizer_json_and_workers_is_identical(tmp_path):
    tokenizers = pytest.importorskip("tokenizers", reason="the data extra installs tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    source = words_corpus(tmp_path / "words.jsonl", 600)
    texts = [json.loads(line)["text"] for line in source.read_text().splitlines()]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")

    one = preprocess(str(source), str(tmp_path / "one"), str(tmp_path / "tokenizer.json"), workers=1)
    two = preprocess(str(source), str(tmp_path / "two"), str(tmp_path), workers=2)  # the folder form
    assert one["vocab_size"] == tok.get_vocab_size() and one["eod"] == eod and one["documents"] == 600
    assert {k: v for k, v in two.items() if k != "tokenizer"} == {k: v for k, v in one.items() if k != "tokenizer"}
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
    dataset = IndexedDataset(str(tmp_path / "two"))
    for i in (0, 299, 599):
        assert dataset[i].tolist() == tok.encode(texts[i]).ids + [eod]


@pytest.mark.parametrize("bad, message", [
    ('{"text": "fine"}\n{"text": "fine"}\n{"text": broken}\n', "line 3: not JSON"),
    ('{"text": "fine"}\n{"body": "no text key"}\n', "line 2: no string under the key 'text' (keys: ['body'])"),
], ids=["not-json", "missing-key"])
def test_preprocess_stops_on_a_bad_line_and_leaves_no_dataset(tmp_path, bad, message):
    (tmp_path / "bad.jsonl").write_text(bad)
    proc = cli("preprocess", "--input", str(tmp_path / "bad.jsonl"), "--output-prefix", str(tmp_path / "bad"))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nothing half-written


def test_preprocess_refuses_an_unknown_tokenizer_path(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    proc = cli("preprocess", "--input", str(tmp_path / "a.jsonl"), "--output-prefix", str(tmp_path / "a"),
               "--tokenizer", str(tmp_path / "nowhere"))
    assert proc.returncode == 2 and "nowhere: no such file or folder" in proc.stderr


@pytest.mark.parametrize("section, message", [
    ({"type": "indexed"}, "needs either 'prefix'"),
    ({"prefix": "a", "blend": ["a"]}, "needs either 'prefix'"),
    ({"type": "indexd"}, "data.type: got 'indexd'"),
    ({"prefix": "a", "spilt": "9,1,0"}, "data.spilt: unknown key for type 'indexed'"),
    ({"blend": [0.5, "a", "b"]}, "data.blend: Value error, expected pairs of a positive weight and a prefix "
                                 "([0.7, 'a', 0.3, 'b']) or prefixes only (got [0.5, 'a', 'b'])"),
    ({"blend": [-1, "a", 1, "b"]}, "expected pairs of a positive weight and a prefix"),
    ({"prefix": "a", "split": "100,0,0"}, "the validation share is 0"),
    ({"prefix": "a", "split": "ninety"}, "data.split: Value error, expected up to three non-negative shares of "
                                         "train, validation, test, e.g. '98,2,0' (got 'ninety')"),
    ({"type": "byte_corpus", "prefix": "a"}, "data.prefix: unknown key for type 'byte_corpus'"),
    ({"prefix": "a", "vocab_size": 0}, "data.vocab_size: Input should be greater than or equal to 1 (got 0)"),
])
def test_data_section_errors_name_the_key(section, message):
    with pytest.raises(ConfigError) as error:
        parse_data_section({"data": section})
    assert message in str(error.value)


def test_a_prefix_not_found_names_the_absolute_paths_tried(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        indexed_vocabulary(IndexedData(blend=["data/corpus", str(tmp_path / "abs")]))
    assert (f"data: data/corpus.bin and data/corpus.idx missing (looked for {tmp_path}/data/corpus.bin and "
            f"{tmp_path}/data/corpus.idx: a relative prefix is read from the working directory, {tmp_path}, not "
            f"from the config's folder; a dataset is PREFIX.bin") in str(error.value)
    assert f"data: {tmp_path}/abs.bin and {tmp_path}/abs.idx missing (a dataset is" in str(error.value)


def test_data_section_forms():
    assert parse_data_section({}).type == "byte_corpus"
    single = parse_data_section({"data": {"prefix": "x/a"}})
    assert (single.type, single.prefixes, single.weights, single.split) == ("indexed", ["x/a"], None, "98,2,0")
    blend = parse_data_section({"data": {"type": "indexed", "blend": [0.7, "a", 3, "b"], "split": "90,10,0"}})
    assert blend.prefixes == ["a", "b"] and blend.weights == [0.7, 3.0]
    assert parse_data_section({"data": {"blend": ["a", "b"]}}).weights is None


def test_data_files_and_vocabulary_are_checked(tmp_path):
    words_corpus(tmp_path / "w.jsonl", 20)
    preprocess(str(tmp_path / "w.jsonl"), str(tmp_path / "bytes"))
    assert indexed_vocabulary(IndexedData(prefix=str(tmp_path / "bytes"))) == (257, 256)

    os.rename(tmp_path / "bytes.idx", tmp_path / "moved.idx")
    with pytest.raises(ConfigError, match=r"bytes\.idx missing"):
        indexed_vocabulary(IndexedData(prefix=str(tmp_path / "bytes")))
    os.rename(tmp_path / "moved.idx", tmp_path / "bytes.idx")

    # A dataset without its description (e.g. from Megatron-LM's preprocess_data.py) needs data.vocab_size.
    for ext in (".bin", ".idx"):
        (tmp_path / f"bare{ext}").write_bytes((tmp_path / f"bytes{ext}").read_bytes())
    with pytest.raises(ConfigError, match="give the tokenizer's vocabulary size as data.vocab_size"):
        indexed_vocabulary(IndexedData(prefix=str(tmp_path / "bare")))
    assert indexed_vocabulary(IndexedData(prefix=str(tmp_path / "bare"), vocab_size=300)) == (300, None)
    with pytest.raises(ConfigError, match="data.vocab_size: got 300; .*says the tokenizer has 257 tokens"):
        indexed_vocabulary(IndexedData(prefix=str(tmp_path / "bytes"), vocab_size=300))

    # A blend of two tokenizations is refused.
    other = json.loads((tmp_path / "bytes.json").read_text())
    other.update(tokenizer="/somewhere/tokenizer.json", vocab_size=50257, eod=50256)
    for ext in (".bin", ".idx"):
        (tmp_path / f"other{ext}").write_bytes((tmp_path / f"bytes{ext}").read_bytes())
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match="the datasets were tokenized differently"):
        indexed_vocabulary(IndexedData(blend=[str(tmp_path / "bytes"), str(tmp_path / "other")]))


def test_a_split_with_no_documents_is_refused(tmp_path):
    words_corpus(tmp_path / "few.jsonl", 3)
    preprocess(str(tmp_path / "few.jsonl"), str(tmp_path / "few"))
    with pytest.raises(ConfigError, match=r"data.split '98,2,0': the validation split .* is empty"):
        IndexedCorpus([str(tmp_path / "few")], None, "98,2,0", 16, 0, 32, 8, 1, 257, 256, tmp_path / "cache")


def test_samples_are_disjoint_across_ranks_reproducible_and_blended_by_weight(tmp_path):
    words_corpus(tmp_path / "w.jsonl", 300)
    preprocess(str(tmp_path / "w.jsonl"), str(tmp_path / "w"))

    def corpus(seed, cache="cache", world=2):
        return IndexedCorpus([str(tmp_path / "w")], None, "90,10,0", 16, seed, 400, 32, world, 257, 256,
                             tmp_path / cache)

    first = corpus(0)
    again = corpus(0)  # from the cached indices
    fresh = corpus(0, cache="other")  # rebuilt
    seen = []
    for step in range(5):
        for rank in range(2):
            x, y = first.batch("train", 4, 16, seed=0, step=step, rank=rank)
            assert x.shape == (4, 16) and (x[:, 1:] == y[:, :-1]).all()
            assert (x == again.batch("train", 4, 16, 0, step, rank)[0]).all()
            assert (x == fresh.batch("train", 4, 16, 0, step, rank)[0]).all()
            seen += [tuple(row.tolist()) for row in x]
    assert len(set(seen)) == len(seen) == 40  # no sample twice, across steps and ranks
    # On 1 rank, micro-batches 2k and 2k+1 are ranks 0 and 1's micro-batch k of the 2-rank run.
    single = corpus(0, world=1)
    assert (single.batch("train", 4, 16, 0, 3, 0)[0] == first.batch("train", 4, 16, 0, 1, 1)[0]).all()
    assert not (corpus(1).batch("train", 4, 16, 0, 0, 0)[0] == first.batch("train", 4, 16, 0, 0, 0)[0]).all()
    # Held out by documents: with "90,10,0", the first 270 of the 300 documents train, the last 30 validate.
    assert set(first.splits["train"].indices.tolist()) == set(range(270))
    assert set(first.splits["val"].indices.tolist()) == set(range(270, 300))

    # A blend draws from each dataset in proportion to its weight. megatron.core's BlendedDataset asks for the
    # rank unconditionally: the main job always has a process group; here, a one-rank gloo group.
    import torch.distributed as dist

    ours = not dist.is_initialized()  # the test session may have one already
    if ours:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        check_blend(tmp_path)
    finally:
        if ours:
            dist.destroy_process_group()


def check_blend(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["a" * 40] * 100)
    write_jsonl(tmp_path / "b.jsonl", ["b" * 40] * 100)
    preprocess(str(tmp_path / "a.jsonl"), str(tmp_path / "a"))
    preprocess(str(tmp_path / "b.jsonl"), str(tmp_path / "b"))
    blend = IndexedCorpus([str(tmp_path / "a"), str(tmp_path / "b")], [0.75, 0.25], "90,10,0", 16, 0, 400, 32, 1,
                          257, 256, tmp_path / "cache")
    rows = blend.batch("train", 400, 16, 0, 0, 0)[0]
    from_a = int(((rows == ord("a")) | (rows == 256)).all(dim=1).sum())
    from_b = int(((rows == ord("b")) | (rows == 256)).all(dim=1).sum())
    assert from_a + from_b == 400 and 285 <= from_a <= 315  # 75 % of 400, Megatron's blending is exact to +-1 %


TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "2", "--seq-len", "32", "--eval-interval", "4",
        "--eval-batches", "2", "--log-interval", "4"]


def test_main_job_on_indexed_data_resumes_exactly_on_two_ranks(tmp_path):
    words_corpus(tmp_path / "w.jsonl", 400)
    preprocess(str(tmp_path / "w.jsonl"), str(tmp_path / "data" / "w"))
    cfg = json.loads((REPO / "configs" / "tiny_cpu.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 4
    cfg["scheduler"]["params"].update(total_num_steps=12, warmup_num_steps=2)
    cfg["pseudo_to_real"]["switch"] = {"at_step": 6}
    cfg["data"] = {"type": "indexed", "prefix": str(tmp_path / "data" / "w"), "split": "90,10,0"}
    config = tmp_path / "indexed.json"
    config.write_text(json.dumps(cfg))
    train = REPO / "launch" / "train.py"

    whole = run_two_ranks(train, "--deepspeed_config", str(config), "--output-dir", str(tmp_path / "whole"), *TINY)
    assert "indexed data: " in whole.stdout and "vocabulary 257" in whole.stdout
    run_two_ranks(train, "--deepspeed_config", str(config), "--output-dir", str(tmp_path / "cut"), "--steps", "4",
                  *TINY)
    resumed = run_two_ranks(train, "--deepspeed_config", str(config), "--output-dir", str(tmp_path / "cut"), *TINY)
    assert "at step 4 (pseudo stage)" in resumed.stdout and "rank 1 finished at step 12 stage real" in resumed.stdout

    def losses(run):
        return [(r["step"], r["stage"], r["train_loss"], r.get("val_loss"))
                for r in read_records(tmp_path / run / "metrics.jsonl") if "train_loss" in r]
    assert losses("cut") == losses("whole") and len(losses("whole")) == 12
    first, last = losses("whole")[0][2], losses("whole")[-1][2]
    assert last < first - 0.25  # it learns (5.57 -> 5.12 over the 12 steps)
    assert list((tmp_path / "whole" / "data_cache").glob("*-GPTDataset-train-shuffle_index.npy"))


def test_main_job_refuses_a_model_vocabulary_smaller_than_the_data(tmp_path):
    words_corpus(tmp_path / "w.jsonl", 50)
    preprocess(str(tmp_path / "w.jsonl"), str(tmp_path / "w"))
    cfg = json.loads((REPO / "configs" / "m6_tiny.json").read_text())
    del cfg["granular_offload"]
    cfg["m6"]["vocab_size"] = 200
    cfg["data"] = {"prefix": str(tmp_path / "w")}
    (tmp_path / "small.json").write_text(json.dumps(cfg))
    env = dict(os.environ, MASTER_PORT=str(free_port()), PYTHONPATH=python_path())
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--deepspeed_config",
                           str(tmp_path / "small.json"), "--output-dir", str(tmp_path / "out")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: m6.vocab_size: got 200; the data's tokenizer has 257 tokens" in proc.stderr
    assert "model:" not in proc.stdout
