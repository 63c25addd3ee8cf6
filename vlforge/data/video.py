"""Videos planned and decoded: which frames show a video (as transformers' Qwen3-VL video processor
samples them, from the headers alone), their timestamps in the prompt, and a video file's sampled
frames decoded through PyAV (seeking over long gaps). `data/encode.Encoder` turns them into tokens
and pixels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlforge.config import DataConfig
from vlforge.data.jsonl import DataError, Video, require_pyav


@dataclass(frozen=True)
class VideoLimits:
    """How videos are sampled and sized (DataConfig's video_* settings, which say more)."""

    fps: float = 2.0  # a video file is sampled at this many frames per second
    max_frames: int = 64
    min_pixels: int = 128 * 32 * 32  # all of a video's frames together, as the video processor counts
    max_pixels: int = 768 * 32 * 32

    @classmethod
    def of(cls, cfg: DataConfig) -> VideoLimits:
        return cls(cfg.video_fps, cfg.video_max_frames, cfg.video_min_pixels, cfg.video_max_pixels)


def sampled_frames(video: Video, limits: VideoLimits, min_frames: int = 4) -> list[int]:
    """The indices of the frames a video is shown by, spread evenly over it (as transformers'
    Qwen3-VL video processor samples): a file at limits.fps frames per second (at least
    `min_frames`), a frame list all its frames; either at most limits.max_frames. A file whose rate
    varies (video.times) is spread evenly over its time, not its frame count: the frames nearest
    evenly spaced times (the processor spreads them by index, which bunches them where the rate is
    high), each frame once."""
    n = video.frames
    if video.is_file:
        n = max(int(video.frames / video.fps * limits.fps), min_frames)
    n = min(n, limits.max_frames, video.frames)
    if video.times is None:
        return np.linspace(0, video.frames - 1, n).round().astype(int).tolist()
    times = np.asarray(video.times)
    wanted = np.linspace(times[0], times[-1], n)
    after = np.searchsorted(times, wanted).clip(1, len(times) - 1)
    nearest = np.where(wanted - times[after - 1] <= times[after] - wanted, after - 1, after)
    return np.unique(nearest).tolist()


def frame_timestamps(indices: list[int], fps: float, temporal_patch: int,
                     times: tuple[float, ...] | None = None) -> list[float]:
    """Seconds into the video of each temporal patch: the mean time of its first and last frame (the
    last frame repeated to fill the last patch), as Qwen3-VL's processor writes them in the prompt.
    A frame's time is i / fps, or its own timestamp where the rate varies (`times`, Video.times)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch)
    seconds = [times[i] if times is not None else i / fps for i in indices]
    return [(seconds[k] + seconds[k + temporal_patch - 1]) / 2 for k in range(0, len(seconds), temporal_patch)]


# A sampled frame this many frames past the last one decoded is reached by seeking (to the keyframe
# before it) rather than by decoding everything between: keyframes are typically 1-10 s apart, so
# seeking pays only where the samples are sparser than that (64 frames of a 10-minute video: one in
# ~280 at 30 fps; decoding a long video from its start costs seconds to minutes a sample).
SEEK_GAP = 240


def decode_file_frames(video: Video, indices: list[int], where: str | None, reduced=lambda im: im) -> np.ndarray:
    """Frames `indices` (sorted, as planned from the header when the dataset was read) of a video
    file, decoded with PyAV. Frames are counted in decode order, as transformers' load_video
    (backend="pyav") counts them; a long gap between sampled frames is crossed by seeking
    (_seeked_frames: the same frames, found by their packets' timestamps; tested on MP4, MOV, MKV,
    AVI, WebM with B-frames, variable frame rates and dropped frames); otherwise, and whenever a seek
    lands anywhere unexpected, one pass from the start keeps the wanted frames."""
    av = require_pyav(where or str(video))
    at = f"{where}: " if where else ""

    def kept(frame) -> np.ndarray:
        coded = video.coded_size
        if (frame.width, frame.height) != coded:
            raise DataError(f"{at}video file {video} changes its frame size from {coded[0]}x{coded[1]} "
                            f"to {frame.width}x{frame.height}; re-encode it at one size (`vlforge data check` "
                            "finds such files)")
        # RGB, reduced at once, turned upright (np.rot90: counterclockwise, as the display matrix counts)
        return np.rot90(np.asarray(reduced(frame.to_image())), video.rotation)

    try:
        frames = None
        if max(b - a for a, b in zip([0, *indices], indices)) > SEEK_GAP:
            with video.open(av) as container:
                frames = _seeked_frames(container, video.frames, indices, kept)
        if frames is None:
            frames, wanted = [], set(indices)
            with video.open(av) as container:
                for i, frame in enumerate(container.decode(video=0)):
                    if i in wanted:
                        frames.append(kept(frame))
                    if i >= indices[-1]:
                        break
    except av.FFmpegError as e:
        raise DataError(f"{at}video file {video} cannot be decoded ({e}); re-encode it, "
                        "or drop the row or set data.on_error=skip") from None
    if len(frames) != len(indices):
        raise DataError(f"{at}video file {video} ends after {len(frames)} of the {len(indices)} frames sampled from "
                        f"the {video.frames} its header counts (truncated or corrupt); re-encode it")
    return np.stack(frames)


def _seeked_frames(container, frames_in_header: int, indices: list[int], kept) -> list | None:
    """`kept(frame)` of frames `indices` (counted in decode order, as a pass from the start counts
    them), seeking over gaps of more than SEEK_GAP frames. Frame i is the one with the i-th smallest
    timestamp among the video stream's packets, read first without decoding (a fraction of a second
    for an hour of video): exact for any frame rate, as long as every packet decodes to one frame.
    None (the caller decodes from the start) when the packets do not number the header's frames or
    lack distinct timestamps, and whenever a decoded frame's timestamp is not the one expected. A
    packet that fails to decode (a corrupt file) shifts a pass from the start's count but not this
    one's: `vlforge data check` decodes every frame and finds such files."""
    stream = container.streams.video[0]
    stamps = sorted(packet.pts for packet in container.demux(stream) if packet.size and packet.pts is not None)
    if len(stamps) != frames_in_header or len(set(stamps)) != len(stamps):
        return None
    out, position, decoded = [], None, None
    for i in indices:
        back = 1 if position is None or i - position > SEEK_GAP else 0
        while True:
            if back:  # to the keyframe before frame i - back (back grows when a seek lands past frame i)
                container.seek(stamps[max(i - back, 0)], stream=stream, backward=True, any_frame=False)
                decoded = container.decode(stream)
            frame = next(decoded, None)
            while frame is not None and frame.pts is not None and frame.pts < stamps[i]:
                frame = next(decoded, None)
            if frame is None or frame.pts is None:
                return None
            if frame.pts > stamps[i]:  # a seek landed past the frame (decode vs display order), or it is missing
                if not back or back > 4 * SEEK_GAP:
                    return None
                back = 2 * back + 1
                continue
            position = i
            out.append(kept(frame))
            break
    return out
