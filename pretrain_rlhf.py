"""Entry point: ``torchrun --nproc-per-node=N pretrain_rlhf.py [flags]`` (see --help)."""

import sys
import warnings

from rlhf import platform
from rlhf.arguments import parse_args
from rlhf.parallel import Placement, PlacementError
from rlhf.tasks import MODELS


def main(argv=None) -> int:
    config = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    platform.init_distributed()
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        placement = Placement.from_plan(config.placement.plan(), world)
        placement.validate_models({model: config.models[model] for model in MODELS})
    except PlacementError as exc:
        if rank == 0:
            print(f"pretrain_rlhf.py: invalid placement: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if rank == 0:
        print(f"world size {world}; placement:")
        for task, mesh in placement.meshes.items():
            reverse = " (reversed pipeline)" if mesh.reverse_pp else ""
            print(f"  {task:13s} ranks {list(mesh.ranks)} {mesh.strategy}{reverse}")
    from rlhf.smoke import run_smoke

    run_smoke(config, placement)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
