"""Entry point: ``torchrun --nproc-per-node=N pretrain_rlhf.py [flags]`` (see --help).

``python pretrain_rlhf.py --dry-run --world-size N [flags]`` checks a launch on N ranks without
starting processes or building models, and describes it (rlhf/ppo/dry_run.py).

Bad input (a flag, the placement, a file the flags name, a checkpoint root)
is refused on rank 0 with one line naming it, and exit status 2 on every rank.
"""

from rlhf.ppo.arguments import build_parser, config_from_args, dry_run_world_size, flag_of
from rlhf.cli import built_and_resumed, exit_process, run_program, usage_errors
from rlhf.ppo.dry_run import describe_placement, dry_run
from rlhf.ppo.layout import build_placement, plan_note

PROGRAM = "pretrain_rlhf.py"


def parse(argv):
    """The job's config from the flags, or None after a dry run (which prints its report)."""
    args = build_parser().parse_args(argv)
    dry_world = dry_run_world_size(args)
    config = config_from_args(args)
    if dry_world is None:
        return config
    with usage_errors(flag_of):
        print(dry_run(config, dry_world))
    return None


def main(argv=None) -> int:
    return run_program(PROGRAM, parse, run, argv)


def run(config) -> None:
    """Place the tasks, build the trainer (and resume it), train; bad input raises UsageError."""
    import torch.distributed as dist

    world = dist.get_world_size()
    with usage_errors(flag_of):
        placement = build_placement(config, world)
    if dist.get_rank() == 0:
        lines = [f"world size {world}; placement:", *plan_note(config, world), *describe_placement(placement)]
        print("\n".join(lines))
    from rlhf.ppo.job import build_trainer

    with usage_errors(flag_of):
        ckpt = config.checkpoint
        trainer = built_and_resumed(ckpt, lambda: build_trainer(config, placement), lambda t: t.load(ckpt.load))
        trainer.train()  # a reward function failing on a batch raises a ConfigError on every rank


if __name__ == "__main__":
    exit_process(main())
