"""Device meshes and placements, per-task process groups, weight resharding, dealing samples to parts."""

from rlhf.parallel.mesh import Coord, ParallelStrategy, PlacementError, TaskMesh
from rlhf.parallel.placement import Placement, check_strategy_fits_model

__all__ = [
    "Coord",
    "ParallelStrategy",
    "Placement",
    "PlacementError",
    "TaskMesh",
    "check_strategy_fits_model",
]
