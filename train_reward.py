"""Entry point: ``torchrun --nproc-per-node=N train_reward.py --train-data FILE [flags]`` (see --help).

Trains a reward model from preference pairs (pairwise Bradley-Terry loss) on
any (dp, pp, tp) and writes our checkpoint, which pretrain_rlhf.py loads with
``--reward-model DIR`` / ``--critic-model DIR``, and an HF
``*ForSequenceClassification`` export in ``<save>/hf`` (docs/reward_model.md).
Bad input (a flag, the placement, a file the flags name, a checkpoint root)
is refused on rank 0 with one line naming it, and exit status 2 on every rank.
"""

from rlhf.cli import built_and_resumed, exit_process, run_program, usage_errors
from rlhf.reward_model.arguments import parse_args, reward_flag_of

PROGRAM = "train_reward.py"


def main(argv=None) -> int:
    return run_program(PROGRAM, parse_args, run, argv)


def run(config) -> None:
    """Place the reward model, build the trainer (and resume it), train, export; bad input raises UsageError."""
    import torch.distributed as dist

    from rlhf.reward_model.config import TASK
    from rlhf.reward_model.job import build_placement, build_reward_trainer, export_reward_model, save_tokenizer

    world = dist.get_world_size()
    with usage_errors(reward_flag_of):
        placement = build_placement(config, world)
    if dist.get_rank() == 0:
        mesh = placement[TASK]
        reverse = " (reversed pipeline)" if mesh.reverse_pp else ""
        print(f"world size {world}; the reward model trains on ranks {list(mesh.ranks)} {mesh.strategy}{reverse}")
    with usage_errors(reward_flag_of):
        ckpt = config.checkpoint
        trainer, tokenizer = built_and_resumed(ckpt, lambda: build_reward_trainer(config, placement),
                                               lambda built: built[0].load(ckpt.load))
    save_tokenizer(config, tokenizer)
    trainer.train()
    if config.checkpoint.save:
        out = export_reward_model(config.checkpoint.save, tokenizer)
        if dist.get_rank() == 0:
            print(f"saved {config.checkpoint.save}; HF export {out}")


if __name__ == "__main__":
    exit_process(main())
