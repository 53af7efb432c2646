"""`locomm-peer swarm --pipeline SxR` lives in :mod:`locomm.cli.local_swarm` beside the data-parallel swarm.

These names stay importable from here for callers written before the two launchers became one.
"""

from locomm.cli.local_swarm import run_pipeline_swarm
from locomm.cli.swarm_view import stage_rows, timeline_stats
from locomm.cli.swarm_view import stage_table as table

__all__ = ["run_pipeline_swarm", "stage_rows", "table", "timeline_stats"]
