"""One GEMM for the linears of a decoder layer that read the same input: q/k/v, and the MLP's gate/up.

    fused = FusedProjections(core)
    with fused.installed():          # inside: transformers' own attention and MLP code, unchanged,
        out = core.model.language_model(...)  # each group of projections computed as one GEMM

Why: in a decode step (tens of rows) each projection is a small GEMM bound by reading its weight
plus a launch. Measured in the compiled 2B step on an H200 (docs/benchmarks-log.md, 2026-12-03, "One GEMM for q/k/v"):
q/o 6.0 us and k/v 5.7 us a layer, 15-28% of HBM bandwidth, gate/up 9.5 us each at ~55%. One GEMM
over the group's weights reads the same bytes in one launch at the wider GEMM's efficiency.

Why hand-written: inductor merges GEMMs that share an input only under `freezing` (its concat-linear
pattern), which bakes the weights into the compiled code (GRPO changes them every step), and it does
not deduplicate identical GEMMs in an inference graph (checked on torch 2.14: three F.linear calls on
one weight stayed three extern mm calls).

How: a group's weights become views of one buffer [sum of out features, in features] (the same
values; each Parameter's `.data` is reassigned, the Parameter objects are kept, so an optimizer or
a precision policy holding them still holds them); inside `installed()` each member's forward is
replaced by one that, at the group's first call on an input, runs the GEMM over the whole buffer
and hands every member its part. Only weights that need no gradient are fused (inference models,
frozen LoRA bases, and the compute-dtype copies a GRPO rollout reads, PrecisionPolicy.inference_weights):
a trained weight keeps its own storage (`FusedProjections.prepare` says whose storage is rearranged).
Members must be exactly nn.Linear without bias; of a LoRA layer the frozen base layer is fused
(the adapters' terms are added by peft as before); FP8 and quantized layers keep their own forward.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from vlforge.model.tiers import fsdp_sharded

# set to True on a weight Parameter whose owner lets the engine make it a view of a fused buffer
# (FusedProjections.prepare; PrecisionPolicy.inference_weights' rollout copies)
FUSABLE = "vlforge_fusable"

# the projections of one input, per decoder-layer submodule
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


class _Group:
    """Linears reading one input whose weights are rows of one buffer. `wrappers`: the modules the
    layer calls (a LoRA layer around its base linear, else the linear itself)."""

    def __init__(self, wrappers: list[nn.Module]):
        self.wrappers = wrappers
        self.linears = [_base(m) for m in wrappers]
        self.sizes = [m.out_features for m in self.linears]
        self.buffer: torch.Tensor | None = None  # only while the weights are its views (prepare)
        self.parts: list[torch.Tensor] | None = None  # the GEMM's output split per member, until all took theirs
        self.input: torch.Tensor | None = None
        self.given: list[bool] = [False] * len(self.linears)
        self.forwards = [self._forward_of(i) for i in range(len(self.linears))]  # one function each: stable for dynamo

    def lora(self) -> bool:
        return any(w is not m for w, m in zip(self.wrappers, self.linears))

    def eligible(self, owned: bool) -> bool:
        """Plain linears without bias whose weights need no gradient, are plain tensors (not FSDP2's
        DTensors, not quantized or FP8 subclasses) of one dtype and width, and that nothing else
        changes during a forward (a merged LoRA adapter: peft unmerges it into the base weight inside
        the layer's own forward when adapters are disabled). `owned`: the weights' storage may be
        rearranged (see FusedProjections.prepare)."""
        weights = [m.weight for m in self.linears]
        w0 = weights[0]
        return owned and all(type(m) is nn.Linear and m.bias is None and "forward" not in m.__dict__
                             for m in self.linears) \
            and not any(getattr(w, "merged", False) for w in self.wrappers) \
            and all(type(w.data) is torch.Tensor and not w.requires_grad and w.dtype == w0.dtype
                    and w.device == w0.device and w.shape[1] == w0.shape[1] and w.dtype.is_floating_point
                    for w in weights)

    def shared_buffer(self) -> torch.Tensor | None:
        """The buffer whose consecutive rows the members' weights are (found from their storage, so
        a second engine on the model, or a call after weights were replaced and adopted again, finds
        the same one), or None."""
        weights = [m.weight for m in self.linears]
        storage, cols, offset = weights[0].untyped_storage(), weights[0].shape[1], 0
        for w, n in zip(weights, self.sizes):
            if w.untyped_storage().data_ptr() != storage.data_ptr() or w.storage_offset() != offset \
                    or not w.is_contiguous() or tuple(w.shape) != (n, cols):
                return None
            offset += n * cols
        if storage.nbytes() != offset * weights[0].element_size():
            return None
        if self.buffer is not None and self.buffer.data_ptr() == storage.data_ptr():
            return self.buffer
        return weights[0].new_empty(0).set_(storage, 0, (offset // cols, cols))

    def adopt(self) -> torch.Tensor:
        """Copy the members' weights into one buffer and make each weight a view of its rows. Outside
        inference mode: views of an inference tensor could never again be saved for backward (a LoRA
        base in training) nor written in place (a rollout copy's refresh)."""
        weights = [m.weight for m in self.linears]
        with torch.inference_mode(False), torch.no_grad():
            buffer = torch.empty((sum(self.sizes), weights[0].shape[1]), dtype=weights[0].dtype,
                                 device=weights[0].device)
            start = 0
            for w, n in zip(weights, self.sizes):
                buffer[start:start + n].copy_(w.data)
                w.data = buffer[start:start + n]
                start += n
        return buffer

    def _forward_of(self, i: int):
        def forward(x: torch.Tensor) -> torch.Tensor:
            # the first member called on an input computes every member's part (a member called again, or
            # on another input, starts over: always correct; transformers calls each once, in order)
            if self.parts is None or self.given[i] or x is not self.input:
                self.parts = list(self.gemm(x).split(self.sizes, dim=-1))
                self.input = x
                self.given = [False] * len(self.sizes)
            self.given[i] = True
            part = self.parts[i]
            if all(self.given):  # every member took its part: nothing is held past the layer
                self.parts = self.input = None
            return part
        return forward

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """The group's one GEMM: every member's output side by side (generate/fp8.py's groups run it in FP8)."""
        return F.linear(x, self.buffer)

    def clear(self) -> None:
        self.parts = self.input = None
        self.given = [False] * len(self.sizes)


def _base(module):
    """The linear whose weight a projection reads: a LoRA layer's frozen base layer (peft's
    lora.Linear calls its base_layer on its own input, then adds the adapters' product, which stays
    its own small GEMM), else the module itself."""
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Linear) else module


