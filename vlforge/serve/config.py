"""The settings of `vlforge serve`: one typed config read by the CLI (its flags and defaults come
from here), `create_app(vlm, cfg)` and the app.

    cfg = ServeConfig(allow_files="/data/images", max_batch=4)    # range-checked on construction
    app = create_app(vlm, cfg)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from vlforge.config import ConfigError

MB = 1024 * 1024
API_KEY_ENV = "VLFORGE_API_KEY"  # the API key when --api-key is not given


def _flag(default, flag: str, help: str, *, unit: int = 1, minimum: float = 1):
    """A field set by a `vlforge serve` flag; `unit`: the flag's value times `unit` is the field's."""
    return field(default=default, metadata={"flag": flag, "help": help, "unit": unit, "minimum": minimum})


def _setting(default, minimum: float):
    """A field with no flag (tests and embedding code set it)."""
    return field(default=default, metadata={"minimum": minimum})


@dataclass(frozen=True)
class ServeConfig:
    model_name: str | None = field(default=None, metadata={
        "flag": "--model-name", "help": "the model id clients send and /v1/models lists (default: the source's "
                                        "directory name, or the preset)"})
    allow_files: str | Path | None = field(default=None, metadata={
        "flag": "--allow-files", "metavar": "DIR",
        "help": "let requests name image and video files inside DIR (paths relative to DIR, absolute, or file://; symlinks "
                "resolved, nothing outside DIR); default: base64 data URLs only"})
    # repr=False: the key never shows in a log line or an error that prints the config
    api_key: str | None = field(default=None, repr=False, metadata={
        "flag": "--api-key", "metavar": "KEY",
        "help": f"require the header `Authorization: Bearer KEY` on every route but /health (401 without it); "
                f"default: the environment variable {API_KEY_ENV}, if set. A flag shows in the process list: "
                f"prefer the variable"})
    # requests decoding together. The flag's default is auto: as many as the GPU's memory after the
    # weights holds the KV cache of, each at its longest (auto_max_batch; a fixed AUTO_CPU_BATCH on a
    # CPU), settled by `vlforge serve` once the model is loaded; 8 for code that builds a ServeConfig
    max_batch: int | str = field(default=8, metadata={
        "flag": "--max-batch", "minimum": 1, "auto": True, "cli_default": "auto",
        "help": "requests generated together in one batch, or auto: sized from the KV cache the GPU can hold "
                "after the weights (at most 64; a CPU: 8)"})
    max_body_bytes: int = _flag(20 * MB, "--max-body-mb", "largest request body in MB, base64 images and videos included",
                                unit=MB)
    # A client that sends its headers and then trickles (or never sends) the body would otherwise hold
    # its connection and a task for ever. 30 s: a 20 MB body (--max-body-mb) at ~0.7 MB/s.
    body_timeout_s: float = _flag(30.0, "--body-timeout", "seconds a client has to send its whole request body "
                                                          "once its headers arrived (slower: 408)", minimum=0.1)
    # uvicorn times out idle kept-alive connections, not a client that connects and sends its request
    # line and headers slowly or never (slowloris: each holds a connection and its buffers for ever)
    header_timeout_s: float = _flag(30.0, "--header-timeout", "seconds a client has to send a request's line and "
                                                              "headers, from connecting or from its previous "
                                                              "answer (slower: 408, connection closed)", minimum=0.1)
    max_image_pixels: int = _flag(4096 * 4096, "--max-image-pixels",
                                  "largest image (width x height), checked on its header before decoding")
    max_images: int = _flag(8, "--max-images", "images per request")
    # GRPO trained its tools' images at most tools.image_max_pixels: served, a tool message's images
    # are resized so too (InferenceModel.tool_image_max_pixels: a GRPO checkpoint's own, from its run)
    tool_image_max_pixels: int | None = field(default=None, metadata={
        "flag": "--tool-image-max-pixels", "metavar": "N", "minimum": 1024,
        "help": "resize the images of tool messages to at most N pixels (default: the tools.image_max_pixels "
                "of the GRPO run a checkpoint comes from; otherwise the server's image limits, as user images)"})
    # decoding reads a video file's frames in order up to the last one sampled: the work a request can ask for
    max_video_frames: int = _flag(3600, "--max-video-frames", "frames a video file may have (its header's count; "
                                                              "30 fps x 2 minutes by default)")
    max_prompt_tokens: int = _flag(8192, "--max-prompt-tokens", "prompt tokens per request, images included")
    max_tokens: int = _flag(4096, "--max-tokens-limit", "largest max_tokens a request may ask for")
    # Shutdown (SIGTERM, Ctrl+C): how long the accepted requests may still run while new ones get 503.
    # Long enough for a --max-tokens-limit answer (4096 tokens) at ~7 tokens/s per request, a slow
    # quantized or CPU decode; an orchestrator's kill grace (Kubernetes: terminationGracePeriodSeconds,
    # 30 s by default) must be longer, or it cuts the drain short.
    drain_timeout_s: float = _flag(600.0, "--drain-timeout", "seconds a shutdown lets the accepted requests finish "
                                                             "(new ones get 503 meanwhile); the rest are then "
                                                             "cancelled", minimum=0)
    default_max_tokens: int = _setting(512, 1)  # a request's max_tokens when it does not say (capped by max_tokens)
    batch_window_s: float = _setting(0.005, 0)  # how long the batcher waits for more requests to join a batch
    max_queue: int = _setting(64, 1)  # requests waiting for a batch; more are refused with 503

    def __post_init__(self):
        for f in fields(self):
            value, minimum = getattr(self, f.name), f.metadata.get("minimum")
            if minimum is None or (value is None and f.default is None):  # an optional setting left unset
                continue
            if f.metadata.get("auto") and value == "auto":  # settled once the model is loaded
                continue
            unit, where = f.metadata.get("unit", 1), f.metadata.get("flag", f"ServeConfig.{f.name}")
            kind = int if str(f.type).startswith("int") else (int, float)  # annotations are strings (__future__)
            if isinstance(value, bool) or not isinstance(value, kind) or not value >= minimum:
                if unit != 1:  # the flag is in other units than the field: say so in the flag's
                    raise ConfigError(f"{where} {value / unit if isinstance(value, (int, float)) else value!r}: "
                                      "must be positive")
                raise ConfigError(f"{where} {value!r}: must be a number >= {minimum}")
        if self.model_name is not None and not self.model_name.strip():
            raise ConfigError("--model-name: must not be empty")
        if self.allow_files is not None and not Path(self.allow_files).is_dir():
            raise ConfigError(f"--allow-files {self.allow_files}: not a directory")
        if self.api_key is not None:
            check_api_key(self.api_key, "--api-key")

    @classmethod
    def flags(cls) -> list:
        """The fields `vlforge serve` sets from a flag (`metadata` has the flag and its help)."""
        return [f for f in fields(cls) if "flag" in f.metadata]

    @classmethod
    def from_flags(cls, values: dict, environ: dict | None = None) -> "ServeConfig":
        """From flag values keyed by field name, each in its flag's units (`--max-body-mb 1.5`);
        `environ` (the CLI passes os.environ): where the API key comes from when no flag gives it."""
        kwargs = {}
        for f in cls.flags():
            value, unit = values[f.name], f.metadata.get("unit", 1)
            if unit != 1:
                if not math.isfinite(value) or value <= 0:
                    raise ConfigError(f"{f.metadata['flag']} {value}: must be positive")
                value = int(value * unit)
            kwargs[f.name] = value
        if kwargs.get("api_key") is None and environ is not None and environ.get(API_KEY_ENV) is not None:
            kwargs["api_key"] = check_api_key(environ[API_KEY_ENV], API_KEY_ENV)
        return cls(**kwargs)


def int_or_auto(text: str) -> int | str:
    """An argparse type: `auto`, or a whole number (ServeConfig checks its range)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither auto nor a whole number") from None


