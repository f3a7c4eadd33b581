"""Pipeline runtime: running schedules (rlhf/schedule) on real ranks.

``compiler`` lowers a schedule and the models' placements into per-rank
instructions (pure), ``executor`` runs them, ``p2p`` is the one
point-to-point primitive, ``microbatch`` runs one micro-batch through a
task's pipeline, ``inference`` runs an inference task over a batch (a
Batch of outputs back), ``timeline`` records and exports what ran.
"""
