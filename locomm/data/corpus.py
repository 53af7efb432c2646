"""Corpora: byte tokenizer, the default standard-library corpus, text, .bin memmaps, HF datasets.

Notable:
- The default corpus is this Python's own standard library source, found through
  ``sysconfig``: every machine that runs locomm has real training text with no
  download. Files are read in sorted order, so the token stream is the same on
  every machine with the same Python version.
- The validation split is chosen per file by a hash of its relative path, so it
  never moves when files are added elsewhere, and no file is in both splits.
- ``data.sharding`` says what a worker draws from. ``iid`` (default): windows
  from the whole training split, as a swarm pretraining on one dataset samples
  it (and as NoLoCo's and DiLoCo's experiments shard C4). ``files``: the
  documents whose path hashes to the worker's shard, as a dataset sharded by
  file. ``contiguous``: the worker's slice of the sorted stream (strongly
  non-IID on the stdlib corpus: one slice is mostly ``encodings/cp*.py``), for
  non-IID studies. In every mode the generator is seeded from (seed, the
  worker's stream key): a peer's key comes from its full peer id, so no two
  peers draw the same stream. Many simulated workers share one token array.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from locomm.config import DataConfig
from locomm.config.training import SHARDINGS

BOS, EOS, PAD = 256, 257, 258
TEXT_SUFFIXES = {
    ".py",
    ".txt",
    ".md",
    ".rst",
    ".json",
    ".toml",
    ".cfg",
    ".ini",
    ".c",
    ".h",
    ".html",
    ".css",
    ".js",
    ".csv",
    ".tex",
    ".yaml",
    ".yml",
    ".xml",
    ".sh",
}


class CorpusError(ValueError):
    """A corpus that cannot be used: missing path, no text, a binary file."""


class ByteTokenizer:
    """256 byte values plus BOS, EOS and PAD. Lossless for any bytes."""

    vocab_size = 259

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: np.ndarray | list[int]) -> str:
        arr = np.asarray(tokens)
        return bytes(arr[arr < 256].astype(np.uint8)).decode("utf-8", errors="replace")


@dataclass
class TokenSplits:
    """Token streams of one corpus: train and held-out validation."""

    train: np.ndarray  # (N,) uint16/uint32 token ids
    val: np.ndarray
    description: str
    train_docs: np.ndarray | None = None
    """(D + 1,) int64 start offsets of the training split's documents (the last is its length); None: one
    stream with no document boundaries (a .bin memmap), which ``files`` sharding cuts into blocks."""
    train_doc_keys: np.ndarray | None = None
    """(D,) uint64 hash of each training document's name (path relative to the corpus root, or row index)."""

    def unigram_nats(self) -> float:
        """Entropy (nats/token) of the validation split's unigram distribution."""
        counts = np.bincount(self.val.astype(np.int64))
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


def _is_val(rel_path: str, val_percent: float) -> bool:
    h = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:8], "little")
    return (h % 10_000) < val_percent * 100


def _looks_binary(chunk: bytes) -> bool:
    return b"\x00" in chunk


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: Path) -> list[Path]:
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not (skip & set(p.relative_to(root).parts)))


def _read_files(files: list[Path], root: Path, cfg: DataConfig, strict: bool) -> TokenSplits:
    budget = int(cfg.max_corpus_mb * 1e6)
    train_parts: list[bytes] = []
    train_names: list[str] = []
    val_parts: list[bytes] = []
    total = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError as e:
            if strict:
                raise CorpusError(f"cannot read {f}: {e}") from None
            continue
        if _looks_binary(data[:8192]):
            if strict:
                raise CorpusError(
                    f"{f} looks like a binary file (it contains NUL bytes); "
                    "give a text file, a folder of text files or a .bin token file"
                )
            continue
        if not data.strip():
            continue
        rel = f.relative_to(root).as_posix() if f != root else f.name
        if _is_val(rel, cfg.val_percent):
            val_parts.append(data)
        else:
            train_parts.append(data)
            train_names.append(rel)
        total += len(data)
        if total >= budget:
            break
    if not train_parts and not val_parts:
        raise CorpusError(f"corpus at {root} holds no text files")
    if not val_parts or not train_parts:
        # Too few files to split by file: split the one stream by bytes instead.
        blob = b"".join(train_parts + val_parts)
        cut = int(len(blob) * (1 - cfg.val_percent / 100))
        if cut < cfg.seq_len + 1 or len(blob) - cut < cfg.seq_len + 1:
            raise CorpusError(f"corpus at {root} is too small ({len(blob)} bytes) for seq_len={cfg.seq_len}")
        train_parts, val_parts, train_names = [blob[:cut]], [blob[cut:]], [root.name]
    return _splits(train_parts, train_names, val_parts, f"{root} ({total / 1e6:.1f} MB text)")


