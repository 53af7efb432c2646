"""The in-process transport: N virtual workers, the daemon's schedule and a network cost model."""

from locomm.protocol.timing import Limits
from locomm.sim.network import NetworkModel, parse_link
from locomm.sim.simulator import NetworkRun, SimResult, Simulator, network_for, replay_on, time_to_target
from locomm.sim.timeline import Schedule, Timeline, replay

__all__ = [
    "Limits",
    "NetworkModel",
    "NetworkRun",
    "SimResult",
    "Schedule",
    "Simulator",
    "Timeline",
    "network_for",
    "parse_link",
    "replay",
    "replay_on",
    "time_to_target",
]
