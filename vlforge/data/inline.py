"""What every data module shares at the bottom: `DataError`, `ImageBytes` (an image given as bytes), the
image limits and why a path is no readable file."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from vlforge.config import DataConfig

MAX_IMAGE_PIXELS = DataConfig.max_image_pixels  # the default limit, also for infer/chat
MAX_ASPECT = 200  # Qwen's image processor refuses a longer side over 200x the shorter one


class DataError(ValueError):
    """Bad input data (a dataset row, an image file): the message starts with where (`file:line:`) and says what to do."""


@dataclass(frozen=True, eq=False)
class ImageBytes:
    """An image held as bytes rather than a file: parquet / `datasets` sets' embedded images
    (`{"bytes": ..., "path": ...}`), OpenAI messages' data URLs. Opened through `jsonl.open_image`
    like a file (the same header checks and pixel limits); `name` says where it came from."""

    data: bytes
    name: str  # e.g. "train.parquet:row 12: images[0]" (the row and the column it was read from)

    def __str__(self) -> str:
        return f"{self.name} (an embedded image of {len(self.data):,} bytes)"

    def __repr__(self) -> str:  # never the bytes themselves in a message
        return f"ImageBytes({self.name!r}, {len(self.data)} bytes)"


def path_problem(path: str | Path) -> str | None:
    """Why `path` is no readable file, in words that follow its name ("not found", "is a directory,
    not a file", "is a symlink loop", ...), or None where it is one."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symlink loop (a link that leads back to itself, or too many in a row): link the file itself"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"is a broken symlink (to {os.readlink(path)})" if os.path.islink(path) else "not found"
        return f"cannot be read ({e.strerror})"
    if stat.S_ISDIR(mode):
        return "is a directory, not a file"
    if not stat.S_ISREG(mode):
        return "is not a regular file (a device, pipe or socket)"
    return None if os.access(path, os.R_OK) else "cannot be read (permission denied)"
