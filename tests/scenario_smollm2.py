"""3-rank scenario for tests/test_smollm2.py: the real SmolLM2-135M-Instruct, sharded two ways.

The HF directory converted from its GGUF is loaded with ``load_hf_weights``
at TP3 (ranks 0-2: its 9 heads and 3 KV heads admit tp 1 or 3, not 2) and
at PP2 (ranks 0-1, 15 layers a stage), one layout after the other, and runs
one forward pass of the parent's token ids. Each rank of a last stage returns
the max abs difference between its vocabulary slice of the logits and the same
columns of transformers' logits (computed by the parent). Rank 0 then loads the
whole model and generates two-turn greedy episodes on the engine (`FollowUp`: a
user message after the first turn, rendered by the chat template as a
continuation) for the parent to check each turn against transformers' greedy
generation from the same token prefix (TP engines run episodes in
tests/test_engine_generation.py).
"""

import gc

import torch
import torch.distributed as dist

from rlhf.checkpoint.hf import load_hf_weights, read_hf_config
from rlhf.data.tokenizer import HFTokenizer
from rlhf.engine import Engine, EngineConfig, Request, SamplingParams
from rlhf.envs.environment import Environment, EnvironmentStep
from rlhf.envs.episodes import EnvironmentDriver, EpisodeRunner
from rlhf.models.gpt import build_model
from rlhf.parallel import Placement
from rlhf.parallel.groups import build_task_groups, local_groups
from rlhf.pipeline.microbatch import pipeline_forward

PLAN = {"actor_train": {"ranks": "0-2", "tp": 3}, "critic_train": {"ranks": "0-1", "pp": 2}}
LAYOUTS = {"tp3": "actor_train", "pp2": "critic_train"}


TURN_TOKENS = 16


class FollowUp(Environment):
    """The user asks for a shorter answer after the first turn; the episode ends after the second."""

    def step(self, turn):
        if turn.index == 1:
            return EnvironmentStep(reward=1.0, done=True)
        return EnvironmentStep(observation=[{"role": "user", "content": "Say that again in five words."}])


@torch.no_grad()
def _episodes(hf_dir: str, cfg, prompts: list) -> list:
    """Two-turn greedy episodes of ``prompts`` on an engine of the whole model (this rank alone), as dicts."""
    tokenizer, groups = HFTokenizer(hf_dir), local_groups()
    model = build_model(cfg, "lm", groups.pg_collection, groups.stage, seed=0).eval()
    load_hf_weights(model, groups, hf_dir)
    engine = Engine(model, None, cfg, EngineConfig(num_blocks=64, block_size=16))
    params = SamplingParams(max_new_tokens=2 * TURN_TOKENS + 32, stop_token_ids=tokenizer.stop_token_ids)
    runner = EpisodeRunner(engine, EnvironmentDriver(FollowUp, tokenizer), tokenizer, max_turns=2,
                           max_response_len=params.max_new_tokens, max_turn_tokens=TURN_TOKENS)
    torch.set_num_threads(2)  # the other ranks are done
    episodes = runner.run([Request(str(i), p, params) for i, p in enumerate(prompts)])
    return [dict(prompt=list(e.prompt), tokens=list(e.tokens), mask=list(e.loss_mask), turns=e.turns)
            for e in episodes]


def run(hf_dir: str, ids: torch.Tensor, expected: torch.Tensor, chat_prompts: list) -> dict:
    groups = build_task_groups(Placement.from_plan(PLAN, dist.get_world_size()))
    cfg = read_hf_config(hf_dir).config
    out = {}
    for layout, task in LAYOUTS.items():
        g = groups[task]
        if g is not None:
            model = build_model(cfg, "lm", g.pg_collection, g.stage, seed=0).eval()
            load_hf_weights(model, g, hf_dir)
            logits = pipeline_forward(model, g, ids)
            if logits is not None:  # the last stage: the max abs error of this rank's logit columns
                start = g.tp_rank * logits.shape[-1]
                out[layout] = (logits - expected[..., start:start + logits.shape[-1]]).abs().max().item()
            del model
        gc.collect()  # one layout's model at a time
        dist.barrier()
    if dist.get_rank() == 0:
        out["episodes"] = _episodes(hf_dir, cfg, chat_prompts)
    return out
