"""nanogen's data: prepare.py (download, verify, tokenize into memmaps), loader.py (batches: where
t, the continuation step, is made), stories.py (ROCStories and InsNet's synthetic benchmark)."""


class UserError(Exception):
    """A problem the user can fix (a flag, a file, the data): every command prints it as one line
    `error: ...` and exits with status 2.  Any other exception is a bug and keeps its traceback."""
