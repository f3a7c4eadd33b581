"""The fusion section (``fusion.*``): intra-stage (one fused training schedule) and inter-stage fusion."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config import ConfigError, check_field_types, check_positive_ints, check_range

MIGRATE_KV = ("yes", "no", "auto")
"""How migrated samples travel: with their K/V, as tokens to re-prefill, or the cheaper one as measured."""


@dataclass(frozen=True)
class FusionConfig:
    """Intra-stage fusion: actor and critic training run as one fused pipeline schedule instead of one
    serial 1F1B schedule each: the ``schedule`` file (tools/search_schedule.py), or without one a
    schedule searched after the first iteration from its measured stage times (``search_budget``
    nominal seconds of annealing, rlhf/schedule/search.py).

    Inter-stage fusion (docs/fusion.md): once the batch's unfinished samples fall to
    ``migration_threshold`` (a fraction; None: auto, chosen by rlhf.fusion.policy from the lengths
    and times measured so far), they migrate to a few generation instances (``migrate_kv``) and the
    freed ranks infer the finished samples while the rest generate. Instances count their
    unfinished samples every ``migration_check_every`` engine steps."""

    intra_stage_fusion: bool = False
    schedule: str | None = None
    search_budget: float = 10.0
    inter_stage_fusion: bool = False
    migration_threshold: float | None = None
    migrate_kv: str = "auto"
    migration_check_every: int = 4

    def __post_init__(self):
        check_field_types("fusion", self)
        if self.search_budget <= 0:
            raise ConfigError(f"search_budget={self.search_budget!r} must be a finite number of seconds > 0",
                              "fusion.search_budget")
        if self.schedule is not None and not self.intra_stage_fusion:
            raise ConfigError("a schedule is run only with intra_stage_fusion; turn it on or drop the schedule",
                              "fusion.schedule")
        if self.migration_threshold is not None:
            check_range("fusion", "migration_threshold", self.migration_threshold, 0.0, 1.0,
                         "a fraction of the batch in [0, 1] (0 never migrates), or auto")
            if not self.inter_stage_fusion:
                raise ConfigError("a migration threshold is used only with inter_stage_fusion; turn it on or drop "
                                  "the threshold", "fusion.migration_threshold")
        if self.migrate_kv not in MIGRATE_KV:
            raise ConfigError(f"migrate_kv {self.migrate_kv!r} is not one of {', '.join(MIGRATE_KV)}",
                              "fusion.migrate_kv")
        check_positive_ints("fusion", self, ("migration_check_every",))
