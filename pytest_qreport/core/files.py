"""The one way the plugin writes a file: a temporary file beside the target, then a rename over it."""
from __future__ import annotations

import os
import tempfile

__all__ = ["write_atomically"]


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path` (readers see old or new)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=".qreport-", suffix=".tmp", dir=directory)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)  # mkstemp makes 0600; a report or baseline is an ordinary file
        # errors="replace": a lone surrogate (from a non-UTF-8 file name, say) must not lose the whole file
        with os.fdopen(handle, "w", encoding="utf-8", errors="replace") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
