"""Multi-turn rollouts: environments that answer the model between its turns (docs/agents.md)."""
