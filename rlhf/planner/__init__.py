"""The execution planner (PURE: no torch): model shapes and the one parameter count, hardware files, the
cost model, plans, reshard bytes, the iteration simulator, inter-stage fusion as one call, the placement
search, calibration and ReaL's appendix plans (docs/planner.md; tools/plan_placement.py)."""
