"""A request's state, from its arrival to its result: what callers hand the engine (Prompt,
GenRequest), what comes back (StepOutput from Engine.step, GenResult, GenStats; Outputs keeps, by
id, what the added requests produced until a step reports it), and the per-slot
decode state on the device that a request's rows live in while they decode (SlotState: every
decode step reads and writes it in place)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [P] token ids, no padding
    pixel_values: torch.Tensor | None = None  # the patch rows of its images
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    # images after those (their placeholders after theirs): a multi-turn conversation's tool images,
    # its own where `pixel_values` is its prompt's, shared with its other samples (each tensor is
    # encoded once per engine call, however many prompts hold it)
    own_pixel_values: torch.Tensor | None = None
    own_image_grid_thw: torch.Tensor | None = None

    def pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Its (pixel tensor, grid on the host) pairs, in its images' order."""
        return [(x, g.cpu()) for x, g in ((self.pixel_values, self.image_grid_thw),
                                          (self.own_pixel_values, self.own_image_grid_thw)) if g is not None and len(g)]

    @property
    def images(self) -> int:
        return sum(len(g) for _, g in self.pieces())


def prompts_of_batch(batch: dict, images_per_prompt: list[int]) -> list[Prompt]:
    """The prompts of a left-padded collated batch (input_ids, attention_mask, pixel_values,
    image_grid_thw), padding removed, each with its own images' patch rows, on the host (the
    engine builds its prefill there: one copy of each tensor here, not host reads per prompt)."""
    batch = {k: v.cpu() for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values",
                                                           "image_grid_thw")}
    grid = batch.get("image_grid_thw")
    pixels = batch.get("pixel_values")
    bounds = [0, *torch.cumsum(grid.prod(-1), 0).tolist()] if grid is not None else [0]
    out, image = [], 0
    for b, n in enumerate(images_per_prompt):
        ids = batch["input_ids"][b][batch["attention_mask"][b].bool()]
        if n:
            out.append(Prompt(ids, pixels[bounds[image]:bounds[image + n]], grid[image:image + n]))
        else:
            out.append(Prompt(ids))
        image += n
    return out


@dataclass
class GenRequest:
    prompt: Prompt
    n: int = 1  # samples of this prompt (one prefill, n slots)
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    first_row: int = 0  # sample i draws the noise of global row first_row + i
    min_new_tokens: int = 0  # stop ids are masked out of the logits before this many tokens (as generate's)


@dataclass
class GenResult:
    request: int  # the id Engine.add returned (from Engine.generate: the request's position in its list)
    sample: int  # 0..n-1
    tokens: torch.Tensor  # [R] generated ids (the stop token included when one ended it), CPU
    logprobs: torch.Tensor  # [R] fp32 log-probs of the temperature-scaled policy, CPU
    stopped: bool  # ended at a stop id (False: max_new_tokens)
    # generate(record_routes=True), MoE: [L, P + R - 1, k] int16 top-k expert ids of each MoE layer for the
    # prompt's tokens and every generated one the model read (all but the last), CPU (generate/routes.py)
    routes: torch.Tensor | None = None


@dataclass(frozen=True)
class StepOutput:
    """What one Engine.step() says about one added request (the id Engine.add returned): the tokens each
    of its n rows generated since the last step that reported it and, once every row has finished, its
    results (a row's new tokens of every step joined are its result's tokens). A step reports a request
    only when it has new tokens or finished."""
    id: int
    new_tokens: tuple[tuple[int, ...], ...]  # [n]: each sample's ids since the last output (maybe none)
    results: tuple[GenResult, ...] = ()  # its n results in sample order once all have finished, else ()
    # ended by Engine.cancel: its results hold the tokens generated until then, stopped=False (none if it
    # never started)
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        return bool(self.results)


