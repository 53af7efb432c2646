"""Byte tokenizer, corpora and per-worker batch sampling."""

from locomm.data.corpus import BatchSampler, ByteTokenizer, CorpusError, TokenSplits, eval_batches, load_corpus

__all__ = ["BatchSampler", "ByteTokenizer", "CorpusError", "TokenSplits", "eval_batches", "load_corpus"]
