"""The planner's one error type: bad input the user can fix (the CLI prints it and exits 2)."""


class PlanError(ValueError):
    """Impossible sizes, unknown names, nothing that fits; the message says what to change."""
