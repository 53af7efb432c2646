"""Experiment trackers fed from the event log: TensorBoard (``join --tensorboard DIR``) and Weights & Biases
(``join --wandb PROJECT``), both optional extras (``pip install 'locomm[trackers]'``).

Each peer is one run of its own, grouped by the swarm's run id: TensorBoard writes ``DIR/<run id>/<peer id>``
(``tensorboard --logdir DIR`` shows every peer of every swarm side by side), W&B logs to ``PROJECT`` with
``group=<run id>`` and the peer id as the run's name (``WANDB_MODE=offline`` keeps it on disk, as the tests do).

What is logged, against the outer round (the step axis every peer shares): from each ``round`` event the train
loss, validation loss when measured, tokens/s, members, bytes sent and received and the seconds waited; from each
``eval`` event the validation loss; from a pipeline stage's ``step`` events the loss against the inner step. A
tracker that fails (a full disk, W&B's servers) is logged once and dropped: it never stops a peer.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from locomm.config import ConfigError

__all__ = ["Trackers"]

log = logging.getLogger(__name__)

ROUND_SCALARS = ("loss", "val_loss", "tokens_per_s", "members", "bytes_sent", "bytes_received", "wait_s")


def _scalars(fields: dict[str, Any], names: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for k in names:
        v = fields.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            out[k] = float(v)
    return out


class Trackers:
    """The trackers a peer was asked for; :meth:`__call__` is an event-log sink."""

    def __init__(self, *, tensorboard: Path | None = None, wandb_project: str | None = None) -> None:
        self.tensorboard_dir, self.wandb_project = tensorboard, wandb_project
        self._tb: Any = None
        self._wandb: Any = None
        self._run: Any = None
        self.started = False
        if tensorboard is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401, PLC0415
            except ImportError:
                raise ConfigError(
                    "--tensorboard needs the tensorboard package: pip install 'locomm[trackers]'"
                ) from None
        if wandb_project is not None:
            try:
                import wandb  # noqa: F401, PLC0415
            except ImportError:
                raise ConfigError("--wandb needs the wandb package: pip install 'locomm[trackers]'") from None

    @property
    def enabled(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb_project is not None

    def start(self, run_id: str, peer: str, config: dict[str, Any] | None = None) -> None:
        """Open the writers, once the peer knows its swarm's run id and its own id."""
        if self.started:
            return
        self.started = True
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

            self._tb = SummaryWriter(log_dir=str(Path(self.tensorboard_dir) / run_id / peer))
        if self.wandb_project is not None:
            import wandb  # noqa: PLC0415

            self._wandb = wandb
            self._run = wandb.init(
                project=self.wandb_project,
                group=run_id,
                name=peer,
                config=config or {},
                reinit=True,
                settings=wandb.Settings(silent=True, console="off"),
            )

    def __call__(self, event: str, fields: dict[str, Any]) -> None:
        if not self.started:
            return
        if event == "round" and isinstance(fields.get("round"), int):
            step, values = fields["round"], _scalars(fields, ROUND_SCALARS)
        elif event == "eval" and isinstance(fields.get("round"), int):
            step, values = fields["round"], _scalars(fields, ("val_loss",))
        elif event == "step" and isinstance(fields.get("step"), int):  # a pipeline stage, per inner step
            step, values = fields["step"], {f"stage_{k}": v for k, v in _scalars(fields, ("loss",)).items()}
        else:
            return
        if not values:
            return
        if self._tb is not None:
            try:
                for k, v in values.items():
                    self._tb.add_scalar(k, v, step)
            except Exception as e:  # noqa: BLE001 - a tracker never stops a peer
                log.warning("TensorBoard writer failed (%s); it is dropped", e)
                self._tb = None
        if self._run is not None:
            try:
                self._run.log(values, step=step)
            except Exception as e:  # noqa: BLE001
                log.warning("W&B logging failed (%s); it is dropped", e)
                self._run = None

    def close(self) -> None:
        if self._tb is not None:
            try:
                self._tb.close()
            except Exception as e:  # noqa: BLE001
                log.warning("closing the TensorBoard writer: %s", e)
            self._tb = None
        if self._run is not None:
            try:
                self._run.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("finishing the W&B run: %s", e)
            self._run = None
