"""The KV cache of the decode slots, in two layouts, and the attention that reads it.

SlotCache: per layer [slots, kv heads, L, D], a row's prompt and generated tokens in its own slot.
GroupCache: a request's G samples (GRPO's groups) share one copy of its prompt's KV, their
generated tokens interleaved after it. Both are handed to transformers' layers as
`past_key_values`; the decode attention functions registered here (`attention_as` selects one
for a step) read them with one query token per row.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

SLOT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
LENGTH_BUCKET = 128  # attention reads the cache up to the next multiple of this past the longest row
DECODE_ATTENTION = "vlforge_decode"  # the decode step's attention (SlotCache), registered below
GROUPED_ATTENTION = "vlforge_decode_grouped"  # GroupCache's (Engine(share_prompt=True))


def bucket(n: int, buckets=SLOT_BUCKETS) -> int:
    return next((b for b in buckets if b >= n), n)


def _mask_for(mask, query):
    """The additive step mask in the query's dtype (the engine builds one additive mask in the usual
    dtype; a layer an override runs in fp32 casts it)."""
    return mask if mask is None or mask.dtype == query.dtype else mask.to(query.dtype)


def _decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """One query token per row: the query heads of a KV head attend as one group ([S, kv heads,
    q heads / kv heads, D]), so grouped-query attention reads the KV cache once instead of
    repeating it per query head (transformers' sdpa path repeats it when a mask is given)."""
    S, Hq, q, D = query.shape
    Hkv = key.shape[1]
    if q != 1:
        raise RuntimeError("the decode attention takes one query token per row")
    out = F.scaled_dot_product_attention(query.reshape(S, Hkv, Hq // Hkv, D), key, value,
                                         attn_mask=_mask_for(attention_mask, query), scale=scaling)
    return out.reshape(S, Hq, 1, D).transpose(1, 2), None


def _decode_attention_grouped(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """GroupCache's decode attention: the G rows of a group (one prompt's samples) attend as G query
    tokens of one sequence whose keys are the prompt's (stored once) followed by the G rows' generated
    tokens interleaved; the [P, 1, G x q heads per kv head, Lk] mask lets each row see the prompt and
    its own tokens only. One SDPA call reads the prompt's KV once per group instead of once per row.
    query [P*G, q heads, 1, D], key/value [P, kv heads, Lk, D] -> [P*G, 1, q heads, D]."""
    S, Hq, q, D = query.shape
    P, Hkv = key.shape[:2]
    G = S // P
    if q != 1:
        raise RuntimeError("the decode attention takes one query token per row")
    q_PHQD = query.reshape(P, G, Hkv, Hq // Hkv, D).transpose(1, 2).reshape(P, Hkv, G * (Hq // Hkv), D)
    out = F.scaled_dot_product_attention(q_PHQD, key, value, attn_mask=_mask_for(attention_mask, query), scale=scaling)
    return out.reshape(P, Hkv, G, Hq // Hkv, D).transpose(1, 2).reshape(S, 1, Hq, D), None


AttentionInterface.register(DECODE_ATTENTION, _decode_attention)
AttentionInterface.register(GROUPED_ATTENTION, _decode_attention_grouped)


@contextmanager
def attention_as(config, name: str):
    """The layers' attention is `name` (DECODE_ATTENTION, GROUPED_ATTENTION) for the forwards inside."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def step_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A decode step's attention mask from its boolean `keep`: additive (0 where read, the dtype's
    minimum elsewhere: finite, so a padding row that reads nothing gets finite garbage, not NaN).
    Built once a step where SDPA would convert a boolean mask in every layer. (An eager microbenchmark had the grouped attention ~2x faster with it; in the
    compiled, captured 2B step the two measured the same, 3.61 vs 3.62 ms on an H200: the
    benchmark's gap was launch cost. docs/benchmarks-log.md, 2026-12-03, "The additive step mask".)"""
    return torch.where(keep, 0.0, torch.finfo(dtype).min).to(dtype)


class SlotCache:
    """The KV cache of the decode slots, passed to transformers' layers as `past_key_values`.

    keys/values: per layer [slots, kv heads, L, D], allocated once. Before each step, `bind` says
    how many slots the step runs (S), how far attention reads (Lb) and where each row writes
    (its own length: rows of different lengths share a step). transformers' attention calls
    `update(k, v, layer)` with the new token's [S, kv heads, 1, D] and attends to what it returns.
    """

    is_compileable = True  # static shapes: masking_utils never drops our mask for is_causal

    def __init__(self, layers: int, slots: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        # one spare position, never read: a [:S, :, :Lb] view is then never the whole buffer, so the
        # compiled step's Lb never meets a contiguity check that holds (which would specialize Lb on
        # the longest bucket and break decode.compiled_once's one compile)
        shape = (slots, kv_heads, length + 1, head_dim)
        dtypes = per_layer(dtype, layers)  # a layer whose attention an override runs in fp32 keeps fp32 keys
        self.keys = [torch.zeros(shape, dtype=d, device=device) for d in dtypes]
        self.values = [torch.zeros(shape, dtype=d, device=device) for d in dtypes]
        self.rows = torch.arange(slots, device=device)
        self.slots, self.length, self.dtype = slots, length, dtypes
        self.write_S = self.span_L = None

    def bind(self, write_S: torch.Tensor, span_L: torch.Tensor) -> None:
        """Rows write at write_S ([S]); attention reads len(span_L) positions. Sizes come from
        tensors, not Python ints, so a compiled step serves every bucket without recompiling."""
        self.write_S, self.span_L = write_S, span_L

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        S, Lb = key_states.shape[0], self.span_L.shape[0]
        rows = self.rows[:S]
        K[rows, :, self.write_S] = key_states[:, :, 0].to(K.dtype)
        V[rows, :, self.write_S] = value_states[:, :, 0].to(V.dtype)
        return K[:S, :, :Lb], V[:S, :, :Lb]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # not used for positions: every call passes explicit position ids and a 4-D mask

    def fill(self, slots_M: torch.Tensor, cache, rows_M: torch.Tensor, lengths_M: torch.Tensor, P: int) -> None:
        """Copy prefill KV (a DynamicCache over B left-padded prompts of length P) into slots:
        slot m gets prompt rows_M[m]'s last lengths_M[m] positions, at 0.. (padding stripped)."""
        j = torch.arange(P, device=slots_M.device)
        src_MP = (P - lengths_M[:, None] + j[None]).clamp(max=P - 1)  # past a row's length: masked anyway
        for layer, (K, V) in enumerate(zip(self.keys, self.values)):
            k, v = _layer_kv(cache, layer)
            idx = src_MP[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            K[slots_M, :, :P] = k[rows_M].gather(2, idx).to(K.dtype)
            V[slots_M, :, :P] = v[rows_M].gather(2, idx).to(V.dtype)

    def move(self, src: torch.Tensor, dst: torch.Tensor, filled: int) -> None:
        """Slots (GroupCache: groups) src's first `filled` positions into dst's (compaction)."""
        for K, V in zip(self.keys, self.values):
            K[dst, :, :filled] = K[src, :, :filled]
            V[dst, :, :filled] = V[src, :, :filled]


class GroupCache(SlotCache):
    """The KV cache of a call whose requests all have n = G >= 2 samples (GRPO's groups): one prompt's
    KV stored once for its G rows, the rows' generated tokens interleaved after it.

    keys/values: per layer [groups, kv heads, L, D]. Group p holds the rows of slots p*G .. p*G+G-1
    (one request). Positions 0..prompt length-1: the prompt's KV (SlotCache.fill, slots = groups);
    from `prompt_span` (the call's longest prompt) on: generated token t of member i at
    prompt_span + t*G + i, so the filled part is one prefix of the buffer and one SDPA call per
    group reads the prompt once (_decode_attention_grouped) where SlotCache's rows read it G times.
    """

    def __init__(self, layers: int, groups: int, group: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        super().__init__(layers, groups, kv_heads, length, head_dim, dtype, device)
        self.group, self.groups = group, groups
        self.rows = torch.arange(groups * group, device=device)  # the slots (route recording indexes them)
        # slot s is member s % G of group s // G, whichever row it holds (compaction moves whole groups)
        self.group_of, self.member_of = self.rows // group, self.rows % group
        self.group_PG = self.write_PG = None

    def bind(self, group_PG: torch.Tensor, write_PG: torch.Tensor, span_L: torch.Tensor) -> None:
        """Row (p, i) writes into group group_PG[p, i] at write_PG[p, i]; attention reads len(span_L)
        positions of the first P groups ([P, G] views: the row count P*G derives from P)."""
        self.group_PG, self.write_PG, self.span_L = group_PG, write_PG, span_L

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        K, V = self.keys[layer_idx], self.values[layer_idx]
        P, Lk = self.group_PG.shape[0], self.span_L.shape[0]
        group_S, write_S = self.group_PG.reshape(-1), self.write_PG.reshape(-1)
        K[group_S, :, write_S] = key_states[:, :, 0].to(K.dtype)
        V[group_S, :, write_S] = value_states[:, :, 0].to(V.dtype)
        return K[:P, :, :Lk], V[:P, :, :Lk]


def per_layer(dtype, layers: int) -> tuple[torch.dtype, ...]:
    """A KV dtype per layer: `dtype` itself when it is one (a tuple), else `dtype` for every layer."""
    return tuple(dtype) if isinstance(dtype, (tuple, list)) else (dtype,) * layers


def _layer_kv(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # older DynamicCache
