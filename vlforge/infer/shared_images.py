"""Identical images of one vision-tower call go through it once.

A server batch often holds requests that send the same picture; the vision tower would encode each
copy. Around the engine's calls, `share_identical_images(model, count)` puts two hooks on the vision
tower: before it runs, it keeps only the first copy of each repeated image's patches (and its grid
row), keyed by its grid and a digest of its patch rows (equal patches at an equal grid give equal
features); after, it copies each result row (the merged image embeddings, every deepstack layer's
features, the last hidden state) back to every image that repeats it, so the language model gets
exactly the rows it would have had.

Sharing changes nothing but the work: the vision tower's attention is per image (`cu_seqlens`) and
its position embeddings come from the image's own grid, so an image's features depend on its own
patches only. Hooks, not a second vision path: the engine's prefill keeps computing positions and
the KV cache its own way.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from vlforge.model.host_inputs import VISION_GRID_KWARGS, VisionGrid
from vlforge.model.tiers import unwrap


class _Plan:
    """Which patch rows of one vision call to keep, and how to copy the results back."""

    def __init__(self, keys: list, grid_thw: torch.Tensor, merge2: int, device: torch.device):
        first: dict = {}
        source = [first.setdefault(k, len(first)) for k in keys]  # image -> its distinct image
        self.saved = len(keys) - len(first)
        self.grid_thw = grid_thw
        patches = grid_thw.prod(-1).tolist()
        starts = [sum(patches[:i]) for i in range(len(patches))]
        self.distinct = [source.index(j) for j in range(len(first))]  # the first image of each distinct one
        # the row indices on the tower's device (`device`: the patch rows'), whatever the grid's: the
        # engine passes the tower a host grid (model/host_inputs.VisionGrid)

        def rows(count_of, start_of, images) -> torch.Tensor:
            return torch.cat([torch.arange(start_of[i], start_of[i] + count_of[i]) for i in images]).to(device)

        self.keep_patches = rows(patches, starts, self.distinct)
        # where each distinct image's rows lie in the tower's (shorter) output, per patch and per merged token
        out_patches = [sum(patches[i] for i in self.distinct[:j]) for j in range(len(self.distinct))]
        self.back_patches = rows([patches[self.distinct[j]] for j in source], [out_patches[j] for j in source],
                                 range(len(keys)))
        merged = [n // merge2 for n in patches]
        out_merged = [o // merge2 for o in out_patches]
        self.back_merged = rows([merged[self.distinct[j]] for j in source], [out_merged[j] for j in source],
                                range(len(keys)))
        self.total = sum(patches)

    def inputs(self, visual, hidden, kwargs):
        grid = self.grid_thw[self.distinct]
        # the grid's derived inputs, when the caller computed them (model/host_inputs.py), are the
        # whole call's: computed again for the distinct images' grid
        derived = VisionGrid.of(visual) if any(k in kwargs for k in VISION_GRID_KWARGS) else None
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hidden_states", "grid_thw", *VISION_GRID_KWARGS)}
        if derived is not None:
            kwargs.update(derived.kwargs_on(grid.cpu(), hidden.device))
        return (hidden.index_select(0, self.keep_patches),), {**kwargs, "grid_thw": grid}

    def outputs(self, out):
        if not hasattr(out, "pooler_output"):
            raise RuntimeError(f"the vision tower returned {type(out).__name__}, not the output with pooler_output "
                               "and deepstack_features this transformers version was expected to give")
        out.pooler_output = out.pooler_output.index_select(0, self.back_merged)
        if getattr(out, "deepstack_features", None) is not None:
            out.deepstack_features = [(f if torch.is_tensor(f) else torch.cat(list(f))).index_select(0, self.back_merged)
                                      for f in out.deepstack_features]  # a layer's rows, or its rows per image
        if getattr(out, "last_hidden_state", None) is not None and \
                out.last_hidden_state.shape[0] == len(self.keep_patches):
            out.last_hidden_state = out.last_hidden_state.index_select(0, self.back_patches)
        return out


def _call_args(args, kwargs):
    hidden = args[0] if args else kwargs.get("hidden_states")
    grid = args[1] if len(args) > 1 else kwargs.get("grid_thw")
    return hidden, grid


@contextmanager
def _hooked(model, plan_for) -> Iterator[None]:
    """Vision-tower hooks: `plan_for(hidden, grid)` gives a call's _Plan (None: the call is left alone)."""
    visual = unwrap(model).model.visual
    pending = []

    def before(module, args, kwargs):
        hidden, grid = _call_args(args, kwargs)
        plan = None if hidden is None or grid is None else plan_for(hidden, grid)
        if plan is None:
            return None
        pending.append(plan)
        return plan.inputs(module, hidden, kwargs)

    def after(module, args, kwargs, out):
        return pending.pop().outputs(out) if pending else None

    handles = [visual.register_forward_pre_hook(before, with_kwargs=True),
               visual.register_forward_hook(after, with_kwargs=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def patch_keys(hidden: torch.Tensor, grid_thw: torch.Tensor) -> list:
    """One key per image of a vision call: its grid and a digest of its patch rows (what the tower
    sees; one device-to-host copy of them)."""
    rows = hidden.detach().cpu().contiguous()
    keys, start = [], 0
    for g, n in zip(grid_thw.tolist(), grid_thw.prod(-1).tolist()):
        block = rows[start:start + n]
        digest = hashlib.blake2b(block.view(torch.uint8).numpy().tobytes(), digest_size=32).digest()
        keys.append((tuple(g), str(block.dtype), digest))
        start += n
    return keys


@contextmanager
def share_identical_images(model, count: Callable[[int], None] | None = None) -> Iterator[None]:
    """Within the block, every vision-tower call of `model` encodes each distinct image of the call
    once (keyed by patch_keys); `count(n)` hears how many images a call did not encode again."""
    merge2 = unwrap(model).model.visual.spatial_merge_size ** 2

    def plan_for(hidden, grid):
        # only images of equal grids can be equal: with none alike (one image, say) the patches are not
        # read back (a device-to-host copy waits for every queued decode step) nor hashed
        grids = [tuple(g) for g in grid.tolist()]
        if len(set(grids)) == len(grids):
            return None
        keys = patch_keys(hidden, grid)
        if len(set(keys)) == len(keys):
            return None
        plan = _Plan(keys, grid, merge2, hidden.device)
        if count is not None:
            count(plan.saved)
        return plan

    with _hooked(model, plan_for):
        yield


__all__ = ["patch_keys", "share_identical_images"]
