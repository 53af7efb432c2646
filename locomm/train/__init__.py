"""The inner loop: the whole model (:class:`Trainer`) or one pipeline stage (:mod:`locomm.train.stage`)."""

from locomm.train.trainer import Trainer, TrainResult, resolve_device, train

__all__ = ["TrainResult", "Trainer", "resolve_device", "train"]
