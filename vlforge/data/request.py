"""A chat request as a model answers it: messages, decoded images and videos, sampling settings and
limits. infer/model.InferenceModel answers them (infer, chat, eval, serve); the judge reward
(rl/judge.py) writes them."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from PIL import Image

from vlforge.data.encode import ImageLimits
from vlforge.data.video import Video

# Default answer lengths when a request does not say: a class name or a short answer fits in 16 /
# 64 tokens, and a short cap keeps a model that does not stop from running long; descriptions need more.
MAX_NEW_TOKENS = {"classify": 16, "qa": 64, "describe": 512}


@dataclass
class Request:
    messages: list[dict]  # chat messages; image (video) parts are {"type": "image"} ({"type": "video"}) placeholders
    images: list[Image.Image] = field(default_factory=list)
    videos: list[Video] = field(default_factory=list)  # in order
    # their frames the model sees (Encoder.decode_video), decoded already (the server does, so that a
    # corrupt video fails its own request); None: decoded when the request is prepared
    video_frames: list | None = None
    max_new_tokens: int = MAX_NEW_TOKENS["qa"]
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    min_new_tokens: int = 0  # suppress end-of-turn before this many tokens (benchmarks)
    seed: int | None = None  # sampling noise (generate/'s engine); None: a fresh one per request
    # this request's image resize bounds (the server's per-request min_pixels/max_pixels); None: the engine's
    image_limits: ImageLimits | None = None
    tools: list[dict] | None = None  # function schemas the chat template lists (the client's `tools`)
    # set from another thread (the server, when the client disconnects): the request's row stops at the
    # next token, the rest of its batch goes on
    cancelled: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