class FusedProjections:
    """The language model's fusable groups (GROUPS in every decoder layer) of `core`."""

    def __init__(self, core):
        self._core = weakref.ref(core)  # as the engine: held as long as the model lives, not longer
        self.groups: list[_Group] = []
        for layer in core.model.language_model.layers:
            for owner, names in GROUPS.items():
                module = getattr(layer, owner, None)
                wrappers = [getattr(module, n, None) for n in names]
                if module is not None and all(isinstance(_base(m), nn.Linear) for m in wrappers):
                    self.groups.append(_Group(wrappers))
        self._active: list[_Group] = []

    def prepare(self) -> int:
        """Before a generate call: adopt every eligible group whose weights are not yet views of one
        buffer (a first call, or weights replaced since); returns how many groups `installed` fuses.

        Whose storage is rearranged: a model none of whose parameters trains (serve, eval, infer,
        benchmarks), a LoRA layer's frozen base (peft checkpoints hold the adapters only), and
        weights their owner marks with FUSABLE (GRPO's rollout copies of fp32 masters). Not a frozen
        plain weight beside trained ones (a run whose language tier is frozen): a run saves such a
        model whole, and transformers' save_pretrained clones views of one buffer (a transient copy
        of them). Nothing under FSDP2: its gathered weights are views of its own all-gather buffers
        (a frozen LoRA base too), which a `.data` swap would cut off from the next gather."""
        self._active = []
        core = self._core()
        if fsdp_sharded(core):
            return 0
        trains = any(p.requires_grad for p in core.parameters())
        for g in self.groups:
            owned = not trains or g.lora() or all(getattr(m.weight, FUSABLE, False) for m in g.linears)
            if not g.eligible(owned):
                g.buffer = None  # held only through the weights, if they still are its views
                continue
            g.buffer = g.shared_buffer()
            if g.buffer is None:
                g.buffer = g.adopt()
            self._active.append(g)
        return len(self._active)

    @contextmanager
    def installed(self):
        """The prepared groups' fused forwards, for the forwards run inside."""
        try:
            for g in self._active:
                for m, forward in zip(g.linears, g.forwards):
                    m.forward = forward
            yield
        finally:
            for g in self._active:
                g.clear()
                for m in g.linears:
                    m.__dict__.pop("forward", None)
