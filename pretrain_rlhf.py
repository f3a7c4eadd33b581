"""Entry point: ``torchrun --nproc-per-node=N pretrain_rlhf.py [flags]`` (see --help).

Bad input (a flag, the placement, a file the flags name, a checkpoint root)
is refused on rank 0 with one line naming it, and exit status 2 on every rank.
"""

import contextlib
import sys

from rlhf import platform
from rlhf.arguments import flag_of, parse_args
from rlhf.cli import UsageError, quiet_unless_first_rank, report
from rlhf.config import ConfigError
from rlhf.parallel import PlacementError

PROGRAM = "pretrain_rlhf.py"


def main(argv=None) -> int:
    try:
        with quiet_unless_first_rank():
            config = parse_args(argv)
    except UsageError as exc:
        return report(PROGRAM, exc)
    platform.init_distributed()
    import torch.distributed as dist

    try:
        run(config)
    except UsageError as exc:
        return report(PROGRAM, exc)
    finally:
        dist.destroy_process_group()
    return 0


def run(config) -> None:
    """Place the tasks, build the trainer (and resume it), train; bad input raises UsageError."""
    import torch.distributed as dist

    from rlhf.checkpoint import CheckpointError, resolve_checkpoint

    world = dist.get_world_size()
    with usage_errors():
        placement = config.build_placement(world)
    if dist.get_rank() == 0:
        print(f"world size {world}; placement:")
        for task, mesh in placement.meshes.items():
            reverse = " (reversed pipeline)" if mesh.reverse_pp else ""
            print(f"  {task:13s} ranks {list(mesh.ranks)} {mesh.strategy}{reverse}")
    from rlhf.job import build_trainer

    with usage_errors():
        try:
            if config.checkpoint.load:  # refuse a root with no complete checkpoint before building anything
                resolve_checkpoint(config.checkpoint.load, group=dist.group.WORLD)
            trainer = build_trainer(config, placement)
            if config.checkpoint.load:
                trainer.load(config.checkpoint.load)
        except CheckpointError as exc:
            raise UsageError(f"--load {config.checkpoint.load}: {exc}") from None
        trainer.train()  # a reward function failing on a batch raises a ConfigError on every rank


@contextlib.contextmanager
def usage_errors():
    """Turn the job's own input errors into UsageErrors naming the flag."""
    try:
        yield
    except PlacementError as exc:
        raise UsageError(f"invalid placement: {exc}") from None
    except ConfigError as exc:  # flags, a model directory, tokenizer, prompt file or reward function
        raise UsageError(f"{flag_of(exc.field_name)}: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
