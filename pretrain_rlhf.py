"""Entry point: ``torchrun --nproc-per-node=N pretrain_rlhf.py [flags]`` (see --help)."""

import sys
import warnings

from rlhf import platform
from rlhf.arguments import flag_of, parse_args
from rlhf.config import ConfigError
from rlhf.parallel import PlacementError


def main(argv=None) -> int:
    config = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    platform.init_distributed()
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    try:
        placement = config.build_placement(world)
    except (PlacementError, ConfigError) as exc:
        if rank == 0:
            what = f"{flag_of(exc.field_name)}: " if isinstance(exc, ConfigError) else "invalid placement: "
            print(f"pretrain_rlhf.py: {what}{exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    if rank == 0:
        print(f"world size {world}; placement:")
        for task, mesh in placement.meshes.items():
            reverse = " (reversed pipeline)" if mesh.reverse_pp else ""
            print(f"  {task:13s} ranks {list(mesh.ranks)} {mesh.strategy}{reverse}")
    from rlhf.checkpoint import CheckpointError, resolve_checkpoint
    from rlhf.job import build_trainer

    try:
        if config.checkpoint.load:  # refuse a root with no complete checkpoint before building anything
            resolve_checkpoint(config.checkpoint.load, group=dist.group.WORLD)
        trainer = build_trainer(config, placement)
        if config.checkpoint.load:
            trainer.load(config.checkpoint.load)
    except CheckpointError as exc:
        if rank == 0:
            print(f"pretrain_rlhf.py: --load {config.checkpoint.load}: {exc}", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    except ConfigError as exc:  # a model directory, tokenizer, prompt file or reward function the job cannot use
        return _refuse(exc, rank)
    try:
        trainer.train()
    except ConfigError as exc:  # a reward function failing on a batch (every rank raises the same error)
        return _refuse(exc, rank)
    dist.destroy_process_group()
    return 0


def _refuse(exc: ConfigError, rank: int) -> int:
    """Report ``exc`` against its flag (rank 0) and end the job with status 2."""
    import torch.distributed as dist

    if rank == 0:
        print(f"pretrain_rlhf.py: {flag_of(exc.field_name)}: {exc}", file=sys.stderr)
    dist.destroy_process_group()
    return 2


if __name__ == "__main__":
    sys.exit(main())
