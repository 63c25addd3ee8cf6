"""Turn a `Sample` into model inputs: Qwen chat template, image and video tokens, labels on assistant
tokens only.

Token ids are built the way transformers' Qwen3-VL processor builds them (render the chat template,
expand each `<|image_pad|>` to the image's token count, tokenize), which a test checks against the
processor itself. Doing it here lets us know every sequence's length from the image *headers*
before decoding any pixels, so over-long samples are handled before a run starts.

Videos are expanded as transformers' Qwen3-VL processor expands them (replace_video_token): each
temporal patch (2 frames) becomes `<t seconds><|vision_start|>` its tokens `<|vision_end|>`, t the
mean time of its frames, and their pixels come from transformers' video processor; a test checks
both against the processor. data/video.py plans the frames (a file sampled at data.video_fps) and
decodes them.

Images far larger than the processor's `max_pixels` are decoded at a reduced size (JPEG's scaled
decoding, then `Image.reduce`) chosen so that the processor's own resize still lands on the same
grid: token counts are unchanged, the processor just never sees the full-size pixels.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_smart_resize

from vlforge.config import DataConfig
from vlforge.data.inline import MAX_IMAGE_PIXELS, DataError
from vlforge.data.jsonl import Sample, load_pixels, open_image
from vlforge.data.video import Video
from vlforge.data.tokens import TEXT_MARK, mark_texts, max_chars_per_token
from vlforge.data.video import VideoLimits, decode_file_frames, frame_timestamps, sampled_frames

IGNORE_INDEX = -100
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"  # what the chat template writes for a video
_VISUAL = re.compile(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_PLACEHOLDER)})")


def _cut(piece: str, chars: int) -> str:
    """piece[:chars], or up to the image or video placeholder that the cut would split."""
    for match in _VISUAL.finditer(piece, max(0, chars - len(VIDEO_PLACEHOLDER))):
        if match.start() >= chars:
            break
        if match.end() > chars:
            return piece[:match.start()]
    return piece[:chars]


@dataclass(frozen=True)
class ImageLimits:
    min_pixels: int  # the processor resizes every image to within [min_pixels, max_pixels]
    max_pixels: int
    max_image_pixels: int = MAX_IMAGE_PIXELS  # files over this are refused before decoding


def record_limits(processor, cfg: DataConfig) -> None:
    """The run's image and video limits written into its processor (in place), so that the checkpoints
    and exports it saves are served, evaluated and chatted with (infer/model reads the processor's
    own settings) at the resolution and frame rate the model was trained at."""
    processor.image_processor.size = SizeDict(shortest_edge=cfg.min_pixels, longest_edge=cfg.max_pixels)
    video = getattr(processor, "video_processor", None)
    if video is not None:
        video.size = SizeDict(shortest_edge=cfg.video_min_pixels, longest_edge=cfg.video_max_pixels)
        video.fps, video.max_frames = cfg.video_fps, cfg.video_max_frames


class Encoder:
    """Holds the processor and the special-token ids; encodes samples and prompts."""

    def __init__(self, processor, limits: ImageLimits, video_limits: VideoLimits = VideoLimits()):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.video_processor = getattr(processor, "video_processor", None)
        self.limits = limits
        self.video_limits = video_limits
        tok = self.tokenizer
        self.image_token_id = tok.convert_tokens_to_ids(IMAGE_PAD)
        self.video_token_id = tok.convert_tokens_to_ids(VIDEO_PAD)
        self.im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
        # Generation ends at <|im_end|> (end of turn) or <|endoftext|> (the pad token), as in Qwen's
        # own generation_config; every generation path (rollouts, eval, infer, serve) uses these.
        self.end_ids = list(dict.fromkeys([self.im_end_id, self.pad_id]))
        self.assistant_header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.patch = self.image_processor.patch_size
        self.merge = self.image_processor.merge_size

    # -- text side ---------------------------------------------------------------------------

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image processor resizes a width x height image to."""
        return smart_resize(height, width, factor=self.patch * self.merge,
                            min_pixels=self.limits.min_pixels, max_pixels=self.limits.max_pixels)

    def fit_within(self, image: Image.Image, max_pixels: int) -> Image.Image:
        """`image` at the size an encoder whose limits are capped at `max_pixels` resizes it to (GRPO's
        tool images: rollout/multiturn.tool_image_encoder), so that this encoder's own resize, for any
        limits from that size's area up, then keeps it (its sides are multiples of the patch grid)."""
        height, width = smart_resize(image.height, image.width, factor=self.patch * self.merge,
                                     min_pixels=min(self.limits.min_pixels, max_pixels), max_pixels=max_pixels)
        return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.BICUBIC)

    def image_tokens(self, width: int, height: int) -> int:
        h, w = self.resized(width, height)
        return (h // self.patch) * (w // self.patch) // (self.merge**2)

    def video_frames(self, video: Video) -> list[int]:
        """The frames of `video` the model sees (sampled_frames under this encoder's VideoLimits)."""
        return sampled_frames(video, self.video_limits, getattr(self.video_processor, "min_frames", 4))

    def video_grid(self, video: Video) -> tuple[int, int, int]:
        """(temporal patches, height patches, width patches) of `video`, as the video processor makes them."""
        vp = self._video_processor()
        frames = len(self.video_frames(video))
        h, w = self._video_resized(frames, *video.size)
        return -(-frames // vp.temporal_patch_size), h // vp.patch_size, w // vp.patch_size

    def _video_resized(self, frames: int, width: int, height: int) -> tuple[int, int]:
        """(height, width) the video processor resizes `frames` frames of width x height to."""
        vp = self._video_processor()
        return video_smart_resize(frames, height, width, temporal_factor=vp.temporal_patch_size,
                                  factor=vp.patch_size * vp.merge_size, min_pixels=self.video_limits.min_pixels,
                                  max_pixels=self.video_limits.max_pixels)

    def _frame_reduction(self, video: Video, frames: int) -> int:
        """`_reduction` for a video's frames: the processor resizes every frame to its target anyway,
        and a decoded video is held by its frames until its request runs."""
        resized = functools.partial(self._video_resized, frames)
        return self._reduction(video.size, resized(*video.size), resized)

    def video_text(self, video: Video) -> str:
        """What replaces a video's placeholder in the prompt: per temporal patch, its time and its tokens."""
        vp = self._video_processor()
        _, h, w = self.video_grid(video)
        tokens = h * w // vp.merge_size**2
        seconds = frame_timestamps(self.video_frames(video), video.fps, vp.temporal_patch_size, video.times)
        return "".join(f"<{t:.1f} seconds><|vision_start|>{VIDEO_PAD * tokens}<|vision_end|>" for t in seconds)

    def _video_processor(self):
        if self.video_processor is None:
            raise ValueError("this model's processor has no video processor (no video_preprocessor_config.json "
                             "beside it): it cannot read videos")
        return self.video_processor

    def token_ids(self, messages: list[dict], image_sizes: list[tuple[int, int]], add_generation_prompt=False,
                  tools: list[dict] | None = None, videos: list[Video] = ()) -> list[int]:
        """The conversation's token ids, image and video placeholders expanded (`image_sizes` and
        `videos` in the order they appear); `tools` (function schemas) are rendered by the chat
        template (Qwen's: a system block listing them).

        The messages' text is text: a special token's text inside it (an <|im_end|> or <|im_start|>
        that would end the turn and open another role, an <|image_pad|> without an image) is
        tokenized as plain characters, as OpenAI's API treats message content. Text without any is
        tokenized with the template around it, exactly as transformers' processor does; text with
        some is tokenized on its own (split_special_tokens), the template's pieces around it as usual."""
        return self.token_prefix(messages, image_sizes, None, add_generation_prompt, tools, videos)[0]

    def token_prefix(self, messages: list[dict], image_sizes: list[tuple[int, int]], max_chars: int | None,
                     add_generation_prompt=False, tools: list[dict] | None = None,
                     videos: list[Video] = ()) -> tuple[list[int], int]:
        """(token_ids of the conversation's first `max_chars` characters as the chat template renders
        it, its characters in all): a longer conversation is never tokenized whole (a 50 MB row would
        take minutes and gigabytes; data/dataset.measure). The cut moves back before an image or video
        placeholder it would split; tokens near it may differ from the whole text's (a word cut in two),
        so a caller keeps fewer tokens than the prefix has (data/dataset.CUT_MARGIN)."""
        render = lambda msgs: self.processor.apply_chat_template(  # noqa: E731
            msgs, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt)
        text = render(messages)
        escaped: list[str] = []  # the texts holding a special token's text, in marker order
        marked = [mark_texts(m, self._has_special_text, escaped) for m in messages]
        if not escaped:
            pieces = [text]
        else:
            rendered = render(marked)
            pieces = TEXT_MARK.split(rendered)  # template, index, template, index, ..., template
            if "".join(escaped[int(x)] if i % 2 else x for i, x in enumerate(pieces)) != text:
                raise ValueError("a message's text holds a special token's text "
                                 f"({next(t for t in self.special_texts if any(t in e for e in escaped))!r}), "
                                 "and this chat template changes message text as it renders it, so that text "
                                 "cannot be kept apart from the template's own tokens; remove it from the message")
        template = pieces[::2]
        for placeholder, what, given in ((IMAGE_PAD, "image", len(image_sizes)),
                                         (VIDEO_PLACEHOLDER, "video", len(videos))):
            made = sum(p.count(placeholder) for p in template)
            if made != given:
                vision = {"image": IMAGE_PAD, "video": VIDEO_PLACEHOLDER}[what]
                raise ValueError(f"the chat template produced {made} {what} placeholders for {given} {what}s: the "
                                 f"model's chat template must render each {what} part as {vision} (Qwen3-VL's does; "
                                 "a template from before video support may not)")
        sizes, video_iter, ids = iter(image_sizes), iter(videos), []
        left = max_chars if max_chars is not None and len(text) > max_chars else None  # None: the whole text
        for i, piece in enumerate(pieces):
            own = escaped[int(piece)] if i % 2 else piece  # the text's characters this piece stands for
            if left is not None:
                own, left = own[:left] if i % 2 else _cut(own, left), left - len(own)
            if i % 2:
                ids += self.tokenizer(own, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            else:  # the placeholders in order: images and videos each take the next of their own list
                expanded = "".join(IMAGE_PAD * self.image_tokens(*next(sizes)) if part == IMAGE_PAD
                                   else self.video_text(next(video_iter)) if part == VIDEO_PLACEHOLDER else part
                                   for part in _VISUAL.split(own))
                ids += self.tokenizer(expanded, add_special_tokens=False)["input_ids"]
            if left is not None and left <= 0:
                break
        return ids, len(text)

    @functools.cached_property
    def chars_per_token(self) -> int | None:
        """The most characters one token stands for (tokens.max_chars_per_token), None without a bound."""
        return max_chars_per_token(self.tokenizer)

    @functools.cached_property
    def special_texts(self) -> list[str]:
        """The text of every special token (Qwen's <|im_start|>, <|image_pad|>, ...; not <think>,
        which the tokenizer does not mark special and models write as text)."""
        return [t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special]

    def _has_special_text(self, text: str) -> bool:
        return any(t in text for t in self.special_texts)

    def tool_turn_ids(self, results: list[str], max_tokens: int = 0,
                      image_sizes: list[list[tuple[int, int]]] | None = None) -> list[int]:
        """The tokens between an assistant turn that called tools (its <|im_end|> included, as the
        rollout generated it) and the next assistant turn's content: each result as a tool message
        and the assistant header, as the chat template renders them (Qwen's: one user turn of
        <tool_response> blocks). A result is tokenized as plain text: a special token's text in it
        (an <|im_end|>, an image placeholder) stays text, never a control token. `max_tokens` > 0
        cuts each result's text to that many tokens. `image_sizes[k]`: the (width, height) of the
        images result k returned, shown before its text as image parts (their placeholders expanded
        as `token_ids` expands them; `pixels` gives their patches)."""
        image_sizes = image_sizes or [[] for _ in results]
        tok = self.tokenizer
        ids = [tok(r, add_special_tokens=False, split_special_tokens=True)["input_ids"] for r in results]
        if max_tokens > 0:
            ids = [x if len(x) <= max_tokens else
                   x[:max_tokens] + tok(" ... (cut)", add_special_tokens=False)["input_ids"] for x in ids]
        # the template renders markers in the results' places; what it writes around them is tokenized
        # as the template's text (its tags special), each result's ids go in between
        marks = [f"\x00vlforge-tool-result-{k}\x00" for k in range(len(results))]
        turn = "\x00vlforge-assistant-turn\x00"
        content = [m if not sizes else [*({"type": "image"} for _ in sizes), {"type": "text", "text": m}]
                   for m, sizes in zip(marks, image_sizes)]
        rendered = self.processor.apply_chat_template(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": turn},
             *({"role": "tool", "content": c} for c in content)], tokenize=False, add_generation_prompt=True)
        at = rendered.find(turn)
        end = rendered.find("<|im_end|>", at + len(turn)) if at >= 0 else -1
        if end < 0 or any(m not in rendered[end:] for m in marks):
            raise ValueError("the chat template does not render tool messages after an assistant turn ending in "
                             "<|im_end|>; multi-turn tool rollouts need one that does (Qwen3-VL's)")
        text, out = rendered[end + len("<|im_end|>"):], []  # from the assistant's <|im_end|> (generated) on
        sizes = iter([size for result_sizes in image_sizes for size in result_sizes])
        made = text.count(IMAGE_PAD)
        if made != sum(map(len, image_sizes)):
            raise ValueError(f"the chat template produced {made} image placeholders for the "
                             f"{sum(map(len, image_sizes))} images of the tool results: it must render a tool "
                             f"message's image parts as {IMAGE_PAD} (Qwen3-VL's does)")
        template_ids = lambda piece: tok(  # noqa: E731  (the template's text, each image's placeholder expanded)
            "".join(IMAGE_PAD * self.image_tokens(*next(sizes)) if part == IMAGE_PAD else part
                    for part in _VISUAL.split(piece)), add_special_tokens=False)["input_ids"]
        for mark, result_ids in zip(marks, ids):
            before, text = text.split(mark, 1)
            out += template_ids(before) + result_ids
        return out + template_ids(text)

    def assistant_labels(self, ids: list[int]) -> list[int]:
        """Copy of `ids` with IGNORE_INDEX everywhere but assistant content and its <|im_end|>."""
        labels = [IGNORE_INDEX] * len(ids)
        header, n = self.assistant_header, len(self.assistant_header)
        i = 0
        while i < len(ids):
            if ids[i:i + n] == header:
                j = i + n
                while j < len(ids) and ids[j] != self.im_end_id:
                    labels[j] = ids[j]
                    j += 1
                if j < len(ids):
                    labels[j] = ids[j]  # learn to stop
                i = j
            i += 1
        return labels

    # -- image side --------------------------------------------------------------------------

    def decode_image(self, path, where: str | None = None) -> Image.Image:
        """An image file as RGB for `pixels`: refused over limits.max_image_pixels (from its header),
        and decoded at a reduced size where the processor would shrink it anyway.

        The reduced image keeps at least twice the processor's target size on each side (its resize
        stays the one that matters), so only images at least 4x the target per side are reduced:
        others reach the processor exactly as transformers would get them. The reduced size must
        resize to the same grid as the original (checked), so token counts and `image_grid_thw` are
        those of the full-size image; pixel values differ slightly (a box filter before the resize).
        """
        im = open_image(path, where, self.limits.max_image_pixels)
        target_h, target_w = target = self.resized(*im.size)
        # JPEG can decode at 1/2, 1/4 or 1/8 scale (draft); other formats ignore the request
        if im.draft(None, (2 * target_w, 2 * target_h)) is not None and self.resized(*im.size) != target:
            im.close()  # rounding would change the grid: decode at full size instead
            im = open_image(path, where, self.limits.max_image_pixels)
        with im:
            load_pixels(im, path, where)
            k = self._reduction(im.size, target)
            if k >= 2 and im.mode in ("RGB", "L"):  # reduce first: no full-size RGB copy next to the decoded image
                return im.reduce(k).convert("RGB")
            rgb = im.convert("RGB")  # a copy: `im` is unusable once closed
        return rgb.reduce(k) if k >= 2 else rgb

    def _reduction(self, size: tuple[int, int], target: tuple[int, int], resized=None) -> int:
        """The largest k for Image.reduce(k) that keeps twice the target size and the target grid
        (`resized`: (width, height) -> the processor's (height, width); default the image processor's)."""
        resized = resized or self.resized
        (w, h), (target_h, target_w) = size, target
        k = min(w // (2 * target_w), h // (2 * target_h))
        while k >= 2 and resized(-(-w // k), -(-h // k)) != target:  # reduce() rounds sizes up
            k -= 1
        return k

    def decode_images(self, sample: Sample) -> list[Image.Image]:
        return [self.decode_image(p, sample.source) for p in sample.images]

    def pixels(self, images: list[Image.Image]) -> dict:
        size = {"shortest_edge": self.limits.min_pixels, "longest_edge": self.limits.max_pixels}
        out = self.image_processor(images=images, size=size, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    # -- video side --------------------------------------------------------------------------

    def decode_video(self, video: Video, where: str | None = None) -> np.ndarray:
        """The frames of `video` the model sees (video_frames), decoded: uint8 [frames, H, W, 3]. Frames
        far larger than the processor keeps are reduced as they are decoded (`_frame_reduction`: the
        same grid and token count; pixel values differ slightly, a box filter before the resize)."""
        indices = self.video_frames(video)
        k = self._frame_reduction(video, len(indices))
        reduced = (lambda im: im.reduce(k)) if k >= 2 else (lambda im: im)
        if not video.is_file:
            frames = []
            for i in indices:
                path = video.source[i]
                with open_image(path, where, self.limits.max_image_pixels) as im:
                    load_pixels(im, path, where)
                    if im.size != video.size:
                        raise DataError(f"{where}: the frames of {video} changed size since the row was read")
                    frames.append(np.asarray(reduced(im.convert("RGB"))))
            return np.stack(frames)
        return decode_file_frames(video, indices, where, reduced)

    def video_pixels(self, videos: list[np.ndarray]) -> dict:
        """transformers' video processor on decoded videos (their frames as sampled already)."""
        vp = self._video_processor()
        size = {"shortest_edge": self.video_limits.min_pixels, "longest_edge": self.video_limits.max_pixels}
        # the video processor's resize with the budget over all of a video's frames, as `video_grid`
        # computes it (transformers 5.2x asks to choose; its per-frame cap counts the budget per frame)
        cap = {"cap_pixels_per_frame": False} if "cap_pixels_per_frame" in vp.valid_kwargs.__annotations__ else {}
        out = vp(videos=list(videos), size=size, do_sample_frames=False, return_tensors="pt", **cap)
        return {"pixel_values_videos": out["pixel_values_videos"], "video_grid_thw": out["video_grid_thw"]}


def open_images(sample: Sample, max_pixels: int = MAX_IMAGE_PIXELS) -> list[Image.Image]:
    """A sample's images at full size, as RGB (`Encoder.decode_images` is what training uses)."""
    images = []
    for path in sample.images:
        with open_image(path, sample.source, max_pixels) as im:
            load_pixels(im, path, sample.source)
            images.append(im.convert("RGB"))
    return images


@dataclass
class SampleTokens:
    """What a sample becomes: its token ids/labels, and how many tokens to keep."""

    ids: list[int]
    labels: list[int]
    keep: int  # len(ids), or less when truncated


def encode(encoder: Encoder, sample: Sample, tokens: SampleTokens, videos_as_images: bool = True) -> dict:
    """Model inputs for one sample (unbatched tensors). Its videos are shown as images, one per
    temporal patch (frames_as_images: the same loss and gradients as the model's own video inputs,
    tested), unless `videos_as_images` is false: then as transformers' processor gives them. As
    images, a batch runs the vision tower once (transformers runs it once for images and once for
    videos: under FSDP2 ranks would join its collectives a different number of times), and the
    host-side inputs (model/host_inputs) apply as to any batch of images."""
    out = {
        "input_ids": torch.tensor(tokens.ids[:tokens.keep]),
        "labels": torch.tensor(tokens.labels[:tokens.keep]),
    }
    out["mm_token_type_ids"] = mm_token_types(out["input_ids"], encoder)
    if sample.images:
        pix = encoder.pixels(encoder.decode_images(sample))
        expected = int((out["input_ids"] == encoder.image_token_id).sum())
        got = int((pix["image_grid_thw"].prod(-1) // encoder.merge**2).sum())
        if got != expected:  # keeps text and pixels provably in step
            raise DataError(f"{sample.source}: image processor gave {got} image tokens, text has {expected}")
        out.update(pix)
    if sample.videos:
        pix = encoder.video_pixels([encoder.decode_video(v, sample.source) for v in sample.videos])
        expected = int((out["input_ids"] == encoder.video_token_id).sum())
        got = int((pix["video_grid_thw"].prod(-1) // encoder.video_processor.merge_size**2).sum())
        if got != expected:
            raise DataError(f"{sample.source}: video processor gave {got} video tokens, text has {expected}")
        out.update(pix)
    return frames_as_images(out, encoder) if videos_as_images else out


def mm_token_types(input_ids: torch.Tensor, encoder: Encoder) -> torch.Tensor:
    """Qwen3-VL's mm_token_type_ids: 0 text, 1 image token, 2 video token (M-RoPE groups them by it)."""
    return (input_ids == encoder.image_token_id).long() + 2 * (input_ids == encoder.video_token_id).long()


def encode_prompt(encoder: Encoder, sample: Sample, tools: list[dict] | None = None) -> dict:
    """Inputs for generation: the conversation up to (and including) the assistant header, with
    `tools` (default: the sample's own) rendered by the chat template."""
    images = encoder.decode_images(sample)
    ids = encoder.token_ids(sample.prompt_messages, [im.size for im in images], add_generation_prompt=True,
                            tools=tools if tools is not None else sample.tools, videos=sample.videos)
    out = {"input_ids": torch.tensor(ids)}
    out["mm_token_type_ids"] = mm_token_types(out["input_ids"], encoder)
    if images:
        out.update(encoder.pixels(images))
    if sample.videos:
        out.update(encoder.video_pixels([encoder.decode_video(v, sample.source) for v in sample.videos]))
    return out


def frames_as_images(item: dict, encoder: Encoder) -> dict:
    """An encoded sample or prompt (encode, encode_prompt) whose videos are shown as images, one per
    temporal patch, with the images in the order of their tokens: the form training batches and
    generate/'s engine (it prefills images) take. The model computes exactly the same: Qwen3-VL's
    vision tower attends within each temporal patch and gives each the same position embeddings (a
    [t, h, w] video grid and t [1, h, w] image grids over the same patch rows give bit-identical
    features), its get_rope_index splits a video grid per temporal patch in the same way, and a
    placeholder token's id never reaches the model (its embedding is replaced by the features). Tested: the logits equal the model's forward
    on the videos (bit-equal; 3e-7 apart in fp32 where images are beside them: one tower call's GEMMs
    instead of two), the engine's greedy answers transformers' generate on the videos."""
    if "pixel_values_videos" not in item:
        return item
    ids = item["input_ids"]
    merge = encoder.merge
    if "pixel_values" in item and item["pixel_values"].shape[1] != item["pixel_values_videos"].shape[1]:
        raise ValueError("frames_as_images: the image and video processors make patches of different sizes")
    images = _chunks(item.get("pixel_values"), item.get("image_grid_thw"))
    frames = [(rows, torch.tensor([1, h, w])) for video_rows, (t, h, w) in
              _chunks(item["pixel_values_videos"], item["video_grid_thw"], per_frame=True) for rows in video_rows]
    # each image is one run of placeholder tokens, each temporal patch of a video one (text between)
    kinds = [int(k) for k, _ in itertools.groupby(mm_token_types(ids, encoder).tolist()) if k]
    if kinds.count(1) != len(images) or kinds.count(2) != len(frames):
        raise ValueError("frames_as_images: the placeholder runs do not match the images and videos")
    image_iter, frame_iter = iter(images), iter(frames)
    taken = [next(image_iter) if kind == 1 else next(frame_iter) for kind in kinds]
    pixels = torch.cat([rows for rows, _ in taken])
    grid = torch.stack([g.reshape(3) for _, g in taken]).to(item["video_grid_thw"].dtype)
    if int((grid.prod(-1) // merge**2).sum()) != int((mm_token_types(ids, encoder) > 0).sum()):
        raise ValueError("frames_as_images: the placeholder tokens do not match the images and videos")
    as_images = torch.where(ids == encoder.video_token_id, encoder.image_token_id, ids)
    rest = {k: v for k, v in item.items() if k not in ("pixel_values_videos", "video_grid_thw")}
    return {**rest, "input_ids": as_images, "mm_token_type_ids": (as_images == encoder.image_token_id).long(),
            "pixel_values": pixels, "image_grid_thw": grid}


def _chunks(pixels: torch.Tensor | None, grid: torch.Tensor | None, per_frame: bool = False) -> list:
    """Per image (video) of `grid`: (its patch rows, its grid); `per_frame`: (its rows per temporal
    patch, its grid) (the processors lay a video's rows out temporal patch first)."""
    if pixels is None:
        return []
    out, start = [], 0
    for t, h, w in grid.tolist():
        rows = pixels[start:start + t * h * w]
        out.append((list(rows.split(h * w)), (t, h, w)) if per_frame else (rows, torch.tensor([t, h, w])))
        start += t * h * w
    return out


def encode_engine_prompt(encoder: Encoder, sample: Sample, tools: list[dict] | None = None) -> dict:
    """encode_prompt in the form generate/'s engine reads: videos shown as images (frames_as_images)."""
    return frames_as_images(encode_prompt(encoder, sample, tools), encoder)


def visuals_per_prompt(item: dict) -> int:
    """How many images an encoded prompt shows (after frames_as_images: its images and temporal patches)."""
    return int(item["image_grid_thw"].shape[0]) if item.get("image_grid_thw") is not None else 0


@dataclass
class SkippedRow:
    """Stands in for a sample whose image failed to decode at training time (data.on_error=skip)."""

    error: str


def collate(items: list, pad_id: int, left_pad: bool = False, multiple: int = 1) -> dict:
    """Pad a list of encoded samples into a batch; images are concatenated in order.

    `multiple`: round the padded length up to a multiple of this (FP8 GEMMs want token counts
    that are multiples of 16). SkippedRows are left out and counted in batch["skipped_rows"]; when
    every row was skipped the batch has zero rows (and zero supervised tokens).
    """
    skipped = sum(isinstance(x, SkippedRow) for x in items)
    items = [x for x in items if not isinstance(x, SkippedRow)]
    if not items:
        keys = ("input_ids", "attention_mask", "mm_token_type_ids", "labels")
        return {**{k: torch.zeros((0, 0), dtype=torch.long) for k in keys}, "skipped_rows": torch.tensor(skipped)}
    longest = -(-max(len(x["input_ids"]) for x in items) // multiple) * multiple
    batch = {"input_ids": [], "attention_mask": [], "mm_token_type_ids": []}
    has_labels = "labels" in items[0]
    if has_labels:
        batch["labels"] = []
    for x in items:
        n = len(x["input_ids"])
        pad = longest - n

        def padded(t, value):
            filler = torch.full((pad,), value, dtype=t.dtype)
            return torch.cat([filler, t]) if left_pad else torch.cat([t, filler])

        batch["input_ids"].append(padded(x["input_ids"], pad_id))
        batch["attention_mask"].append(padded(torch.ones(n, dtype=torch.long), 0))
        batch["mm_token_type_ids"].append(padded(x["mm_token_type_ids"], 0))
        if has_labels:
            batch["labels"].append(padded(x["labels"], IGNORE_INDEX))
    out = {k: torch.stack(v) for k, v in batch.items()}
    return _with_images(out, items, skipped)


def _with_images(out: dict, items: list, skipped: int) -> dict:
    """A batch's images and videos, each concatenated in sample order (the order of their tokens),
    and its count of skipped rows (collate and pack alike)."""
    for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
        having = [x for x in items if pixels in x]
        if having:
            out[pixels] = torch.cat([x[pixels] for x in having])
            out[grid] = torch.cat([x[grid] for x in having])
    if skipped:
        out["skipped_rows"] = torch.tensor(skipped)
    return out


def pack(items: list, pad_id: int, multiple: int = 1, pad_to: int | None = None) -> dict:
    """Concatenate encoded samples into ONE row, without padding between them (data.packing).

    The row carries `seq_lens` [n] (each sample's length, in order) instead of an attention mask;
    the model's forward turns it into per-sample position ids (train/inputs.packed_position_ids),
    from which transformers restricts attention to each sample. Each sample's first label is
    ignored, so no position is trained to predict the next sample's first token (its labels are
    never supervised anyway: every sample starts with <|im_start|>). Images are concatenated in
    sample order, the order of their tokens in the row, which is the order the model's
    masked_scatter (image features) and deepstack injection fill image positions in.

    `multiple`: the row's length rounded up to a multiple (FP8 GEMMs); `pad_to`: a fixed row
    length, also rounded up to `multiple` (flex_attention compiles per shape: one shape for every batch). The tail is one filler
    "sample" of pad tokens with positions of its own (attending only among themselves), ignored
    labels, and no count in `seq_lens`. SkippedRows are left out and counted as in `collate`.
    """
    skipped = sum(isinstance(x, SkippedRow) for x in items)
    items = [x for x in items if not isinstance(x, SkippedRow)]
    if not items:
        keys = ("input_ids", "mm_token_type_ids", "labels")
        return {**{k: torch.zeros((0, 0), dtype=torch.long) for k in keys}, "seq_lens": torch.zeros(0, dtype=torch.long),
                "skipped_rows": torch.tensor(skipped)}
    lens = [len(x["input_ids"]) for x in items]
    total = sum(lens)
    if pad_to is not None and pad_to < total:
        raise ValueError(f"pack: {total} tokens do not fit pad_to={pad_to}")
    length = -(-(total if pad_to is None else pad_to) // multiple) * multiple
    filler = length - total
    labels = []
    for x in items:
        lab = x["labels"].clone()
        lab[0] = IGNORE_INDEX
        labels.append(lab)
    out = {
        "input_ids": torch.cat([x["input_ids"] for x in items] + [torch.full((filler,), pad_id)])[None],
        "mm_token_type_ids": torch.cat([x["mm_token_type_ids"] for x in items] + [torch.zeros(filler, dtype=torch.long)])[None],
        "labels": torch.cat(labels + [torch.full((filler,), IGNORE_INDEX)])[None],
        "seq_lens": torch.tensor(lens),
    }
    return _with_images(out, items, skipped)
