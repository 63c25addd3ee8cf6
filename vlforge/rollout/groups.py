"""Batched GRPO rollouts: each prompt's image is encoded once and shared by its G responses.

Shapes: B prompts, G responses per prompt, N = B*G sequences, P prompt length (left-padded),
R response length (right-padded), H hidden size, V vocabulary.

    generate_groups     G responses per prompt on generate/'s engine (each prompt prefilled once)
    Rollout             what a rollout gives the update: tokens, masks, images, sampling log-probs,
                        MoE routes; Rollout.host its one host copy

The trainer's log-probs of those responses are rollout/logprobs.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vlforge.config import RolloutConfig
from vlforge.data.encode import Encoder
from vlforge.generate.engine import Engine
from vlforge.generate.requests import GenRequest, prompts_of_batch
from vlforge.generate.forward import (ImageFeatures, cache_of, encode_images, feature_groups,  # noqa: F401
                                      filter_logits, forward_shared, never_generated, rope_positions, token_logprobs)
from vlforge.generate.routes import NO_ROUTE


@dataclass
class Rollout:
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    images_per_prompt: list[int]
    response_ids: torch.Tensor  # [N, R] right-padded with pad_id
    response_mask: torch.Tensor  # [N, R] 1 on generated tokens (EOS included)
    logprobs: torch.Tensor  # [N, R] rollout policy log-probs of the sampled tokens (0 where masked)
    finished: torch.Tensor  # [N] ended with EOS (False: hit max_new_tokens)
    group_size: int
    banned_ids: list[int]  # never sampled; masked identically when the trainer recomputes log-probs
    # rollout.router_replay (MoE): [L, N, P + R, k] int16 top-k expert ids per MoE layer of every prompt and
    # response token, in the columns of cat(prompt_ids, response_ids); NO_ROUTE (-1) where none was recorded
    # (padding, each response's last token: the rollout never ran it)
    routes: torch.Tensor | None = None
    # multi-turn tool rollouts (rollout/multiturn.py): [N, R] 1 on the tokens the policy generated, 0 on
    # the tool results and chat headers between its turns (in response_mask: attended, not trained);
    # None: every response token was generated
    generated_mask: torch.Tensor | None = None
    # multi-turn rollouts whose tools returned images: every sequence's tool images' patch rows, one
    # sequence after another, their grids, and how many each sequence has (None: no tool images)
    response_pixel_values: torch.Tensor | None = None
    response_image_grid_thw: torch.Tensor | None = None
    images_per_response: list[int] | None = None

    def images_of_seq(self, n: int) -> int:
        """The images sequence n's forward reads: its prompt's, and those its tools returned."""
        own = self.images_per_response[n] if self.images_per_response is not None else 0
        return self.images_per_prompt[self.prompt_of_seq[n]] + own

    @property
    def loss_mask(self) -> torch.Tensor:
        """[N, R] the response tokens the policy generated: the ones its loss and log-probs are of."""
        return self.response_mask if self.generated_mask is None else self.generated_mask

    @property
    def prompt_of_seq(self) -> list[int]:
        return [n // self.group_size for n in range(self.response_ids.shape[0])]

    @functools.cached_property
    def host(self) -> RolloutHost:
        """The token ids, masks and image grids on the host, copied once (a sync on a GPU, at the first
        read: the update's first forward) for every forward of the update: sequence_logprobs lays out
        its forwards (positions, packing, the response tokens' places) from them, reading no device
        value. The rollout's tensors are not changed after it is made (a change would not reach here)."""
        cpu = lambda t: None if t is None else t.to("cpu", copy=True)  # noqa: E731  (a copy on the CPU too)
        return RolloutHost(cpu(self.prompt_ids), cpu(self.prompt_mask), cpu(self.response_ids),
                           cpu(self.response_mask), cpu(self.image_grid_thw), cpu(self.loss_mask),
                           cpu(self.response_image_grid_thw))


@dataclass(frozen=True)
class RolloutHost:
    """A Rollout's token ids, masks and image grids on the host (Rollout.host)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    image_grid_thw: torch.Tensor | None
    loss_mask: torch.Tensor
    response_image_grid_thw: torch.Tensor | None = None


@torch.no_grad()
def rollout_seed() -> int:
    """The seed of one rollout round, from the global RNG: the same on every rank as long as every
    rank draws it once per round (GRPO's rollout_round draws it before a rank with no prompt left
    returns, so the ranks' RNG streams stay in step)."""
    return int(torch.randint(2**62, (1,)))


def generate_groups(engine: Engine, encoder: Encoder, prompts: dict, images_per_prompt: list[int],
                    cfg: RolloutConfig, first_row: int = 0, seed: int | None = None) -> Rollout:
    """Sample `cfg.group_size` responses for each of the B prompts of a left-padded prompt batch.

    On `engine` (the policy's, owned by the recipe: its buffers and graphs serve every rollout): each
    prompt prefilled once into its G slots. The noise of a response's
    token is a function of (`seed`, default one drawn by rollout_seed(); its global row first_row +
    n; step), so N ranks sample what one process samples, whatever the split."""
    seed = rollout_seed() if seed is None else seed
    G, device = cfg.group_size, prompts["input_ids"].device
    requests = [GenRequest(p, n=G, max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                           top_k=cfg.top_k, seed=seed, first_row=first_row + b * G)
                for b, p in enumerate(prompts_of_batch(prompts, images_per_prompt))]
    banned = never_generated(encoder, engine.core)
    record = cfg.router_replay is not False  # "record" or true
    results = engine.generate(requests, stop_ids=encoder.end_ids, banned_ids=banned,
                                         image_token_id=encoder.image_token_id, pad_id=encoder.pad_id,
                                         compile=cfg.compile, record_routes=record, slots=cfg.max_slots or None)
    R = max(len(r.tokens) for r in results)
    ids_NR = torch.full((len(results), R), encoder.pad_id, dtype=torch.long)
    logp_NR = torch.zeros(len(results), R)
    mask_NR = torch.zeros(len(results), R, dtype=torch.long)
    for n, r in enumerate(results):
        ids_NR[n, :len(r.tokens)], logp_NR[n, :len(r.tokens)], mask_NR[n, :len(r.tokens)] = r.tokens, r.logprobs, 1
    finished = torch.tensor([r.stopped for r in results])
    routes = _rollout_routes(results, prompts["attention_mask"].sum(1).tolist(), prompts["input_ids"].shape[1], R, G) \
        if record else None
    return Rollout(prompts["input_ids"], prompts["attention_mask"], prompts.get("pixel_values"),
                   prompts.get("image_grid_thw"), images_per_prompt, ids_NR.to(device), mask_NR.to(device),
                   logp_NR.to(device), finished.to(device), G, banned,
                   None if routes is None else routes.to(device))


def _rollout_routes(results, prompt_lengths: list[int], P: int, R: int, G: int) -> torch.Tensor:
    """The results' routes ([L, plen + R_n - 1, k] each) in the Rollout's columns: prompt b's tokens
    end at column P (left padding), response n starts there."""
    L, _, k = results[0].routes.shape
    routes = torch.full((L, len(results), P + R, k), NO_ROUTE, dtype=results[0].routes.dtype)
    for n, r in enumerate(results):
        start = P - prompt_lengths[n // G]
        routes[:, n, start:start + r.routes.shape[1]] = r.routes
    return routes
