"""The reward-model program (``train_reward.py``), files in reading order.

    config.py     the job's values and their validation
    arguments.py  the flags -> a RewardJobConfig
    job.py        tokenizer, preference data, starting weights -> the RewardTrainer; the HF export
    trainer.py    one optimizer step per iteration on preference pairs

It never imports the PPO program.
"""
