"""Multi-turn tool rollouts: GRPO's G samples per prompt, each a conversation with tools.

    result = generate_with_tools(engine, encoder, prompts, images_per_prompt, cfg, tools)
    result.rollout       # a Rollout whose responses are every turn and tool result, one after another
    result.completions   # each response's last assistant turn, as text: what the rewards score
    result.transcripts   # each response as chat messages: its assistant turns and tool results

A round of turns on generate/'s engine: every sequence's turn decodes in one engine call (the first
turn shares each prompt's prefill across its G samples); the turns that end in <tool_call> blocks
(tools/calls.parse_tool_calls) have their calls run together (a thread each); each such sequence
continues with the results as a tool message and the assistant header (Encoder.tool_turn_ids, the
chat template's own rendering) in the next engine call, prefilled from its whole conversation so
far. A sequence ends at a turn without a tool call (or one ended by <|endoftext|> rather than
<|im_end|>), after `tools.turns` turns with calls, or when the next turn would not fit
`rollout.max_new_tokens` (the budget of the whole response, tool results included: the update's
sequences stay within it; checked before the calls run with empty results, and after with theirs);
only that last way counts as truncated.

The response keeps every token (response_mask: the trainer reads them all); generated_mask marks the
policy's own, the only ones with log-probs and loss. A sequence's turn t samples with the noise of
(turn seed, its global row, step): N ranks sample what one process samples, as generate_groups does.
Turns are rounds (every sequence's turn t before any turn t + 1) rather than continuations fed into
the running engine call: a round's tokens do not depend on the tools' latency (as long as no call
exceeds `tools.timeout_s`), and its tool calls overlap one another. The cost is the
re-prefill of each continuing conversation (the engine keeps no KV across calls); a prompt's images
go through the vision tower once a turn, however many of its samples continue (the engine encodes
each pixel tensor of a call once, and a prompt's continuing samples share its tensor).

A tool may return images (tools/): they go into its tool message as image parts, at most
tools.image_max_pixels each (tool_image_encoder), and the conversation's next turns see them
after the prompt's images (the engine encodes a prompt's images once a turn, and each
conversation's tool images once).
The Rollout keeps each sequence's tool images (`response_pixel_values`), which the trainer's
forwards encode once per sequence beside its prompt's (rollout/logprobs.sequence_logprobs). Tools that
take `images` get the prompt's images (`prompt_images`, per prompt).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vlforge.config import ConfigError, GRPOConfig, RolloutConfig, ToolsConfig
from vlforge.data.encode import Encoder, ImageLimits, collate, encode_engine_prompt, open_images, visuals_per_prompt
from vlforge.train.evaluate import to_device
from vlforge.generate.engine import Engine
from vlforge.generate.forward import never_generated
from vlforge.generate.requests import GenRequest, Prompt, prompts_of_batch
from vlforge.model.load import load_processor
from vlforge.tools.calls import parse_tool_calls
from vlforge.tools.registry import Tool, load_tools
from vlforge.tools.runner import ToolProcesses, run_tool_calls
from vlforge.rollout.groups import Rollout, rollout_seed

_TURN_SEED_STRIDE = 0x9E3779B97F4A7C15  # a turn's seed: far from the others' (odd, so turns never collide)


@dataclass
class _Conversation:
    """One sequence's response so far: every token, which the policy generated, its log-probs."""

    tokens: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False  # ended at a stop token (False: out of budget)
    calls: int = 0
    failed_calls: int = 0
    turns: int = 0
    unshown: bool = False  # ended because its calls' results would not fit the response's budget
    transcript: list[dict] = field(default_factory=list)  # the response as chat messages
    pixel_values: torch.Tensor | None = None  # the patch rows of the images its tools returned, in order
    image_grid_thw: torch.Tensor | None = None  # [images, 3]

    @property
    def images(self) -> int:
        return 0 if self.image_grid_thw is None else len(self.image_grid_thw)

    def add_images(self, pixels: dict) -> None:
        """The patches (Encoder.pixels) of images its tools returned, after the ones before."""
        cat = lambda old, new: new if old is None else torch.cat([old, new])  # noqa: E731
        self.pixel_values = cat(self.pixel_values, pixels["pixel_values"])
        self.image_grid_thw = cat(self.image_grid_thw, pixels["image_grid_thw"])

    def add_turn(self, tokens: torch.Tensor, logprobs: torch.Tensor, text: str) -> None:
        self.tokens += tokens.tolist()
        self.generated += [1] * len(tokens)
        self.logprobs += logprobs.tolist()
        self.turns += 1
        self.transcript.append({"role": "assistant", "content": text})

    def add_context(self, tokens: list[int], calls: list, results: list) -> None:
        """The tool turn the model reads next: `tokens`, the results of `calls` as the template renders them."""
        self.tokens += tokens
        self.generated += [0] * len(tokens)
        self.logprobs += [0.0] * len(tokens)
        self.transcript += [{"role": "tool", "name": call.name, "content": result.text, "ok": result.ok,
                             **({"images": list(result.images)} if result.images else {})}
                            for call, result in zip(calls, results)]


