"""User-facing errors: the CLI prints them as one line and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (config, paths, flags). Printed as one line, exit code 2."""

    exit_code = 2
