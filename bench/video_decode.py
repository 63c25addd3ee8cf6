"""How long the frames a video sample uses take to decode: seeking over the gaps between sampled
frames (vlforge's default for gaps over data/video.SEEK_GAP frames) vs one pass from the start
(what transformers' pyav reader does), same process, same file, alternating.

    python bench/video_decode.py                        # synthetic MPEG-4 files, 1 and 10 minutes
    python bench/video_decode.py --file my.mp4 --frames 64

The synthetic files are MPEG-4 Part 2 (PyAV's bundled encoder) at 640x360, 30 fps, a keyframe every
250 frames (x264's default) and 2 B-frames. `--frames` frames are sampled evenly, as a long video's
`data.video_max_frames` cap samples them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vlforge.data.video as video_frames  # noqa: E402
from vlforge.data.video import read_video_header  # noqa: E402


def synthetic(path: Path, seconds: int, fps: int = 30, size=(640, 360)) -> Path:
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        # no keyframes at scene changes (sc_threshold): one every 250 frames exactly
        stream = container.add_stream("mpeg4", rate=fps, options={"sc_threshold": "1000000000"})
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size, stream.codec_context.max_b_frames = 250, 2
        base = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
        for k in range(seconds * fps):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * k, axis=1), format="rgb24")  # a panning picture
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def timed(video, indices, seek_gap: int) -> tuple[float, np.ndarray]:
    video_frames.SEEK_GAP = seek_gap
    start = time.perf_counter()
    frames = video_frames.decode_file_frames(video, indices, "bench")
    return time.perf_counter() - start, frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", action="append", help="a video file (repeatable); default: synthetic 1 and 10 min")
    ap.add_argument("--frames", type=int, default=64, help="frames sampled evenly (data.video_max_frames)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    default_gap = video_frames.SEEK_GAP
    with tempfile.TemporaryDirectory() as tmp:
        files = [Path(f) for f in args.file] if args.file else [synthetic(Path(tmp) / f"{m}min.mp4", 60 * m)
                                                                for m in (1, 10)]
        for path in files:
            video = read_video_header(path, str(path))
            indices = sorted({round(k * (video.frames - 1) / (args.frames - 1)) for k in range(args.frames)})
            runs = {"seek": [], "from_start": []}
            for _ in range(args.repeats):
                t_seek, a = timed(video, indices, default_gap)
                t_full, b = timed(video, indices, 10**12)
                assert np.array_equal(a, b), "seeking gave other frames than the decode from the start"
                runs["seek"].append(t_seek)
                runs["from_start"].append(t_full)
            med = {k: statistics.median(v) for k, v in runs.items()}
            print(json.dumps({"file": path.name, "frames": video.frames, "size": video.size, "fps": video.fps,
                              "sampled": len(indices), "seek_s": round(med["seek"], 3),
                              "from_start_s": round(med["from_start"], 3),
                              "speedup": round(med["from_start"] / med["seek"], 2)}))


if __name__ == "__main__":
    main()