@dataclass
class ToolRollout:
    rollout: Rollout
    completions: list[str]  # [N] each response's last assistant turn (special tokens skipped)
    calls: list[int]  # [N] tool calls made
    failed_calls: list[int]  # [N] of them, the ones answered with an error (unknown tool, bad arguments, raised)
    turns: list[int]  # [N] assistant turns
    unshown: list[bool]  # [N] ended (truncated) because its calls' results would not fit rollout.max_new_tokens
    # [N] each response as chat messages: {"role": "assistant", "content": a turn's text (its
    # <tool_call> blocks included)}, and after a turn whose calls ran, {"role": "tool", "name", "content":
    # the result's text (uncut), "ok": False for an error, and "images": the PIL images it returned, if
    # any} per call; GRPO's rewards get it as `transcript`
    transcripts: list[list[dict]]

    def reward_fields(self, fields: list[dict]) -> list[dict]:
        """Each response's dataset fields with what it did with the tools, as reward functions get
        them (rl/rewards.py): `transcript`, `tool_calls`, `failed_tool_calls`."""
        return [{**f, "transcript": tr, "tool_calls": k, "failed_tool_calls": failed}
                for f, tr, k, failed in zip(fields, self.transcripts, self.calls, self.failed_calls)]


def rollout_tools(cfg: GRPOConfig) -> dict[str, Tool]:
    """tools.names loaded, and the model's chat template checked to render a tool turn: a typo in
    a tool spec or a template without tool messages fails before any model loads (run_grpo, and
    `vlforge doctor --config`); ConfigError naming the key."""
    try:
        tools = load_tools(cfg.tools.names)
    except ValueError as e:
        raise ConfigError(f"tools.names: {e}") from e
    if tools:
        processor = load_processor(cfg.model)  # a model.path problem raises its own error
        check_tool_template(Encoder(processor, ImageLimits(cfg.data.min_pixels, cfg.data.max_pixels,
                                                           cfg.data.max_image_pixels)), "tools.names",
                            showing=[t.name for t in tools.values() if t.takes_images])
    return tools


def check_tool_template(encoder: Encoder, key: str, showing: list[str] = ()) -> None:
    """ConfigError (naming `key`, the setting that asked for tools) if the model's chat template
    does not render a tool turn after an assistant turn, as multi-turn tool conversations need, or,
    for the tools named in `showing` (those that read the prompt's images, as zoom_in: such tools
    show images back), a tool result's image."""
    try:
        encoder.tool_turn_ids(["0"])
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from e
    if showing:
        try:
            encoder.tool_turn_ids(["0"], 0, [[(64, 64)]])
        except ValueError as e:
            raise ConfigError(f"{key}: {', '.join(showing)} show images, but {e}") from e


@contextmanager
def tool_runner(tools: dict[str, Tool], settings: ToolsConfig):
    """What runs a round of calls (run_tool_calls' signature): threads in this process, or with
    tools.processes worker processes (tools/runner.ToolProcesses), stopped after the block."""
    if not tools or settings.processes <= 0:
        yield functools.partial(run_tool_calls, max_chars=settings.result_chars)
        return
    with ToolProcesses(tools, settings.processes, settings.result_chars) as run:
        yield run


