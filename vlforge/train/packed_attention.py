"""Attention for packed rows that computes each sample's own causal attention only.

With `sdpa`, transformers restricts a packed row's attention by a dense block-diagonal mask
[1, 1, T, T]: SDPA then has no flash kernel and computes the scores of the whole row (8x the
attention of the padded batch at 8 samples a row; measured slower than padding, docs/packing.md).
transformers' dense Qwen3-VL refuses flex_attention and flash-attn is not installed here, so this
module registers one more implementation through transformers' own extension points:

- `AttentionInterface` "vlforge_packed": a call that carries `packed_rows` (a `PackedRows`, passed
  by train/losses.backbone_hidden as a model kwarg, which transformers forwards to every decoder
  layer's attention) attends within each sample; every other call (padded batches, eval,
  generation, the vision tower) is transformers' own `sdpa_attention_forward`, unchanged.
- `AttentionMaskInterface` "vlforge_packed": transformers' `sdpa_mask`, except inside a packed
  forward (`packed_forward()`), where it returns None: the dense mask is never built.

Per sample, on CUDA (bf16/fp16, sm80+): torch's own `torch.nn.attention.varlen.varlen_attn` (flash
kernels over cu_seqlens, one call a layer); elsewhere (CPU, fp32, dropout, a torch without it):
SDPA per sample with is_causal=True over slices of the row (no mask; exact). Why kwargs and not a
context for the lengths: activation checkpointing recomputes a layer in backward, after the
forward's context is gone, but with the layer's own kwargs. Compiled decoder layers trace the
varlen call into their graph (it is a torch custom op with a fake kernel): it reads only the
`cu_seqlens` tensor and the row length, never the host lengths, so a compiled layer has no graph
break in the middle and, once the row length and the sequence count have gone dynamic (one
recompile each), does not recompile for a row's composition (the
per-sample fallback, which loops over host lengths, is compiler-disabled instead; both counted in
tests/test_packing.py).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from vlforge.model.varlen import flash_capable, half_dtype, kernel_takes, varlen_kernel

PACKED_ATTENTION = "vlforge_packed"
_IN_PACKED_FORWARD = contextvars.ContextVar("vlforge_packed_forward", default=False)


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, nothing for torch.compile to compare
class PackedRows:
    """A packed row's sequences, computed once per forward: `lengths` (host ints: every sample,
    then the filler tail as one more sequence, summing to the row length), `cu_seqlens` [n+1]
    int32 on the row's device (the varlen kernel's offsets), `max_len`, and `varlen`: torch's
    varlen_attn and its parameter names where the row's device runs it (CUDA sm80+), else None;
    looked up here, outside compiled code (inspect and the capability query are not traceable)."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor
    max_len: int
    varlen: tuple | None = None

    @classmethod
    def of(cls, seq_lens: list[int], row_length: int, device: torch.device) -> PackedRows:
        lengths = [int(n) for n in seq_lens if n > 0]
        if (filler := row_length - sum(lengths)) > 0:
            lengths.append(filler)
        if sum(lengths) != row_length:
            raise ValueError(f"packed row: seq_lens sum to {sum(seq_lens)}, more than the row's {row_length} tokens")
        cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        # one small host-to-device copy per forward (not per layer); pinned so it does not sync
        cu = (cu.pin_memory() if device.type == "cuda" else cu).to(device, non_blocking=True)
        varlen = varlen_kernel() if device.type == "cuda" and flash_capable(device.index or 0) else None
        return cls(tuple(lengths), cu, max(lengths), varlen)


@contextlib.contextmanager
def packed_forward():
    """Around a packed row's forward: the mask function builds no mask (the attention restricts itself)."""
    token = _IN_PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _IN_PACKED_FORWARD.reset(token)


def runs_sdpa(core) -> bool:
    """Whether the language model's unpacked calls run transformers' sdpa path: `sdpa`, or this
    module's implementation (which is sdpa for every call without packed rows)."""
    return core.model.language_model.config._attn_implementation in ("sdpa", PACKED_ATTENTION)


def per_sample_attention(core) -> bool:
    """Whether this model's packed rows would attend per sample without a [T, T] mask: sdpa (this
    module; already switched or not). eager and flex_attention build a dense mask over the whole
    row; flash_attention_2 is varlen too, but not installed where this is tested."""
    return runs_sdpa(core)


def packing_pays(core, device: torch.device, precision: str = "bf16") -> bool:
    """data.packing=auto: pack where a packed row runs the varlen flash kernel (a CUDA device of sm80+,
    a torch with varlen_attn, bf16/fp16 compute (`precision`: precision.mode), per-sample attention:
    sdpa). Measured there
    (one H200, docs/benchmarks.md, same process): 2B full at BASELINES.md's shapes (16% padding) 1.01-1.12x
    padding, 8B three-tier LoRA 1.17x, the mixed set (36% padding) 1.60x, eager 2B 1.07x; never
    slower since the step's host syncs went (docs/benchmarks-log.md, 2026-12-03). Not measured on the GPU: packed rows
    with FP8, QLoRA or an MoE model (MoE's packed rows equal its padded batch on the CPU,
    tests/test_moe.py). Elsewhere a packed row attends through the per-sample SDPA loop (CPU), a dense
    [T, T] mask (eager) or paths not measured packed (flex_attention,
    flash_attention_2): padded."""
    return per_sample_attention(core) and packing_problem(device, precision=precision) is None


