"""Errors a user can act on: the CLI prints them as one line and exits 2, no traceback."""


class UserError(Exception):
    """Wrong input, config or request: the message names the field/file and the bad value."""
