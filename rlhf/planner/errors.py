"""The planner's one error type."""


class PlannerError(ValueError):
    """Bad planner input (a preset, a hardware file, a batch setting) or a plan that cannot exist (no
    placement fits memory); the message names the input and what would be valid."""