def packing_problem(device: torch.device, attn_implementation: str = "sdpa", precision: str = "bf16") -> str | None:
    """Why data.packing=auto pads on `device` with these model settings (None: it packs); what
    packing_pays decides, from the config alone (vlforge doctor asks before any model loads)."""
    if attn_implementation != "sdpa":
        return (f"model.attention.implementation={attn_implementation}: auto packs only sdpa's per-sample "
                "attention (measured); data.packing=true packs anyway")
    if device.type != "cuda":
        return f"on {device.type} a packed row attends through a per-sample SDPA loop, not measured faster than padding"
    if precision not in ("bf16", "fp16"):
        return (f"precision.mode={precision}: the flash kernel takes half precision only, a packed row would attend "
                "through a per-sample SDPA loop")
    if varlen_kernel() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (its varlen flash kernel)"
    if not flash_capable(device.index if device.index is not None else torch.cuda.current_device()):
        return f"{device} has no flash kernels (compute capability below 8.0)"
    return None


def use_packed_attention(core) -> bool:
    """Switch the language model's config from `sdpa` to the packed implementation (True if it now
    uses it). Only sdpa: it is the same for every call without `packed_rows`, so eval, generation
    and padded batches are unchanged; eager stays the dense-mask reference, flash_attention_2 and
    flex_attention restrict packed rows themselves. The switch is permanent for the model (a
    recomputed layer in backward must call the same implementation as its forward did)."""
    text_config = core.model.language_model.config
    if text_config._attn_implementation == "sdpa":
        text_config._attn_implementation = PACKED_ATTENTION
    return text_config._attn_implementation == PACKED_ATTENTION


def varlen_usable(query: torch.Tensor, rows: PackedRows, dropout: float, scaling: float | None) -> bool:
    """Whether torch's varlen_attn can take this call (model/varlen.kernel_takes) on a row whose
    device runs it."""
    return kernel_takes(query, dropout, scaling, rows.varlen)


def _varlen_call(query_HqTD, key_HkTD, value_HkTD, rows: PackedRows, scaling):
    varlen_attn, params = rows.varlen
    Hq, Hk, T = query_HqTD.shape[0], key_HkTD.shape[0], query_HqTD.shape[1]
    # [T, H, D]; contiguous, as flash-attention's varlen entry points are called elsewhere (one
    # copy of q, k, v per layer, small next to the projections)
    dtype = half_dtype(query_HqTD)  # autocast's cast, as SDPA gets it (the copy happens anyway)
    q, k, v = (x.transpose(0, 1).to(dtype).contiguous() for x in (query_HqTD, key_HkTD, value_HkTD))
    kwargs = {}
    if Hk != Hq:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # older releases: repeat the KV heads (what transformers' sdpa path does with a mask)
            k, v = (x.repeat_interleave(Hq // Hk, dim=1) for x in (k, v))
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scaling
    # compiled, max_q = max_k = the row length, an upper bound of every sequence's (the kernel sizes
    # its grid by it; blocks past a sequence's end exit at once), not rows.max_len: the graph would
    # guard on that host int and recompile for every new longest sample
    max_len = T if torch.compiler.is_compiling() else rows.max_len
    out_THD = varlen_attn(q, k, v, rows.cu_seqlens, rows.cu_seqlens, max_len, max_len, **kwargs)
    return out_THD[None]


@torch.compiler.disable  # loops over the row's host lengths: out of compiled graphs (no guard, no recompile per row)
def _per_sample_call(query, key, value, rows: PackedRows, dropout, scaling):
    """SDPA over each sample's slice of the row, causal without a mask (flash on CUDA, exact on CPU)."""
    if query.shape[2] != sum(rows.lengths):  # (compiled callers skip the check in packed_rows_attention)
        raise ValueError(f"packed attention takes one row of {sum(rows.lengths)} tokens and no cache; "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    gqa = key.shape[1] != query.shape[1]
    outs, start = [], 0
    for n in rows.lengths:
        s = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(query[:, :, s], key[:, :, s], value[:, :, s], dropout_p=dropout,
                                                   is_causal=True, scale=scaling, enable_gqa=gqa))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)  # [1, T, Hq, D], as transformers' attention functions return


def packed_rows_attention(query, key, value, rows: PackedRows, dropout: float = 0.0,
                          scaling: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row. query [1, Hq, T, D], key/value
    [1, Hkv, T, D] (Hq a multiple of Hkv) -> [1, T, Hq, D]. The row length is checked against the
    host lengths outside compiled code (a compiled layer would guard on them; PackedRows.of checks
    the row it is built for)."""
    mismatch = not torch.compiler.is_compiling() and query.shape[2] != sum(rows.lengths)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2] or mismatch:
        raise ValueError(f"packed attention takes one row of {sum(rows.lengths)} tokens and no cache; "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    if varlen_usable(query, rows, dropout, scaling):
        return _varlen_call(query[0], key[0], value[0], rows, scaling)
    return _per_sample_call(query, key, value, rows, dropout, scaling)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_rows=None, **kwargs):
    if packed_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None:
        raise ValueError("packed attention got an attention mask: a packed row has none (its seq_lens restrict it)")
    return packed_rows_attention(query, key, value, packed_rows, dropout, scaling), None


def _mask(*args, **kwargs):
    return None if _IN_PACKED_FORWARD.get() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(PACKED_ATTENTION, _attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _mask)