def _splits(train_parts: list[bytes], train_names: list[str], val_parts: list[bytes], description: str) -> TokenSplits:
    train, docs = _join(train_parts)
    return TokenSplits(
        train=train,
        val=_join(val_parts)[0],
        description=description,
        train_docs=docs,
        train_doc_keys=np.array([_name_hash(n) for n in train_names], dtype=np.uint64),
    )


def _name_hash(name: str) -> int:
    """A document's shard key; salted apart from the validation split's hash, so shards are independent of it."""
    return int.from_bytes(hashlib.sha256(b"locomm-shard\0" + name.encode()).digest()[:8], "little")


def _join(parts: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents as bytes, each followed by EOS, into one uint16 stream; and their start offsets."""
    n = sum(len(p) + 1 for p in parts)
    out = np.empty(n, dtype=np.uint16)
    starts = np.empty(len(parts) + 1, dtype=np.int64)
    i = 0
    for j, p in enumerate(parts):
        starts[j] = i
        out[i : i + len(p)] = np.frombuffer(p, dtype=np.uint8)
        out[i + len(p)] = EOS
        i += len(p) + 1
    starts[-1] = i
    return out, starts


def _load_bin(path: Path, cfg: DataConfig) -> TokenSplits:
    dtype = np.dtype(cfg.bin_dtype)
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise CorpusError(
            f"{path}: size {size} is not a non-zero multiple of {cfg.bin_dtype} "
            f"({dtype.itemsize} bytes); is data.bin_dtype right?"
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    cut = int(len(tokens) * (1 - cfg.val_percent / 100))
    if cut < cfg.seq_len + 1 or len(tokens) - cut < cfg.seq_len + 1:
        raise CorpusError(f"{path}: {len(tokens)} tokens is too few for seq_len={cfg.seq_len}")
    return TokenSplits(train=tokens[:cut], val=tokens[cut:], description=f"{path} ({len(tokens)} tokens)")


def _no_remote_code(version: str) -> dict[str, bool]:
    """``trust_remote_code=False`` for ``datasets.load_dataset``: never run a dataset's loading script (a spec
    from the swarm may name any dataset id). datasets 4 runs no scripts at all, and logs an error when the
    argument is passed, so it gets nothing there."""
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    return {} if major >= 4 else {"trust_remote_code": False}


def _load_hf(spec: str, cfg: DataConfig) -> TokenSplits:
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise CorpusError("corpus 'hf:...' needs the optional 'datasets' package: pip install 'locomm[hf]'") from None
    name, _, subset = spec.partition(":")
    try:
        ds = datasets.load_dataset(name, subset or None, split="train", **_no_remote_code(datasets.__version__))
    except Exception as e:  # network, missing dataset: a clear message, not a traceback
        raise CorpusError(f"cannot load Hugging Face dataset {spec!r}: {e}") from None
    col = "text" if "text" in ds.column_names else ds.column_names[0]
    budget = int(cfg.max_corpus_mb * 1e6)
    train_parts: list[bytes] = []
    train_names: list[str] = []
    val_parts: list[bytes] = []
    total = 0
    for i, row in enumerate(ds):
        data = str(row[col]).encode("utf-8")
        if _is_val(f"{i}", cfg.val_percent):
            val_parts.append(data)
        else:
            train_parts.append(data)
            train_names.append(f"{i}")
        total += len(data)
        if total >= budget:
            break
    if not train_parts or not val_parts:
        raise CorpusError(f"Hugging Face dataset {spec!r} gave too little text")
    return _splits(train_parts, train_names, val_parts, f"hf:{spec}")


def load_corpus(cfg: DataConfig) -> TokenSplits:
    """Read the corpus a data config names. Raises CorpusError with a clear message."""
    if cfg.corpus == "stdlib":
        root = stdlib_root()
        files = _stdlib_files(root)
        if not files:
            raise CorpusError(f"no Python standard library source found under {root}")
        splits = _read_files(files, root, cfg, strict=False)
        splits.description = f"Python standard library at {root} ({len(splits.train) + len(splits.val):,} bytes)"
        return splits
    if cfg.corpus.startswith("hf:"):
        return _load_hf(cfg.corpus[3:], cfg)
    path = Path(cfg.corpus).expanduser()
    if not path.exists():
        raise CorpusError(f"corpus path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".bin":
        return _load_bin(path, cfg)
    if path.is_file():
        return _read_files([path], path, cfg, strict=True)
    files = sorted(p for p in path.rglob("*") if p.is_file() and (p.suffix in TEXT_SUFFIXES or not p.suffix))
    if not files:
        raise CorpusError(f"folder {str(path)!r} holds no text files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return _read_files(files, path, cfg, strict=False)


FILE_BLOCK = 1 << 16
"""Tokens per block when ``files`` sharding meets a stream with no document boundaries (a .bin memmap)."""


def shard_of(splits: TokenSplits, sharding: str, worker_id: int, num_workers: int) -> np.ndarray:
    """The tokens worker ``worker_id`` of ``num_workers`` draws its windows from (a view unless ``files``)."""
    tokens = splits.train
    n = len(tokens)
    if sharding == "iid" or num_workers == 1:
        return tokens
    if sharding == "contiguous":
        return tokens[worker_id * n // num_workers : (worker_id + 1) * n // num_workers]
    if sharding != "files":
        raise ValueError(f"data.sharding: {sharding!r} is not one of {SHARDINGS}")
    if splits.train_docs is not None and splits.train_doc_keys is not None:
        starts, keys = splits.train_docs, splits.train_doc_keys
    else:  # no documents: blocks of FILE_BLOCK tokens, keyed by their index
        starts = np.append(np.arange(0, n, FILE_BLOCK, dtype=np.int64), n)
        keys = np.array([_name_hash(f"block{i}") for i in range(len(starts) - 1)], dtype=np.uint64)
    mine = np.flatnonzero(keys % np.uint64(num_workers) == np.uint64(worker_id))
    if len(mine) == 0:
        return tokens[:0]
    return np.concatenate([tokens[starts[i] : starts[i + 1]] for i in mine])


class BatchSampler:
    """Random (B, T+1) windows from one worker's shard of the training split (``data.sharding``).

    ``stream`` keys the generator with ``seed``: the worker id in a simulation, a number drawn from the
    peer id in a swarm, so peers that share a shard index still draw different windows.
    """

    def __init__(
        self,
        splits: TokenSplits,
        cfg: DataConfig,
        seed: int,
        worker_id: int = 0,
        num_workers: int = 1,
        *,
        stream: int | None = None,
    ) -> None:
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id {worker_id} is not in [0, {num_workers})")
        self.shard = shard_of(splits, cfg.sharding, worker_id, num_workers)
        if len(self.shard) < cfg.seq_len + 2:
            raise CorpusError(
                f"worker {worker_id} of {num_workers} gets {len(self.shard)} training tokens under "
                f"data.sharding={cfg.sharding!r} (training split {len(splits.train)} tokens), too few for "
                f"seq_len={cfg.seq_len}"
            )
        self.seq_len = cfg.seq_len
        self.batch_size = cfg.batch_size
        key = worker_id if stream is None else stream
        self.rng = np.random.Generator(np.random.PCG64([seed, key & (2**64 - 1), 0x10C0]))

    def state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (B, T) int64."""
        starts = self.rng.integers(0, len(self.shard) - self.seq_len - 1, size=self.batch_size)
        return _windows(self.shard, starts, self.seq_len)


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (B, T+1)
    return w[:, :-1], w[:, 1:]


def eval_batches(tokens: np.ndarray, cfg: DataConfig, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of evenly spaced validation windows (the same for every worker and run)."""
    n_windows = n_batches * cfg.batch_size
    last = len(tokens) - cfg.seq_len - 1
    if last < 0:
        raise CorpusError(f"validation split ({len(tokens)} tokens) is shorter than seq_len={cfg.seq_len}")
    starts = np.linspace(0, last, n_windows).astype(np.int64)
    return [_windows(tokens, starts[i : i + cfg.batch_size], cfg.seq_len) for i in range(0, n_windows, cfg.batch_size)]
