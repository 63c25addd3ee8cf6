"""The decode step's model work as functions of tensors: the language model on one token per row
(the slot and the group layout) and the logits-to-token part, and their one torch.compile each.
The runner calls them eager (this module's names, looked up at each step) or as CompiledStep's.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.fx.experimental._config as fx_config
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

from vlforge.generate.forward import forward_shared
from vlforge.generate.routes import recorder_of
from vlforge.generate.sampling import sample

# what a failed torch.compile of a decode step raises (graph breaks under fullgraph, guards that
# specialized a marked size, backend failures): errors of the model itself are none of these
COMPILE_ERRORS = (torch._dynamo.exc.TorchDynamoException, ConstraintViolationError)


def decode_hidden(core, cache, tok_S1, mask_S11L, pos_S):
    """The language model on one token per row: last hidden states [S, H]."""
    pos_31S = pos_S[None, :, None].expand(3, -1, -1)
    out = forward_shared(core, tok_S1, mask_S11L, pos_31S, None, [], cache=cache, use_cache=True)
    return out.last_hidden_state[:, -1]


def decode_hidden_grouped(core, cache, tok_PG, mask_P1QL, pos_PG):
    """decode_hidden over GroupCache's P groups of G rows ([P, G] inputs, the mask built by Runner.step)."""
    pos_31S = pos_PG.reshape(-1)[None, :, None].expand(3, -1, -1)
    out = forward_shared(core, tok_PG.reshape(-1, 1), mask_P1QL, pos_31S, None, [], cache=cache, use_cache=True)
    return out.last_hidden_state[:, -1]


def pick(logits_SV, banned_V, is_stop_V, early_S, temperature_S, top_k_S, top_p_S, key_S, step_S, mode: str):
    """(tokens, log-probs) of one step from lm_head's logits: fp32, banned ids and (rows still
    under their min_new_tokens: early_S) stop ids at -inf, then `sample`. A function of tensors
    only, so the engine can torch.compile it apart from the layers (one small graph per mode;
    it fuses the passes over the [S, V] logits)."""
    V = logits_SV.shape[-1]
    drop_SV = banned_V[None, :V] | (early_S[:, None] & is_stop_V[None, :V])
    x_SV = logits_SV.float().masked_fill(drop_SV, float("-inf"))
    return sample(x_SV, temperature_S, top_k_S, top_p_S, key_S, step_S, mode)


def compiled_once(fn, varying: Callable[..., list[tuple[torch.Tensor, int]]],
                  graph_of: Callable[..., Any] | None = None):
    """torch.compile(fn) that one compile serves every slot and length bucket and every KV buffer
    length: static shapes but for the (tensor, dimension) pairs `varying(*args)` names, marked
    dynamic at every call (the slot count S, the length bucket Lb, the buffers' length).

    Why not dynamic=True: it makes every dimension of every tensor dynamic, all four of each of the
    2 x layers KV buffers' too, and the symbolic-shape reasoning over those symbols (sympy) made the
    trace slow: a 2B GRPO run's first step was still tracing 190 s in on an H200 (stack samples),
    and on a CPU the 2B trace (bench/decode_trace_time.py) took 164 s, 28 s this way. The buffers'
    slot count stays static (a buffer of more slots compiles again: GRPO and serve keep one). Without
    duck sizing: by default dynamo takes sizes equal in the first call for one symbol, so S == Lb
    in a first call would guard `S == Lb` and compile again later. Size 1 is specialized whatever
    the setting (hence Plan.floor: 2 slots for compiled steps); mark_dynamic fails loudly if the
    traced code specializes a marked size. The patch is process-wide while a call runs
    (ConfigModule.patch), which only matters to a compile running in another thread then.

    fullgraph: a graph break (a hook on the model that dynamo cannot trace, say) would split the step
    into pieces whose guards then specialized the marked sizes (a GRPO run died so in its first step
    on torch 2.11). A step that does not compile as one graph runs eager from then on, with a
    warning that says why: the run goes on at eager speed instead of stopping. `graph_of(*args)`:
    which of fn's graphs a call runs where a static argument makes several (pick's sampling mode):
    one that fails runs eager alone, the others stay compiled."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    failed: list[str] = []  # the reasons, one a graph that failed
    eager: set = set()  # the graphs (graph_of) that failed

    @functools.wraps(fn)
    def call(*args):
        graph = graph_of(*args) if graph_of is not None else None
        if graph in eager:
            return fn(*args)
        for tensor, dim in varying(*args):
            torch._dynamo.mark_dynamic(tensor, dim)
        try:
            with fx_config.patch(use_duck_shape=False):
                return compiled(*args)
        except COMPILE_ERRORS as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            failed.append(reason if graph is None else f"{graph}: {reason}")
            eager.add(graph)
            which = fn.__name__ if graph is None else f"{fn.__name__}, {graph}"
            warnings.warn(f"vlforge: the decode step ({which}) did not compile as one graph and runs eager "
                          f"from now on ({type(error).__name__}: {reason}). Generation still works, at eager speed; "
                          "an uncompiled engine (GRPO: rollout.compile=false) does not try.", RuntimeWarning, stacklevel=2)
            return fn(*args)

    call.compile_failure, call.eager = failed, eager  # (for tests)
    return call


def decode_varying(core, cache, tok_S1, mask_S11L, pos_S):
    varying = [(tok_S1, 0), (mask_S11L, 0), (mask_S11L, 3), (pos_S, 0), (cache.write_S, 0), (cache.span_L, 0),
               *((kv, 2) for kv in cache.keys + cache.values)]
    recorder = recorder_of(core)
    if recorder is not None and recorder.mode == "write":
        # MoE route recording: its hooks' [S] rows and [L, slots, length, k] routes
        varying += [(recorder.rows, 0), (recorder.routes, 2)]
    return varying


def decode_grouped_varying(core, cache, tok_PG, mask_P1QL, pos_PG):
    # the group count P (every [P, G] input, the mask's and the bound views'), the read length Lk; G stays static
    varying = [(tok_PG, 0), (mask_P1QL, 0), (mask_P1QL, 3), (pos_PG, 0), (cache.group_PG, 0), (cache.write_PG, 0),
               (cache.span_L, 0), *((kv, 2) for kv in cache.keys + cache.values)]
    recorder = recorder_of(core)
    if recorder is not None and recorder.mode == "write":
        varying += [(recorder.rows, 0), (recorder.write, 0), (recorder.routes, 2)]
    return varying


def pick_varying(logits_SV, banned_V, is_stop_V, *per_row_and_mode):
    return [(logits_SV, 0), *((t, 0) for t in per_row_and_mode[:-1])]  # the last one is the mode string


class CompiledStep:
    """The compiled decode step's three parts (made once per engine, at its first compiled call): the
    same names as this module's eager functions, so the runner takes either as a namespace."""

    def __init__(self):
        self.decode_hidden = compiled_once(decode_hidden, decode_varying)
        self.decode_hidden_grouped = compiled_once(decode_hidden_grouped, decode_grouped_varying)
        self.pick = compiled_once(pick, pick_varying, graph_of=lambda *args: args[-1])  # one graph a sampling mode

    @property
    def failure(self) -> str | None:
        """Why the compiled step runs eager (a compile failed: compiled_once); None if it compiled or was never tried."""
        for fn in (self.decode_hidden, self.decode_hidden_grouped, self.pick):
            if fn.compile_failure:
                return fn.compile_failure[0]
        return None
