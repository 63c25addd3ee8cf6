"""Count the host-device syncs of a CPU run as if its device were a GPU (tests/test_host_syncs.py).

    with SyncCounter(model) as syncs:
        train_step(t, [batch], ...)
    syncs.by_site()   # {(kind, "file:line function", call): count}

On a GPU every read of a device tensor's value on the host (item, tolist, bool/int/float/format,
.cpu()), every op whose output size depends on device data (nonzero, boolean-mask indexing and
assignment, masked_select, unique, repeat_interleave without output_size) and every blocking
host-to-device copy (`.to(device)` without non_blocking, `torch.tensor(..., device=)`) stalls the
CPU until the GPU has drained its queue. On the CPU nothing syncs, so a TorchFunctionMode keeps
track of which tensors would live on the device: the model's parameters, buffers and gradients,
what is moved there, what a factory creates there, and every result of an op with such an input;
a sync-prone call on one of those is counted with its call site. "There" is the run's device
object or the `.device` of such a tensor (each read of it gives a fresh torch.device("cpu") that
is remembered), so `torch.zeros(n, device=x.device)` lands where x is. What this cannot see:
calls inside C++ (autograd backward, a kernel's internal syncs such as masked_scatter's backward
masked_select) and branches a library takes only on CUDA (the CPU AdamW is not the fused one).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

T = torch.Tensor
READS = {T.item: "item", T.tolist: "tolist", T.__bool__: "bool", T.__int__: "int", T.__float__: "float",
         T.__index__: "index", T.__format__: "format", T.cpu: "cpu", T.numpy: "numpy"}
SIZED = {T.nonzero: "nonzero", torch.nonzero: "nonzero", torch.argwhere: "nonzero", T.argwhere: "nonzero",
         T.masked_select: "masked_select", torch.masked_select: "masked_select", T.unique: "unique",
         torch.unique: "unique", T.unique_consecutive: "unique", torch.unique_consecutive: "unique"}
FACTORIES = {torch.tensor, torch.as_tensor, torch.arange, torch.zeros, torch.ones, torch.full, torch.empty,
             torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint}
ROOT = Path(__file__).resolve().parents[1]
_TORCH = str(Path(torch.__file__).parent)


DEVICE_GET = T.device.__get__


def _site() -> tuple[str, bool]:
    """The innermost frame outside torch (and this file): "path:line function", and whether it is vlforge's."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        if frame.filename.startswith(_TORCH) or frame.filename == __file__:
            continue
        path = Path(frame.filename)
        try:
            name = str(path.resolve().relative_to(ROOT))
        except ValueError:
            name = "/".join(path.parts[path.parts.index("site-packages") + 1:]) if "site-packages" in path.parts \
                else str(path)
        return f"{name}:{frame.lineno} {frame.name}", name.startswith("vlforge/")
    return "?", False


class SyncCounter(TorchFunctionMode):
    def __init__(self, model: torch.nn.Module, device: torch.device):
        super().__init__()
        self.accelerators = [device]  # the device objects that stand for the GPU (kept alive: compared by id)
        self.device = WeakIdKeyDictionary()
        self.calls: collections.Counter = collections.Counter()  # (kind, site, ours) -> count
        self._hooks = []
        for p in model.parameters():
            self.device[p] = True
            if p.requires_grad:  # gradients come from C++ autograd, which no mode sees
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda p: self.device.__setitem__(p.grad, True)))
        for b in model.buffers():
            self.device[b] = True

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _is_accelerator(self, d) -> bool:
        return any(d is a for a in self.accelerators)

    def _on_device(self, x) -> bool:
        return isinstance(x, torch.Tensor) and x in self.device

    def _count(self, kind: str) -> None:
        site, ours = _site()
        self.calls[(kind, site, ours)] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        on_device = any(self._on_device(x) for x in flat)
        self_arg = args[0] if args else None
        kind = None
        if func in READS and self._on_device(self_arg):
            kind = READS[func]
        elif func in SIZED and on_device:
            kind = SIZED[func]
        elif func in (T.__getitem__, T.__setitem__) and any(
                self._on_device(x) and x.dtype in (torch.bool, torch.uint8) for x in tree_flatten(args[1])[0]):
            kind = "bool_index_put" if func is T.__setitem__ else "bool_index"  # a nonzero first
        elif func in (T.repeat_interleave, torch.repeat_interleave) and kwargs.get("output_size") is None and (
                len(args) > 1 and self._on_device(args[1]) or self._on_device(kwargs.get("repeats"))
                or len(args) == 1 and self._on_device(args[0])):
            kind = "repeat_interleave"
        elif func in (torch.tensor, torch.as_tensor) and any(self._on_device(x) for x in tree_flatten(args[:1])[0]):
            kind = "tensor(device tensors)"
        elif func is torch.where and len(args) == 1 and on_device:
            kind = "nonzero"
        if kind:
            self._count(kind)
        out = func(*args, **kwargs)
        if func == DEVICE_GET:
            if self._on_device(self_arg):
                out = torch.device(out.type)
                self.accelerators.append(out)
            return out
        # where the result lives
        to_device = False
        if func in (T.to, T.cuda):
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (torch.device, str))), None))
            if func is T.cuda or self._is_accelerator(target):
                to_device = True
                if not self._on_device(self_arg):
                    if not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True):
                        self._count("h2d_blocking")
                    if out is self_arg:  # on the CPU no copy is made: keep the host copy apart
                        out = out.clone()
            elif target is not None:  # to the host
                if self._on_device(self_arg):
                    self._count("cpu")
                return out.clone() if out is self_arg else out
        elif func is T.cpu:
            return out.clone() if out is self_arg else out  # on the CPU no copy is made: keep the copies apart
        elif func in (T.numpy, T.tolist, T.item):
            return out
        elif func in FACTORIES and self._is_accelerator(kwargs.get("device")):
            to_device = True
            if func in (torch.tensor, torch.as_tensor) and kind is None:
                self._count("h2d_blocking")  # the data is copied from the host
        if to_device or on_device:
            for x in tree_flatten(out)[0]:
                if isinstance(x, torch.Tensor):
                    self.device[x] = True
        return out

    # ------------------------------------------------------------------ reports

    def by_site(self, ours_only: bool = False) -> dict:
        return {(k, s): n for (k, s, ours), n in sorted(self.calls.items()) if ours or not ours_only}

    def total(self, ours_only: bool = False) -> int:
        return sum(self.by_site(ours_only).values())

    def table(self) -> str:
        rows = sorted(self.calls.items(), key=lambda kv: (not kv[0][2], kv[0][1]))
        return "\n".join(f"{n:4d}  {kind:22s} {site}{'' if ours else '  (library)'}" for (kind, site, ours), n in rows)
