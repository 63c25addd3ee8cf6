"""Reading a checkpoint's files as data: nothing in them is unpickled but tensors and plain values.

`load_trusted` is torch.load(weights_only=True) with an error that names the file: one that holds
other objects (a pickled class, a function to call) is refused, a torn one called damaged.

Sharded checkpoints: torch.distributed.checkpoint reads a checkpoint's `.metadata` with
`pickle.load` and each non-tensor item (the optimizer's lr, betas, ...) with
`torch.load(weights_only=False)`: a checkpoint someone hands us could run code on `train.resume`.
DCP's reader and planner are its extension points, so SafeReader and SafeLoadPlanner replace
exactly those reads: the metadata through an unpickler
that builds only DCP's metadata classes (the pattern of Python's pickle docs, "Restricting
Globals": torch's weights_only unpickler reads torch.save's files, not a plain pickle, and DCP
offers no safe reader of its own), the items under `weights_only=True`, as DCP already reads the
tensors. Everything else (the file layout, resharding) stays DCP's.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from vlforge.config import ConfigError

_REFUSED_GLOBAL = re.compile(r"unsupported (?:global: )?GLOBAL (\S+)", re.I)  # torch's two phrasings


class ForeignObjects(ConfigError):
    """A checkpoint file that holds objects other than tensors and plain values (never unpickled)."""


def load_trusted(path: Path):
    """torch.load(path, weights_only=True): tensors, numbers, strings and their containers, never
    other objects. A file that needs them, or is torn, is a ConfigError naming it."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise ConfigError(f"{path} is unreadable ({e}): the file is damaged") from None
        found = _REFUSED_GLOBAL.search(str(e))
        raise ForeignObjects(f"{path} holds objects other than tensors and numbers"
                          f"{f' ({found.group(1)})' if found else ''}: vlforge never unpickles them (the file was "
                          "not written by vlforge, or was altered since)") from None
    except Exception as e:  # torch's readers raise RuntimeError, EOFError, KeyError, ... for a torn file
        detail = str(e).strip().splitlines()[0][:160] if str(e).strip() else "empty or cut short"
        raise ConfigError(f"{path} is unreadable ({type(e).__name__}: {detail}): the file is damaged (truncated or "
                          "overwritten)") from None


# (module, name) pairs DCP's metadata pickles (torch 2.6-2.14): its dataclasses, torch.Size and
# dtypes, the layout and memory-format encodings, and the path it records the save under.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layouts by name
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class RefusedObject(pickle.UnpicklingError):
    """A pickle asked for a global outside the allow-list."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise RefusedObject(f"{module}.{name} is not part of a DCP checkpoint's metadata")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata read builds only DCP's own classes (RefusedObject otherwise)."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner reading non-tensor items (numbers, tuples, names) with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            # the helper DefaultLoadPlanner.load_bytes itself calls (a private module of torch's since 2.2)
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def read_metadata(dcp_dir: str | Path):
    """A DCP checkpoint's metadata, read without unpickling anything but DCP's records; a refused or
    torn one is a ConfigError naming it."""
    path = Path(dcp_dir) / ".metadata"
    try:
        return SafeReader(str(dcp_dir)).read_metadata()
    except RefusedObject as e:
        raise ForeignObjects(f"{path} holds objects other than DCP's records ({e}): vlforge never unpickles them "
                             "(the file was not written by vlforge, or was altered since)") from None
    except Exception as e:  # pickle's errors, EOFError, OSError: a torn or missing file
        raise ConfigError(f"{path} is unreadable ({type(e).__name__}: {e}): the checkpoint is damaged") from None


def load_failure(error: BaseException) -> str:
    """What a failed dcp.load says in a line: its first rank's own exception (DCP's CheckpointException
    carries every rank's traceback), a refused object named as such."""
    failures = list((getattr(error, "failures", None) or {}).values())
    cause = failures[0][0] if failures and isinstance(failures[0], tuple) else failures[0] if failures else error
    text = str(cause).strip()
    if isinstance(cause, pickle.UnpicklingError) and "Weights only load failed" in text:
        found = _REFUSED_GLOBAL.search(text)
        return ("an item holds objects other than tensors and numbers" + (f" ({found.group(1)})" if found else "")
                + ": vlforge never unpickles them (the files were not written by vlforge, or were altered since)")
    return f"{type(cause).__name__}: {text.splitlines()[0][:200] if text else 'no detail'}"