# --max-batch auto: the KV cache gets this share of the GPU's free memory after the weights; the rest is
# for a prefill's activations (a --max-prompt-tokens prompt), the vision tower, the decode step's
# workspaces and the allocator's fragmentation
KV_SHARE = 0.8
# at most this many: the most rows a decode step was measured at (64, docs/benchmarks.md, Generation);
# more slots than requests arrive at once only hold memory
AUTO_MAX_BATCH = 64
AUTO_CPU_BATCH = 8  # a CPU: the old fixed default (its memory is not the limit, its compute is)


def kv_bytes_per_slot(text_config, tokens: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes of one decode slot holding `tokens` tokens: layers x 2 (keys and values) x KV
    heads x head dim x dtype bytes x tokens. Pure."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return text_config.num_hidden_layers * 2 * text_config.num_key_value_heads * head_dim * dtype_bytes * tokens


def auto_max_batch(text_config, free_bytes: float | None, cfg: "ServeConfig", dtype_bytes: int = 2) -> tuple[int, str]:
    """--max-batch auto: (slots, why). `free_bytes`: the GPU's free memory with the weights loaded
    (None: a CPU). Each slot is counted at its longest, a --max-prompt-tokens prompt and a
    --max-tokens-limit answer; KV_SHARE of the free memory is theirs; between 1 and AUTO_MAX_BATCH. Pure."""
    if free_bytes is None:
        return AUTO_CPU_BATCH, f"--max-batch auto: {AUTO_CPU_BATCH} on a CPU (its compute, not memory, is the limit)"
    tokens = cfg.max_prompt_tokens + cfg.max_tokens
    per_slot = kv_bytes_per_slot(text_config, tokens, dtype_bytes)
    fits = int(KV_SHARE * free_bytes // per_slot)
    slots = max(1, min(AUTO_MAX_BATCH, fits))
    why = (f"--max-batch auto: {slots} ({free_bytes / 1e9:.1f} GB free after the weights, {KV_SHARE:.0%} for the KV "
           f"cache, {per_slot / 1e9:.2f} GB a slot at {tokens:,} tokens (--max-prompt-tokens + --max-tokens-limit)"
           + (f"; capped at {AUTO_MAX_BATCH}" if fits > AUTO_MAX_BATCH else "")
           + ("; not even one slot fits at the longest: lower --max-prompt-tokens or --max-tokens-limit" if fits < 1
              else "") + ")")
    return slots, why


def check_api_key(key: str, where: str) -> str:
    """An API key a client can send in a header: printable ASCII, no spaces (never echoed back)."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ConfigError(f"{where}: the API key must be non-empty printable ASCII without spaces (it travels in "
                          "the Authorization header)")
    return key


__all__ = ["API_KEY_ENV", "AUTO_MAX_BATCH", "ServeConfig", "auto_max_batch", "check_api_key", "int_or_auto",
           "kv_bytes_per_slot"]
