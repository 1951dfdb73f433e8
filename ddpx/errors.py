"""The one exception type for user-facing errors.

Raise ``DdpxError("what is wrong; how to fix it")`` for bad input (config, files,
ports, options). The CLI prints it as one line and exits non-zero, never with a
traceback. Keep the message to one line naming the key/file/port and the fix.
"""


class DdpxError(Exception):
    """A problem the user can fix; printed as one line by the CLI."""

    exit_code = 2