class Outputs:
    """Each added request's rows' results (until all have finished) and this step's news, by id."""

    def __init__(self):
        self.results: dict[int, list[GenResult | None]] = {}  # id -> its rows' results (added, not finished)
        self.new: dict[int, list[list[int]]] = {}  # this step's new tokens: id -> per sample
        self.finished: list[int] = []  # this step's

    def added(self, id: int, n: int) -> None:
        self.results[id] = [None] * n

    def streamed(self, id: int, sample: int, ids: list[int]) -> None:
        self.new.setdefault(id, [[] for _ in self.results[id]])[sample] += ids

    def answered(self, res: GenResult) -> None:
        per = self.results[res.request]
        per[res.sample] = res
        if all(r is not None for r in per):
            self.finished.append(res.request)

    def unstarted(self, id: int) -> None:
        """A request that ends before any prefill (cancelled while waiting): empty results."""
        for s in range(len(self.results[id])):
            self.answered(GenResult(id, s, torch.zeros(0, dtype=torch.long), torch.zeros(0), False))

    def take(self, cancelled: set[int]) -> list[StepOutput]:
        """This step's outputs, by id; the finished requests are forgotten."""
        out = []
        for id in sorted(set(self.new) | set(self.finished)):
            new = tuple(tuple(ids) for ids in self.new.get(id, [[] for _ in self.results[id]]))
            done = tuple(self.results.pop(id)) if id in self.finished else ()
            out.append(StepOutput(id, new, done, id in cancelled))
        self.new, self.finished = {}, []
        return out


@dataclass
class GenStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0  # CUDA-graph capture in this call (graphs are kept across calls)
    steps: int = 0  # decode steps run (graph replays or eager steps)
    row_steps: int = 0  # rows those steps computed (slot bucket x steps; finished rows in it count too)
    compactions: int = 0  # sync points that moved running rows into lower free slots (a smaller bucket)
    prefills: int = 0
    tokens: int = 0
    graphs: list = field(default_factory=list)  # keys of graphs captured in this call


def check_request(i: int, r: GenRequest) -> None:
    if r.n < 1 or r.max_new_tokens < 1 or len(r.prompt.input_ids) == 0 or r.temperature < 0:
        raise ValueError(f"request {i}: needs n >= 1, max_new_tokens >= 1, a non-empty prompt and "
                         f"temperature >= 0 (got n={r.n}, max_new_tokens={r.max_new_tokens}, "
                         f"{len(r.prompt.input_ids)} prompt tokens, temperature={r.temperature})")


MODES = ("greedy", "sample", "filter")  # each also serves the rows of the ones before it, token for token


def sampling_mode(requests: list[GenRequest], at_least: str) -> str:
    """The sampling mode the requests need (never below `at_least`: rows already running keep theirs)."""
    if any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in requests):
        need = "filter"
    elif any(r.temperature > 0 for r in requests):
        need = "sample"
    else:
        need = "greedy"
    return max(need, at_least, key=MODES.index)


class SlotState:
    """Per-slot decode state on the device: the rows of the requests decoding, one a slot (every
    step reads and writes these in place; a captured CUDA graph holds their addresses)."""

    def __init__(self, slots: int, width: int, device):
        long = dict(dtype=torch.long, device=device)
        self.tok = torch.zeros(slots, **long)  # the last sampled token: the next step's input
        self.pos = torch.zeros(slots, **long)  # its M-RoPE position (text positions after the prompt)
        self.length = torch.zeros(slots, **long)  # KV entries filled = where the input token is written
        self.count = torch.zeros(slots, **long)  # tokens generated
        self.max_new = torch.ones(slots, **long)
        self.min_new = torch.zeros(slots, **long)
        self.key = torch.zeros(slots, **long)  # noise key
        self.top_k = torch.zeros(slots, **long)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.stopped = torch.zeros(slots, dtype=torch.bool, device=device)
        self.prompt_len = torch.zeros(slots, **long)  # GroupCache: where the row's generated tokens start
        self.out_tok = torch.zeros(slots, width, **long)  # width > max_new_tokens: finished rows write past their end
        self.out_logp = torch.zeros(slots, width, dtype=torch.float32, device=device)

    def loop_vars(self):
        return [self.tok, self.pos, self.length, self.count, self.alive, self.stopped]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots src's state into slots dst (in place: captured graphs keep reading these tensors);
        the noise key and count travel along, so a moved row samples what it would have."""
        for t in vars(self).values():
            t[dst] = t[src]
        self.alive[src] = False
