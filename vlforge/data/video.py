"""Videos planned and decoded: which frames show a video (as transformers' Qwen3-VL video processor
samples them, from the headers alone), their timestamps in the prompt, and a video file's sampled
frames decoded through PyAV (seeking over long gaps). `data/encode.Encoder` turns them into tokens
and pixels.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlforge.config import DataConfig
from vlforge.data.inline import MAX_ASPECT, MAX_IMAGE_PIXELS, DataError, path_problem


@dataclass(frozen=True)
class Video:
    """A sample's video as its headers describe it: frame image files in order, or a video file."""

    source: Path | bytes | tuple[Path, ...]  # a video file (or its bytes: serve's data URLs), or the frame files
    frames: int  # how many frames the source has
    fps: float  # the source's frames per second (a frame list's: the row's "fps")
    size: tuple[int, int]  # (width, height) of every frame, as shown (after `rotation`)
    # quarter turns counterclockwise that show a file's frames upright (its display matrix: phones
    # store portrait video as landscape frames with a rotation to apply); 0 for frame lists
    rotation: int = 0
    # a file whose frame rate varies (phones, screen recorders): each frame's time in seconds from the
    # first, from its packet's timestamp; None at a constant rate, where frame i is at i / fps
    times: tuple[float, ...] | None = None

    @property
    def coded_size(self) -> tuple[int, int]:
        """(width, height) of the frames as stored (before `rotation`)."""
        return self.size[::-1] if self.rotation % 2 else self.size

    @property
    def is_file(self) -> bool:
        return not isinstance(self.source, tuple)

    def __str__(self) -> str:
        if isinstance(self.source, bytes):
            return f"an inline video of {len(self.source)} bytes"
        return str(self.source) if self.is_file else f"the frames {self.source[0]} .. {self.source[-1]}"

    def open(self, av):
        """The video file as a PyAV container (`av`: the module, require_pyav's)."""
        return av.open(io.BytesIO(self.source) if isinstance(self.source, bytes) else str(self.source))


def read_video_header(source: Path | bytes, where: str, decode: bool = False,
                      max_pixels: int = MAX_IMAGE_PIXELS) -> Video:
    """A video file's (or its bytes') frame count, rate and frame size, from its container (PyAV),
    nothing decoded (`decode`: every frame decoded too and counted against the header, for data
    check: a truncated or corrupt file fails here, not mid-run). Frames over `max_pixels` are refused,
    as images are (a guard against decompression bombs)."""
    if isinstance(source, Path) and (problem := path_problem(source)):
        raise DataError(f"{where}: video file {source} {problem}")
    av = require_pyav(where)
    video = Video(source, 0, 0.0, (0, 0))  # opened, and named in the messages, before its header is known
    try:
        with video.open(av) as container:
            if not container.streams.video:
                raise DataError(f"{where}: video file {video} has no video stream")
            stream = container.streams.video[0]
            fps = float(stream.average_rate or stream.guessed_rate or 0)
            size = (stream.codec_context.width, stream.codec_context.height)
            # some containers (MKV, WebM, MPEG-TS) count no frames: then the video stream's packets, one a
            # frame (read, not decoded; the container's duration would count a longer audio track too)
            frames = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            if decode:
                container.seek(0)
                sizes = [(f.width, f.height) for f in container.decode(video=0)]
                if any(other != size for other in sizes):
                    other = next(other for other in sizes if other != size)
                    raise DataError(f"{where}: video file {video} changes its frame size from {size[0]}x{size[1]} "
                                    f"to {other[0]}x{other[1]}; every frame of a video must have the same size: "
                                    "re-encode it at one size")
                if len(sizes) < frames:  # training takes frames by the header's count: they must decode
                    raise DataError(f"{where}: video file {video} decodes to {len(sizes)} of the {frames} frames "
                                    "its header counts (truncated or corrupt); re-encode it")
    except av.FFmpegError as e:
        raise DataError(f"{where}: video file {video} cannot be read ({e}); re-encode it (e.g. H.264 MP4) "
                        "or give the video as a list of frame images") from None
    if not fps or frames < 2 or min(size) < 1:
        raise DataError(f"{where}: video file {video} has {frames} frames at {fps:g} fps ({size[0]}x{size[1]}); "
                        "a video needs at least 2 frames, a known rate and a size: re-encode it")
    if size[0] * size[1] > max_pixels:
        raise DataError(f"{where}: video {video} has frames of {size[0]}x{size[1]} = {size[0] * size[1]:,} pixels, "
                        f"over the limit of {max_pixels:,} (a guard against decompression bombs); downscale it, "
                        "or raise data.max_image_pixels")
    if max(size) > MAX_ASPECT * min(size):
        raise DataError(f"{where}: video {video} is {size[0]}x{size[1]}: the video processor refuses aspect "
                        f"ratios over {MAX_ASPECT}; crop or pad it, or drop the row")
    turns = _quarter_turns(video, av, where)
    with video.open(av) as container:
        times = frame_times(container, frames, fps)
    return Video(source, frames, fps, size[::-1] if turns % 2 else size, turns, times)


def frame_times(container, frames: int, fps: float) -> tuple[float, ...] | None:
    """Each frame's presentation time in seconds from the first (frame i: the i-th smallest timestamp
    of the video stream's packets, as a decode counts frames), for a file whose rate varies; None at a
    constant rate (frame i at i / fps, how transformers' processor stamps every video) and where the
    packets do not give one distinct timestamp a frame. The packets are read (not decoded) only where
    the header's average rate differs from the rate its timestamps tick at (FFmpeg's r_frame_rate): a
    constant-rate file has them equal, and reading every packet of each video costs a pass over it."""
    stream = container.streams.video[0]
    if not stream.average_rate or not stream.base_rate or stream.average_rate == stream.base_rate:
        return None
    stamps = sorted(p.pts for p in container.demux(stream) if p.size and p.pts is not None)
    if len(stamps) != frames or len(set(stamps)) != len(stamps):
        return None
    times = tuple(float((p - stamps[0]) * stream.time_base) for p in stamps)
    if all(abs(t - i / fps) <= 0.5 / fps for i, t in enumerate(times)):
        return None  # within half a frame of the constant rate: stamped as the processor stamps it
    return times


def _quarter_turns(video: Video, av, where: str) -> int:
    """Quarter turns counterclockwise that show the file's frames upright: its display matrix
    (PyAV's frame.rotation, degrees counterclockwise; a phone's portrait video: -90, one turn
    clockwise). PyAV reads the matrix only with a decoded frame, so the first frame is decoded."""
    try:
        with video.open(av) as container:
            first = next(container.decode(video=0), None)
    except av.FFmpegError as e:
        raise DataError(f"{where}: video file {video} cannot be decoded ({e}); re-encode it (e.g. H.264 MP4) "
                        "or give the video as a list of frame images") from None
    degrees = (getattr(first, "rotation", 0) or 0) if first is not None else 0  # a PyAV without it: none read
    if degrees % 90:
        raise DataError(f"{where}: video file {video} is to be shown rotated by {degrees} degrees; only quarter "
                        "turns are supported: re-encode it upright")
    return round(degrees / 90) % 4


def require_pyav(where: str):
    try:
        import av
    except ImportError:
        raise DataError(f"{where}: reading a video file needs PyAV: pip install 'vlforge[video]' "
                        "(or give the video as a list of frame images)") from None
    return av


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