def answer_with_tools(model, encoder: Encoder, samples: list, cfg: RolloutConfig, tools: dict[str, Tool],
                      device, run_calls=run_tool_calls, *, settings: ToolsConfig) -> ToolRollout:
    """One response for each of `samples` (dataset rows), their prompts listing the tools, with the
    noise of seed 0 (greedy when cfg.temperature is 0): the evaluations' answers (GRPO's held-out
    prompts, `vlforge eval --tool`). The caller sets the autocast / gathering its model needs."""
    schemas = [t.schema for t in tools.values()]
    items = [encode_engine_prompt(encoder, x, tools=schemas) for x in samples]
    prompts = to_device(collate(items, encoder.pad_id, left_pad=True), device)
    return generate_with_tools(Engine(model), encoder, prompts, [visuals_per_prompt(x) for x in items], cfg, tools, seed=0,
                               samples_per_prompt=1, run_calls=run_calls,
                               prompt_images=tool_images(samples, tools, encoder), settings=settings)


def tool_images(samples: list, tools: dict[str, Tool], encoder: Encoder) -> list[list] | None:
    """Each sample's images (full size, RGB) for the tools that take them; None when none does."""
    if not any(t.takes_images for t in tools.values()):
        return None
    return [open_images(s, encoder.limits.max_image_pixels) for s in samples]


def turn_seed(seed: int, turn: int) -> int:
    return (seed + turn * _TURN_SEED_STRIDE) % 2**62


