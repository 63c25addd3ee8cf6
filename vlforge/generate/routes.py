"""MoE routes of a generation: the top-k experts every token went through, layer by layer.

    recorder = recorder_of(core)                  # None for a dense model; one per model, hooks kept
    with recorder.keep():                         # eager prefill: each router's [B*P, k] kept
        forward_shared(...)
    recorder.kept                                 # layer position -> [rows, k] expert ids
    with recorder.write_to(routes_LSTk, rows_S, write_S):   # a decode step (CUDA graph, compiled)
        forward_shared(...)                       # routes_LSTk[:, rows_S, write_S] = each row's experts

Written for router replay (train/moe.py replays them in the trainer's forward): the rollout's
expert choices, recorded where it made them, in its own kernels.

The routers are transformers' `Qwen3VLMoeTextTopKRouter` (`mlp.gate`); their forward returns
(logits [N, E], renormalised top-k weights [N, k], top-k expert ids [N, k]) in transformers
5.17 and 5.24 alike. A forward hook reads output[2].

The hooks are registered once for the model's life (before anything compiles it) and do nothing
outside `keep` / `write_to`: torch.compile does not guard on a module's hooks
(`torch._dynamo.config.skip_nnmodule_hook_guards`), so code compiled before a hook existed would
never call it. Inside a compiled decode step the hook traces (tensor ops only, no graph break):
its write position is the step's per-row KV positions (a device tensor the step updates), so a
captured CUDA graph replays the write at each step's own position.

Shapes: L MoE layers, S decode slots, T KV positions, k = top-k, N token rows of one forward.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn

NO_ROUTE = -1  # a position no router call was recorded for (padding, a response's last token)
ROUTE_DTYPE = torch.int16  # expert ids < 32768; [L, S, T, k] is ~25 MB for 30B-A3B x 64 x 512


def router_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, router) of every MoE layer; a router trained beside LoRA appears twice (peft's
    frozen original and its trained copy): only the one peft runs fires its hook."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    out = []
    for name, module in model.named_modules():
        if isinstance(module, Qwen3VLMoeTextTopKRouter):
            layer = int(name.split(".layers.")[1].split(".")[0])
            out.append((layer, module))
    return out


class RouteRecorder:
    """Forward hooks on every router of one model that record its top-k expert ids when asked."""

    def __init__(self, routers: list[tuple[int, nn.Module]]):
        self.layers = sorted({i for i, _ in routers})  # model layer index of each route row
        self.top_k = routers[0][1].top_k
        self.num_experts = routers[0][1].num_experts
        self.mode: str | None = None  # None (off) | "keep" | "write"
        self.kept: dict[int, torch.Tensor] = {}
        self.routes = self.rows = self.write = None
        position = {layer: p for p, layer in enumerate(self.layers)}
        self._handles = [m.register_forward_hook(self._hook(position[i])) for i, m in routers]

    def _hook(self, p: int):
        def record(module, args, output):
            if self.mode is None:
                return None
            experts_Nk = output[2]
            if self.mode == "keep":
                self.kept[p] = experts_Nk
            else:  # one token per row: row r's experts at its own KV position
                self.routes[p].index_put_((self.rows, self.write), experts_Nk.to(self.routes.dtype))
            return None
        return record

    @contextlib.contextmanager
    def keep(self):
        """Keep each layer's expert ids [N, k] of the forwards inside in `kept` (the last per layer)."""
        self.kept, self.mode = {}, "keep"
        try:
            yield self.kept
        finally:
            self.mode = None

    @contextlib.contextmanager
    def write_to(self, routes_LSTk: torch.Tensor, rows_S: torch.Tensor, write_S: torch.Tensor):
        """Write one-token-per-row forwards' expert ids to routes_LSTk[:, rows_S, write_S]."""
        self.routes, self.rows, self.write, self.mode = routes_LSTk, rows_S, write_S, "write"
        try:
            yield
        finally:
            self.routes = self.rows = self.write = self.mode = None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


_RECORDERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def recorder_of(core: nn.Module) -> RouteRecorder | None:
    """The model's recorder (its hooks registered on first call, then kept), or None for a dense
    model. Call it before the model is first compiled or run compiled (see the module docstring)."""
    if core in _RECORDERS:
        return _RECORDERS[core]
    routers = router_modules(core)
    recorder = RouteRecorder(routers) if routers else None
    _RECORDERS[core] = recorder
    return recorder
