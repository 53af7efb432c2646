"""The in-process transport: N virtual workers and a network cost model."""

from locomm.sim.network import NetworkModel, parse_link, replay
from locomm.sim.simulator import SimResult, Simulator, network_for, time_to_target

__all__ = ["NetworkModel", "SimResult", "Simulator", "network_for", "parse_link", "replay", "time_to_target"]
