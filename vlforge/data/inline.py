"""What every data module shares at the bottom: `DataError` and `ImageBytes` (an image given as bytes)."""

from __future__ import annotations

from dataclasses import dataclass


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
