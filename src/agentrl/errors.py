"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, paths, flags). Printed as one line, exit code 2."""

    exit_code = 2


class RunError(UserError):
    """A run stopped by its environment (disk full, a dead learner process), not by bad input:
    one line, exit code 1; the run directory keeps its last complete checkpoint."""

    exit_code = 1
