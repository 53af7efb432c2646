import dataclasses

import numpy as np
import pytest

from locomm.config import ConfigError, DataConfig
from locomm.data import BatchSampler, ByteTokenizer, CorpusError, TokenSplits, eval_batches, load_corpus
from locomm.data.corpus import EOS, shard_of


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo' + x  # ünïcode"
    ids = tok.encode(text)
    assert ids.max() < 256 and tok.decode(ids) == text


def test_stdlib_corpus_is_real_and_split_by_file(nano_splits):
    text = ByteTokenizer().decode(nano_splits.train[:200_000])
    assert "def " in text and "import " in text
    assert len(nano_splits.val) > 10_000
    # The unigram entropy of Python source is a few nats per byte, well below uniform.
    assert 2.5 < nano_splits.unigram_nats() < np.log(256)


def test_stdlib_corpus_is_deterministic():
    cfg = DataConfig(max_corpus_mb=0.5)
    a, b = load_corpus(cfg), load_corpus(cfg)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_text_folder_and_file(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i}.txt").write_text(f"document number {i} " * 50)
    (tmp_path / "blob.bin.dat").write_bytes(b"\x00\x01" * 100)  # unknown suffix: not read
    s = load_corpus(DataConfig(corpus=str(tmp_path), seq_len=16, val_percent=20))
    assert len(s.train) > len(s.val) > 0
    assert (s.train == EOS).sum() + (s.val == EOS).sum() == 40
    one = load_corpus(DataConfig(corpus=str(tmp_path / "doc0.txt"), seq_len=16))
    assert ByteTokenizer().decode(np.concatenate([one.train, one.val])) == "document number 0 " * 50


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_memmap(tmp_path, dtype):
    data = (np.arange(10_000) % 300).astype(dtype)
    path = tmp_path / "tokens.bin"
    data.tofile(path)
    s = load_corpus(DataConfig(corpus=str(path), bin_dtype=dtype, seq_len=32))
    assert np.array_equal(np.concatenate([s.train, s.val]), data)


def test_clear_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(DataConfig(corpus=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no text files"):
        load_corpus(DataConfig(corpus=str(tmp_path / "empty")))
    (tmp_path / "model.pt").write_bytes(b"PK\x03\x04\x00\x00binary")
    with pytest.raises(CorpusError, match="binary"):
        load_corpus(DataConfig(corpus=str(tmp_path / "model.pt")))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(CorpusError, match="multiple"):
        load_corpus(DataConfig(corpus=str(tmp_path / "odd.bin")))
    (tmp_path / "short.txt").write_text("hi")
    with pytest.raises(CorpusError, match="too small"):
        load_corpus(DataConfig(corpus=str(tmp_path / "short.txt")))


def test_contiguous_shards_are_disjoint_and_seeded(nano_spec, nano_splits):
    cfg = dataclasses.replace(nano_spec.data, sharding="contiguous")
    a0 = BatchSampler(nano_splits, cfg, seed=0, worker_id=0, num_workers=4)
    a0b = BatchSampler(nano_splits, cfg, seed=0, worker_id=0, num_workers=4)
    a1 = BatchSampler(nano_splits, cfg, seed=0, worker_id=1, num_workers=4)
    x0, y0 = a0.next()
    assert x0.shape == (cfg.batch_size, cfg.seq_len) and y0.shape == x0.shape
    assert np.shares_memory(a0.shard, nano_splits.train)  # views, not copies
    assert np.array_equal(x0, a0b.next()[0])
    assert not np.array_equal(x0, a1.next()[0])
    n = len(nano_splits.train)
    assert len(a0.shard) + len(a1.shard) <= n // 2 + 2
    with pytest.raises(ValueError):
        BatchSampler(nano_splits, cfg, seed=0, worker_id=4, num_workers=4)


def test_iid_is_the_default_and_each_stream_is_its_own(nano_spec, nano_splits):
    cfg = nano_spec.data
    assert cfg.sharding == "iid"
    a = [BatchSampler(nano_splits, cfg, seed=0, worker_id=w, num_workers=4) for w in range(4)]
    assert all(s.shard is nano_splits.train for s in a)  # every worker samples the whole split
    first = [s.next()[0] for s in a]
    assert all(not np.array_equal(first[0], f) for f in first[1:])
    # In a swarm the stream key comes from the peer id: same shard index, different windows.
    p = BatchSampler(nano_splits, cfg, seed=0, worker_id=3, num_workers=64, stream=2**63 + 5)
    q = BatchSampler(nano_splits, cfg, seed=0, worker_id=3, num_workers=64, stream=2**63 + 6)
    assert not np.array_equal(p.next()[0], q.next()[0])


def test_files_sharding_partitions_documents(nano_spec, nano_splits):
    cfg = dataclasses.replace(nano_spec.data, sharding="files")
    docs = nano_splits.train_docs
    assert docs is not None and docs[-1] == len(nano_splits.train)
    shards = [BatchSampler(nano_splits, cfg, seed=0, worker_id=w, num_workers=4).shard for w in range(4)]
    assert sum(len(s) for s in shards) == len(nano_splits.train)  # every document in exactly one shard
    assert min(len(s) for s in shards) > len(nano_splits.train) // 16  # hashing spreads the files
    # A stream without documents (.bin) is cut into blocks instead.
    bare = TokenSplits(train=nano_splits.train, val=nano_splits.val, description="bin")
    blocks = [shard_of(bare, "files", w, 4) for w in range(4)]
    assert sum(len(b) for b in blocks) == len(bare.train)
    with pytest.raises(CorpusError, match="too few"):
        BatchSampler(bare, dataclasses.replace(cfg, seq_len=len(bare.train)), seed=0, worker_id=0, num_workers=4)
    with pytest.raises(ConfigError, match="sharding"):
        DataConfig(sharding="random")


def test_eval_batches_fixed(nano_spec, nano_splits):
    a = eval_batches(nano_splits.val, nano_spec.data, 3)
    b = eval_batches(nano_splits.val, nano_spec.data, 3)
    assert len(a) == 3 and all(np.array_equal(x[0], y[0]) for x, y in zip(a, b))
