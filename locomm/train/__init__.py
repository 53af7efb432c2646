"""The inner loop: the whole model (:class:`Trainer`) or one pipeline stage (:mod:`locomm.train.stage`).

:func:`plan_memory` (:mod:`locomm.train.plan`) fits the inner step to a memory budget; a :class:`MemoryPlan`
passed to :class:`Trainer` or :class:`~locomm.train.stage.StageWorker` applies it.
"""

from locomm.train.plan import MemoryPlan, peer_plan, plan_memory
from locomm.train.trainer import Trainer, TrainResult, resolve_device, train

__all__ = ["MemoryPlan", "TrainResult", "Trainer", "peer_plan", "plan_memory", "resolve_device", "train"]
