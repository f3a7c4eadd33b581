"""The PPO program (``pretrain_rlhf.py``), files in reading order.

    config.py     the job's values and their validation
    layout.py     the job laid out on a placement (batch sizes per mesh, the fused schedule)
    arguments.py  the flags -> a JobConfig
    dry_run.py    ``--dry-run``: what a launch will run, checked without processes
    job.py        tokenizer, prompts, starting weights, rewards -> the Trainer
    reward_fn.py  rule rewards: load, check, score on rank 0 and share
    trainer.py    the iteration, top to bottom
    update.py     the PPO epochs: losses, serial or fused schedules, the fused-schedule search

It may use the reward-model program (the tiny default trains its reward
model at start-up); nothing outside this package imports it.
"""
