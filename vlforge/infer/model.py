"""Inference: load a model directory or checkpoint (optionally quantized) and generate in batches.

    vlm = InferenceModel.load("merged/", quant=QuantConfig.from_flag("nf4"))
    [out] = vlm.generate([Request(messages=[{"role": "user", "content": [
                {"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}],
                images=[Image.open("x.png")], max_new_tokens=16)])

What it loads: an HF model directory (an `vlforge export` output, a full fine-tuning checkpoint,
or released weights), a LoRA checkpoint (`adapter_config.json`; its base model comes from the
run's `config.yaml`), or a preset name (`tiny`, random weights) for tests and demos.

Generation runs on the model's own generate/ Engine (built here with this model's settings):
every request of a `generate` call, whatever its sampling settings, shares one decode batch; each
stops at its own `max_new_tokens`, an end token or a stop string. The server drives the same engine
through the pull API: `open(slots)`, `add(request, prompt=None) -> id` (the engine's id; `prompt`:
`prepare(request)`, the ids and pixels, made ahead in the request's own thread), `step()` -> TextOutputs
(each request's new text, and its Completion once done), `cancel(id)`; a request added between
steps decodes in the next one. `generate` is a loop over them (`on_text` hears each request's new
text). Each answer's text is kept in streamer.py's BatchStreamer (incremental detokenizing, stop
strings, text released as it grows), which gives its Completion. (transformers' own `generate` on
the same requests was measured 3-10x slower under load: docs/benchmarks.md, Serving.)
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch
from transformers.image_utils import SizeDict

from vlforge.config import ConfigError, ModelConfig, QuantConfig
from vlforge.data.encode import Encoder, ImageLimits, VideoLimits, frames_as_images, mm_token_types
from vlforge.data.request import MAX_NEW_TOKENS, Request  # noqa: F401 (the model's API)
from vlforge.data.tokens import max_chars_per_token
from vlforge.generate.engine import Engine
from vlforge.generate.forward import never_generated
from vlforge.generate.requests import GenRequest, Prompt
from vlforge.model.presets import PRESETS
from vlforge.infer.shared_images import share_identical_images
from vlforge.infer.streamer import BatchStreamer, Completion, TextOutput

SYNC_EVERY = 4  # decode steps between sync points: how often text streams and finished rows leave
# prompt tokens prefilled in one step while rows decode (Engine.step_prefill_tokens): ~6 requests of a
# 448x448 image and a sentence; a 2B prefill of that many tokens is a few decode steps' time (not yet
# measured against other values)
STEP_PREFILL_TOKENS = 2048

# Quantization methods whose kernels replay from CUDA graphs with the eager steps' tokens: bitsandbytes'
# NF4 (its gemv at one row, dequantize + GEMM above: custom ops allocating through torch's caching
# allocator), verified on an H100 by tests/test_moe_quant.py's gpu probe (NF4 attention linears and
# experts through generate/'s engine). tests/test_infer_model.py's gpu probe runs nf4, int8 and fp8
# through serve (int8 and fp8 as expected failures: an XPASS says a method can join; not yet run on a GPU).
REPLAYABLE_QUANT = frozenset({"none", "nf4"})


def trained_tool_image_limit(checkpoint: Path) -> int | None:
    """tools.image_max_pixels of the GRPO run with tools `checkpoint` belongs to (its parent's
    config.yaml); None for anything else (a preset, an SFT run, a run without tools, an export: give
    --tool-image-max-pixels)."""
    from vlforge.model.export import run_config

    if not (checkpoint.parent / "config.yaml").is_file():
        return None
    try:
        tools = getattr(run_config(checkpoint), "tools", None)
    except ConfigError:
        return None
    return tools.image_max_pixels if tools is not None and tools.names else None


def unreplayable_quant(report: dict | None) -> list[str]:
    """The quantization methods of a model's quant report (model/quant.verify) that decode without
    CUDA graphs (not in REPLAYABLE_QUANT); [] for a plain model."""
    methods = {key.partition(":")[2] for key, n in (report or {}).get("linears", {}).items() if n}
    return sorted(methods - REPLAYABLE_QUANT)


@contextmanager
def _nothing():
    yield


def processor_pixel_limits(image_processor) -> tuple[int, int]:
    """(min_pixels, max_pixels) an image processor resizes images to: `size` {shortest_edge,
    longest_edge} (transformers 5; Qwen3-VL's preprocessor_config.json), else the min_pixels /
    max_pixels of older Qwen2-VL configs."""
    size = getattr(image_processor, "size", None) or {}
    lo = size.get("shortest_edge") or size.get("min_pixels") or getattr(image_processor, "min_pixels", None)
    hi = size.get("longest_edge") or size.get("max_pixels") or getattr(image_processor, "max_pixels", None)
    if not lo or not hi:
        raise ConfigError(f"the model's image processor ({type(image_processor).__name__}) names no min/max pixels "
                          f"(size={dict(size)}); pass --min-pixels and --max-pixels")
    return int(lo), int(hi)


def processor_video_limits(video_processor) -> VideoLimits:
    """How videos are sampled and sized for inference: the model's video processor's own settings
    (its `size`, `fps`, `max_frames`: video_preprocessor_config.json; a vlforge run's checkpoints carry
    the run's data.video_* settings there), VideoLimits' defaults for any it lacks."""
    default = VideoLimits()
    if video_processor is None:
        return default
    size = getattr(video_processor, "size", None) or {}
    lo, hi = size.get("shortest_edge") or default.min_pixels, size.get("longest_edge") or default.max_pixels
    return VideoLimits(fps=float(getattr(video_processor, "fps", None) or default.fps),
                       max_frames=int(getattr(video_processor, "max_frames", None) or default.max_frames),
                       min_pixels=int(min(lo, hi)), max_pixels=int(hi))


class InferenceModel:
    def __init__(self, model, processor, device: torch.device, name: str, quant_report: dict | None = None, *,
                 min_pixels: int | None = None, max_pixels: int | None = None,
                 compile: bool = False):
        self.model, self.processor, self.device, self.name = model, processor, device, name
        self.compile = compile  # generate/'s engine compiles its decode step (see warm_up)
        self.tokenizer = processor.tokenizer
        self.set_image_limits(min_pixels, max_pixels)
        self.quant_report = quant_report
        # the end-of-generation tokens every vlforge generation path stops at (data/encode.py)
        self.end_ids = self.encoder.end_ids
        self.chars_per_token = max_chars_per_token(self.tokenizer)
        self.lock = threading.RLock()  # one caller's steps at a time on the model
        self.share_images = True  # a batch's repeated images go through the vision tower once
        self.images_shared = 0  # images not encoded again because an identical one was in their batch
        self.sync_every = SYNC_EVERY
        self._gen: Engine | None = None
        self._streamer = BatchStreamer(self)  # the added requests' answers, by engine id
        self._prompt_tokens: dict[int, int] = {}  # engine id -> its prompt's tokens (added, not done)
        # an inference model: no gradients, and generate/'s engine fuses its projections (generate/fused.py)
        model.eval().requires_grad_(False)
        # the tools.image_max_pixels of the GRPO run a checkpoint comes from (load sets it): its
        # tools' images were resized to at most this, and serve resizes a tool message's images so too
        self.tool_image_max_pixels: int | None = None

    def gen_engine(self) -> Engine:
        """This model's generate/ Engine (built on first use, kept with its buffers and graphs). CUDA graphs
        stay off for quantized weights whose kernels are not verified to replay from a graph
        (unreplayable_quant): those steps run eagerly (same tokens, host-bound). join_share 0: a request
        joins as soon as a slot is free (a server's time to first token), not for a fuller prefill; a burst
        of joins is prefilled STEP_PREFILL_TOKENS at a time, a decode step of the running rows after each."""
        if self._gen is None:
            self._gen = Engine(self.model, sync_every=self.sync_every,
                               use_graphs=False if unreplayable_quant(self.quant_report) else None,
                               compile=self.compile and not self.quant_report, join_share=0.0,
                               step_prefill_tokens=STEP_PREFILL_TOKENS)
        return self._gen

    def compile_problem(self) -> str | None:
        """Why `compile` does not apply to this model's decoding (None: it does). The compiled decode step is
        replayed from CUDA graphs: without them (CPU, quantized weights) the steps stay eager."""
        if self.device.type != "cuda":
            return "the decode step is compiled only on CUDA (it is replayed from CUDA graphs)"
        if self.quant_report:
            return "the compiled decode step is verified on unquantized weights only (NF4 replays its eager steps)"
        if not self.gen_engine().graphs_on(self.device):
            return "this model decodes without CUDA graphs"
        return None

    def warm_up(self, slots: int) -> float | None:
        """With `compile`: compile the decode step and capture its CUDA graphs now, before the first
        request would wait for it (~80-95 s at 2B-8B on an H200, docs/benchmarks.md): one
        generation per sampling mode (greedy; sampled; top-p filtered: each mode is its own compiled
        sampling graph) at `slots` decode slots, the number later calls run at (serve: --max-batch;
        the compiled step's buffer slot count is static, so warming at another count would compile
        again). Later slot and length buckets reuse the compile and only capture a graph (well under a
        second each). Returns the seconds it took; None when nothing compiles (compile_problem)."""
        if not self.compile or self.compile_problem() is not None:
            return None
        start = time.perf_counter()
        steps = 2 * self.sync_every  # two sync points' worth of decode steps
        for temperature, top_p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9)):
            # min_new_tokens: the rows decode every step whatever the model would answer
            warm = [Request([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                            max_new_tokens=steps, min_new_tokens=steps, temperature=temperature, top_p=top_p,
                            seed=0) for _ in range(slots)]
            self.generate(warm)
        return time.perf_counter() - start

    def set_image_limits(self, min_pixels: int | None = None, max_pixels: int | None = None) -> None:
        """Resize bounds of images (pixels per image): the model's own (its processor's, from the
        preprocessor config) unless given; the processor is set to them too, so that its pixels and
        the engine's token counts agree."""
        image_processor = self.processor.image_processor
        own_min, own_max = processor_pixel_limits(image_processor)
        lo = own_min if min_pixels is None else min_pixels
        hi = own_max if max_pixels is None else max_pixels
        for flag, value in (("--min-pixels", min_pixels), ("--max-pixels", max_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{flag} {value!r}: must be a whole number >= 1")
        if lo > hi:
            own = "the model's own, from its preprocessor config"
            raise ConfigError(f"min pixels {lo} ({own if min_pixels is None else '--min-pixels'}) is above max pixels "
                              f"{hi} ({own if max_pixels is None else '--max-pixels'}); pass both so that min <= max")
        image_processor.size = SizeDict(shortest_edge=lo, longest_edge=hi)
        self.encoder = Encoder(self.processor, ImageLimits(min_pixels=lo, max_pixels=hi),
                               processor_video_limits(getattr(self.processor, "video_processor", None)))

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(cls, source: str, quant: QuantConfig | None = None, device: str = "auto",
             dtype: torch.dtype = torch.bfloat16, *, min_pixels: int | None = None,
             max_pixels: int | None = None, compile: bool = False) -> "InferenceModel":
        """`quant=None`: unquantized, except a LoRA checkpoint of a QLoRA run, which gets its run's quant.
        `min_pixels`/`max_pixels`: image resize bounds; None: the model's processor's own. `compile`:
        generate/'s engine compiles its decode step (call warm_up before serving)."""
        loaded = cls._load(source, quant, device, dtype)
        loaded.compile = compile
        if min_pixels is not None or max_pixels is not None:
            loaded.set_image_limits(min_pixels, max_pixels)
        loaded.tool_image_max_pixels = trained_tool_image_limit(Path(source))
        return loaded

    @classmethod
    def _load(cls, source: str, quant: QuantConfig | None, device: str, dtype: torch.dtype) -> "InferenceModel":
        from vlforge.train.hardware import quant_problem
        from vlforge.train.runtime import resolve_device
        from vlforge.model.export import is_sharded, run_config
        from vlforge.model.load import load_model
        from vlforge.model.quant import verify

        dev = resolve_device(device)
        path = Path(source)
        if is_sharded(path):
            raise ConfigError(f"{path} is a sharded (multi-process) checkpoint: consolidate it first with "
                              f"`vlforge export {path} --out DIR`, then load DIR")
        lora = (path / "adapter_config.json").is_file()
        wanted = quant if quant is not None else run_config(path).quant if lora else QuantConfig()
        if problem := quant_problem(wanted, dev):  # before any weight loads
            raise ConfigError(problem)
        if lora:
            return cls._load_lora_checkpoint(path, quant, dev, dtype)
        quant = wanted
        cfg = ModelConfig(path=str(path)) if path.exists() or source not in PRESETS else ModelConfig(preset=source)
        model, processor = load_model(cfg, dtype=dtype, device=dev, quant=quant)
        return cls(model, processor, dev, path.name if cfg.path else source,
                   verify(model, quant) if quant.enabled else None)

    @classmethod
    def _load_lora_checkpoint(cls, ckpt: Path, quant: QuantConfig | None, dev: torch.device, dtype: torch.dtype):
        """The run's base with the adapter on top; quant=None serves a QLoRA adapter on its NF4 base."""
        from vlforge.model.export import load_lora_checkpoint
        from vlforge.model.quant import verify

        model, processor, quant = load_lora_checkpoint(ckpt, dtype, dev, quant)
        return cls(model, processor, dev, ckpt.name, verify(model, quant) if quant.enabled else None)

    # ------------------------------------------------------------------ generation

    def encoder_for(self, request: Request) -> Encoder:
        """The encoder of the request's image limits (encoder_at)."""
        return self.encoder_at(request.image_limits)

    def encoder_at(self, limits: ImageLimits | None) -> Encoder:
        """The encoder of these image limits: the engine's (None: its own), or a copy at them (the
        same processor; `pixels` and `image_tokens` read `limits`, so pixels and counts agree)."""
        if limits is None or limits == self.encoder.limits:
            return self.encoder
        encoder = copy.copy(self.encoder)
        encoder.limits = limits
        return encoder

    def _item(self, r: Request) -> dict:
        """The request's prompt ids and (at its own image limits) pixels, on the CPU."""
        encoder = self.encoder_for(r)
        ids = encoder.token_ids(r.messages, [im.size for im in r.images], add_generation_prompt=True, tools=r.tools,
                                videos=r.videos)
        item = {"input_ids": torch.tensor(ids)}
        item["mm_token_type_ids"] = mm_token_types(item["input_ids"], encoder)
        if r.images:
            item.update(encoder.pixels([im.convert("RGB") for im in r.images]))
            got = int((item["image_grid_thw"].prod(-1) // encoder.merge**2).sum())
            expected = int((item["input_ids"] == encoder.image_token_id).sum())
            if got != expected:  # keeps text and pixels provably in step
                raise RuntimeError(f"the image processor gave {got} image tokens, the prompt has "
                                   f"{expected} (image limits {encoder.limits})")
        if r.videos:  # shown as images, one a temporal patch (frames_as_images): the engine prefills images
            frames = r.video_frames if r.video_frames is not None else [encoder.decode_video(v) for v in r.videos]
            item.update(encoder.video_pixels(frames))
            item = frames_as_images(item, encoder)
        return item

    def prompt_tokens(self, request: Request) -> int:
        return len(self.encoder_for(request).token_ids(request.messages, [im.size for im in request.images],
                                                       add_generation_prompt=True, tools=request.tools,
                                                       videos=request.videos))

    def min_prompt_tokens(self, messages: list[dict]) -> int:
        """A lower bound of the prompt's tokens from its length in characters, without tokenizing (0
        when the tokenizer allows no bound): rendering the chat template is string work, while the
        tokenizer needs hundreds of bytes per character of a long text."""
        if not self.chars_per_token:
            return 0
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return -(-len(text) // self.chars_per_token)

    def generate(self, requests: list[Request], on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
        """Complete every request (on_text(i, new_text) streams request i's answer): a loop over
        open/add/step, the requests decoding together (len(requests) slots)."""
        with self.lock:
            self.open(max(1, len(requests)))
            out: dict[int, Completion] = {}
            try:
                index = {self.add(r): i for i, r in enumerate(requests)}
                while len(out) < len(requests):
                    for o in self.step():
                        if o.text and on_text is not None:
                            on_text(index[o.id], o.text)
                        if o.completion is not None:
                            out[index[o.id]] = o.completion
            except BaseException:
                self._drop_all()  # nothing of a failed call stays added
                raise
            return [out[i] for i in range(len(requests))]

    # the pull API (the server's batcher): one thread calls open, add, step and cancel

    def open(self, slots: int) -> None:
        """Generation with at most `slots` requests decoding at once (serve: --max-batch); requests still
        added or running keep running."""
        self.gen_engine().open(stop_ids=self.end_ids, banned_ids=self.banned_ids(),
                               image_token_id=self.encoder.image_token_id, pad_id=self.encoder.pad_id, slots=slots)

    def prepare(self, r: Request) -> Prompt:
        """The request's prompt for `add`: its ids and pixels (the chat template, the tokenizer and the
        image processor: a few ms of CPU an image). The server calls it in a worker thread, so that the
        thread stepping the engine spends its time on the GPU's work. Raises if the prompt cannot be
        built (its images, its template)."""
        item = self._item(r)
        return Prompt(item["input_ids"], item.get("pixel_values"), item.get("image_grid_thw"))

    def add(self, r: Request, prompt: Prompt | None = None) -> int:
        """Queue a request for the next step; its id (the engine's). `prompt`: prepare(r) made already
        (else made now). Raises if its prompt cannot be prepared (its images, its template): nothing
        was added then."""
        prompt = prompt if prompt is not None else self.prepare(r)
        seed = r.seed if r.seed is not None else secrets.randbits(63)
        # the model's generation_config top_k, which transformers generate applies to sampled requests too
        top_k = getattr(getattr(self.model, "generation_config", None), "top_k", None) or 0
        id = self.gen_engine().add(GenRequest(prompt, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                                              top_p=r.top_p if r.temperature > 0 else 1.0, top_k=top_k, seed=seed,
                                              min_new_tokens=min(r.min_new_tokens, r.max_new_tokens)))
        self._streamer.add(id, r)
        self._prompt_tokens[id] = len(prompt.input_ids)
        return id

    def cancel(self, id: int) -> None:
        """End a request at the next step (its Completion says "cancelled")."""
        if id in self._prompt_tokens:
            self._streamer.requests[id].cancelled.set()
            self.gen_engine().cancel(id)

    def step(self) -> list[TextOutput]:
        """One engine step: each request's new text, and its Completion once done. A request whose
        Request.cancelled is set (its client left) or whose answer ended on the host (a stop string)
        has its rows stopped. If the step raises, every added request is dropped (the caller answers them)."""
        engine, streamer = self.gen_engine(), self._streamer
        for id in [id for id, r in streamer.requests.items() if r.cancelled.is_set() or streamer.done[id]]:
            engine.cancel(id)
        with self.lock, torch.no_grad(), \
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"), \
                share_identical_images(self.model, self._count_shared) if self.share_images else _nothing():
            try:
                outputs = engine.step()
            except BaseException:
                self._drop_all()
                raise
        return [t for o in outputs if (t := self._text_of(o)).text or t.completion is not None]

    def _drop_all(self) -> None:
        """Forget every added request (the engine's and the answers' bookkeeping)."""
        self.gen_engine().clear()
        self._streamer, self._prompt_tokens = BatchStreamer(self), {}

    def _text_of(self, o) -> TextOutput:
        streamer = self._streamer
        text = streamer.push(o.id, o.new_tokens[0])
        if not o.finished:
            return TextOutput(o.id, text)
        text += streamer.end(o.id, "cancelled" if streamer.requests[o.id].cancelled.is_set() else None)
        c = Completion(streamer.text[o.id], self._prompt_tokens.pop(o.id), streamer.count[o.id], streamer.finish[o.id])
        streamer.release(o.id)  # a server's engine runs as long as requests come: keep nothing of the done
        return TextOutput(o.id, text, c)

    def banned_ids(self) -> list[int]:
        """Never generated (generate.forward.never_generated: as in eval and rollouts)."""
        return never_generated(self.encoder, self.model)

    def _count_shared(self, n: int) -> None:
        self.images_shared += n

