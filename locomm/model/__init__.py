"""The Llama-style decoder and its size presets."""

from locomm.model.llama import LlamaModel, build_model

__all__ = ["LlamaModel", "build_model"]