@torch.no_grad()
def generate_with_tools(engine: Engine, encoder: Encoder, prompts: dict, images_per_prompt: list[int], cfg: RolloutConfig,
                        tools: dict[str, Tool], first_row: int = 0, seed: int | None = None,
                        samples_per_prompt: int | None = None, run_calls=run_tool_calls,
                        prompt_images: list[list] | None = None, *, settings: ToolsConfig) -> ToolRollout:
    """`cfg.group_size` (or `samples_per_prompt`) multi-turn responses for each prompt of a
    left-padded prompt batch (whose prompts were encoded with the tools' schemas), the tools run
    between turns (module docstring) by `run_calls` (tool_runner's). `prompt_images[b]`: prompt b's
    images (PIL) for tools that take them (tool_images); `settings`: the tools section (turns, bounds, timeout)."""
    seed = rollout_seed() if seed is None else seed
    G, tok = samples_per_prompt or cfg.group_size, encoder.tokenizer
    base = prompts_of_batch(prompts, images_per_prompt)
    convs = [_Conversation() for _ in range(len(base) * G)]
    sample = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    generate = dict(stop_ids=encoder.end_ids, banned_ids=never_generated(encoder, engine.core),
                    image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, compile=cfg.compile,
                    slots=cfg.max_slots or None)
    empty_turn = functools.cache(lambda k: len(encoder.tool_turn_ids([""] * k)))  # k calls' context, at least
    shown = tool_image_encoder(encoder, settings)  # what the tools' images are resized with
    # turn 0: each prompt prefilled once for its G samples
    requests = [GenRequest(p, n=G, max_new_tokens=cfg.max_new_tokens, seed=seed, first_row=first_row + b * G, **sample)
                for b, p in enumerate(base)]
    running = list(range(len(convs)))  # the sequences of this turn's results, in order
    for turn in range(settings.turns + 1):
        results = engine.generate(requests, **generate)
        calling, calls = [], []
        for n, r in zip(running, results):
            conv = convs[n]
            conv.add_turn(r.tokens, r.logprobs, tok.decode(r.tokens, skip_special_tokens=True))
            conv.finished = bool(r.stopped)
            # a turn the model ended with <|im_end|> continues (one ended by <|endoftext|> is over)
            ended_turn = bool(r.stopped) and int(r.tokens[-1]) == encoder.im_end_id
            found = parse_tool_calls(tok.decode(r.tokens, skip_special_tokens=False)) if ended_turn else []
            if not found or turn == settings.turns:  # the last turn's calls (past tools.turns) are not run
                continue
            if len(conv.tokens) + empty_turn(len(found)) >= cfg.max_new_tokens:
                conv.finished, conv.unshown = False, True  # not even empty results would leave room: none run
                continue
            calling.append(n)
            calls.append(found)
        if not calling:
            break
        images = [prompt_images[n // G] for n in calling] if prompt_images is not None else None
        answers = run_calls(calls, tools, settings.timeout_s, images)
        requests, running = [], []
        for n, found, results_n in zip(calling, calls, answers):
            conv = convs[n]
            conv.calls += len(found)
            conv.failed_calls += sum(not a.ok for a in results_n)
            returned = [im for a in results_n for im in a.images]
            try:
                context = shown.tool_turn_ids([a.text for a in results_n], settings.result_tokens,
                                              [[im.size for im in a.images] for a in results_n])
            except ValueError as e:  # a template that does not show a tool's images: the run cannot go on
                showing = sorted({c.name for c, a in zip(found, results_n) if a.images})
                raise ConfigError(f"tools.names: {', '.join(showing)} returned images, but {e}") from None
            if len(conv.tokens) + len(context) >= cfg.max_new_tokens:  # no room for another turn
                conv.finished, conv.unshown = False, True
                continue
            conv.add_context(context, found, results_n)
            if returned:
                conv.add_images(shown.pixels(returned))
            requests.append(GenRequest(_next_prompt(base[n // G], conv), n=1,
                                       max_new_tokens=cfg.max_new_tokens - len(conv.tokens),
                                       seed=turn_seed(seed, turn + 1), first_row=first_row + n, **sample))
            running.append(n)
        if not requests:
            break
    return _tool_rollout(convs, prompts, images_per_prompt, G, generate["banned_ids"], encoder.pad_id)


def _tool_rollout(convs: list[_Conversation], prompts: dict, images_per_prompt: list[int], G: int,
                  banned_ids: list[int], pad_id: int) -> ToolRollout:
    """The finished conversations as a ToolRollout: their responses right-padded to the longest, on
    the prompts' device."""
    device = prompts["input_ids"].device
    R = max(len(c.tokens) for c in convs)
    ids_NR = torch.full((len(convs), R), pad_id, dtype=torch.long)
    mask_NR = torch.zeros(len(convs), R, dtype=torch.long)
    generated_NR = torch.zeros(len(convs), R, dtype=torch.long)
    logp_NR = torch.zeros(len(convs), R)
    for n, c in enumerate(convs):
        k = len(c.tokens)
        ids_NR[n, :k], mask_NR[n, :k] = torch.tensor(c.tokens), 1
        generated_NR[n, :k], logp_NR[n, :k] = torch.tensor(c.generated), torch.tensor(c.logprobs)
    rollout = Rollout(prompts["input_ids"], prompts["attention_mask"], prompts.get("pixel_values"),
                      prompts.get("image_grid_thw"), images_per_prompt, ids_NR.to(device), mask_NR.to(device),
                      logp_NR.to(device), torch.tensor([c.finished for c in convs], device=device), G,
                      banned_ids, generated_mask=generated_NR.to(device),
                      **_tool_image_fields(convs, prompts.get("pixel_values"), device))
    completions = [c.transcript[-1]["content"] for c in convs]  # the last turn (a transcript ends with one)
    return ToolRollout(rollout, completions, [c.calls for c in convs], [c.failed_calls for c in convs],
                       [c.turns for c in convs], [c.unshown for c in convs], [c.transcript for c in convs])


def tool_image_encoder(encoder: Encoder, settings: ToolsConfig) -> Encoder:
    """`encoder` with the tools' image limits: at most tools.image_max_pixels (their tokens are
    part of the response's budget), at least data.min_pixels where that is below it."""
    limits = encoder.limits
    return Encoder(encoder.processor, ImageLimits(min(limits.min_pixels, settings.image_max_pixels),
                                                  settings.image_max_pixels, limits.max_image_pixels),
                   encoder.video_limits)


def _next_prompt(prompt: Prompt, conv: _Conversation) -> Prompt:
    """What a continuing conversation prefills: its prompt, then every token so far; its prompt's
    images, then the ones its tools returned (the order of their placeholders)."""
    history = torch.cat([prompt.input_ids, torch.tensor(conv.tokens, dtype=prompt.input_ids.dtype)])
    # the prompt's own tensor, shared with its other samples (the engine encodes it once a call)
    return Prompt(history, prompt.pixel_values, prompt.image_grid_thw, conv.pixel_values, conv.image_grid_thw)


def _tool_image_fields(convs: list[_Conversation], prompt_pixels: torch.Tensor | None, device) -> dict:
    """The Rollout's fields of the sequences' tool images ({} when no tool returned one)."""
    if not any(c.images for c in convs):
        return {}
    dtype = prompt_pixels.dtype if prompt_pixels is not None else None  # as the prompts' (cat in one tower call)
    with_images = [c for c in convs if c.images]
    return {"response_pixel_values": torch.cat([c.pixel_values for c in with_images]).to(device=device, dtype=dtype),
            "response_image_grid_thw": torch.cat([c.image_grid_thw for c in with_images]).to(device),
            "images_per_response": [c.images for c in convs]}
