"""Errors a training run stops with, in a module of their own: the CLI catches them without importing
the checkpoint code (and through it transformers) for every command."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; its torn copy is removed, the finished ones are kept."""
