"""Video rows (frame lists and video files) for SFT.

Against transformers' own Qwen3-VL processor: the prompt's token ids (per temporal patch a
`<t seconds>` and its tokens), the video pixels and grid, mm_token_type_ids. Against the model's own
forward: the loss and every gradient of a batch with videos and images. Packed rows equal padded
ones with videos; the recipe trains on video rows (padded and packed) and evaluates them. Bad video
input is a DataError naming the row; generation paths that do not read videos refuse them.
"""

import copy
import functools
import json
import sys
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata, load_video

from vlforge.config import DataConfig
from vlforge.data.check import check_file
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import (Encoder, ImageLimits, VideoLimits, collate, encode, frame_timestamps, pack,
                                 sampled_frames, tokenize_sample)
from vlforge.data.jsonl import DataError, Video, parse_row, read_jsonl
from vlforge.data.synth import synth_motion
from vlforge.engine.losses import sft_loss_sum
from vlforge.recipes.sft import run_sft

from helpers import tiny_sft_config

IMAGE_LIMITS = ImageLimits(32 * 32, 1024 * 1024)
VIDEO_LIMITS = VideoLimits(fps=2.0, max_frames=64, min_pixels=16 * 16 * 2, max_pixels=64 * 64 * 5)


def write_mp4(path, frames: int, fps: int, size=(64, 48), seed=0):
    """An MPEG-4 file of `frames` random frames (PyAV's bundled encoder)."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Frame PNGs (5 of 64x48, one 40x40 image) and an MP4 (20 frames at 8 fps)."""
    out = tmp_path_factory.mktemp("video")
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(out / f"f{i}.png")
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(out / "im.png")
    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(out / "small.png")
    write_mp4(out / "clip.mp4", 20, 8)
    return out


def _row(media, **part):
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": "im.png"},
                                                      {"type": "video", **part},
                                                      {"type": "text", "text": "What happens?"}]},
                         {"role": "assistant", "content": "it moves"}]}


@pytest.mark.parametrize("source", ["frames", "file"])
def test_video_tokens_pixels_and_types_equal_the_processors(tiny, media, source):
    _, processor = tiny
    if source == "frames":
        part = {"video": [f"f{i}.png" for i in range(5)], "fps": 3}
        frames = np.stack([np.asarray(Image.open(media / f"f{i}.png").convert("RGB")) for i in range(5)])
        metadata = VideoMetadata(total_num_frames=5, fps=3.0, frames_indices=list(range(5)))
    else:  # transformers decodes the file itself (PyAV), sampled by its video processor at 2 fps
        part = {"video": "clip.mp4"}
        frames, metadata = load_video(str(media / "clip.mp4"), backend="pyav",
                                      sample_indices_fn=functools.partial(processor.video_processor.sample_frames, fps=2))
    sample = parse_row(json.dumps(_row(media, **part)), media, "x.jsonl:1")
    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    ours = encode(encoder, sample, tokenize_sample(encoder, sample, 4096, "fail"))

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                             {"type": "text", "text": "What happens?"}]},
                {"role": "assistant", "content": "it moves"}]
    text = processor.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=[Image.open(media / "im.png").convert("RGB")], videos=[frames],
                    video_metadata=[metadata], do_sample_frames=False, return_tensors="pt",
                    videos_kwargs={"size": {"shortest_edge": VIDEO_LIMITS.min_pixels,
                                            "longest_edge": VIDEO_LIMITS.max_pixels}, "cap_pixels_per_frame": False},
                    images_kwargs={"size": {"shortest_edge": IMAGE_LIMITS.min_pixels,
                                            "longest_edge": IMAGE_LIMITS.max_pixels}})
    assert ours["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(ours["mm_token_type_ids"], ref["mm_token_type_ids"][0])
    assert torch.equal(ours["video_grid_thw"], ref["video_grid_thw"])
    assert torch.equal(ours["pixel_values_videos"], ref["pixel_values_videos"])
    assert torch.equal(ours["pixel_values"], ref["pixel_values"])
    assert (ours["mm_token_type_ids"] == 2).any() and (ours["mm_token_type_ids"] == 1).any()
    prompt = processor.tokenizer.decode(ours["input_ids"])
    times = [f"<{t:.1f} seconds>" for t in frame_timestamps(metadata.frames_indices, metadata.fps, 2)]
    assert len(times) == int(ours["video_grid_thw"][0, 0]) and all(t in prompt for t in times)


def test_frame_sampling_and_timestamps_follow_the_video_processor(tiny):
    _, processor = tiny
    vp = processor.video_processor
    file = Video(Path("/x.mp4"), 300, 30.0, (64, 48))
    # a 10 s file at 2 fps: 20 frames spread over it, as the processor samples
    expected = vp.sample_frames(VideoMetadata(total_num_frames=300, fps=30.0), fps=2).tolist()
    assert sampled_frames(file, VideoLimits(fps=2.0)) == expected and len(expected) == 20
    assert len(sampled_frames(file, VideoLimits(fps=2.0, max_frames=8))) == 8
    assert sampled_frames(file, VideoLimits(fps=0.01)) == [0, 100, 199, 299]  # at least 4 frames
    frames = Video(tuple(Path(f"/f{i}.png") for i in range(7)), 7, 2.0, (64, 48))
    assert sampled_frames(frames, VideoLimits()) == list(range(7))  # a frame list keeps its frames
    assert frame_timestamps([0, 1, 2], 2.0, 2) == processor._calculate_timestamps([0, 1, 2], 2.0, 2) == [0.25, 1.0]


@pytest.fixture(scope="module")
def motion(tmp_path_factory):
    out = tmp_path_factory.mktemp("motion")
    synth_motion(out, 24, seed=0, val_fraction=4 / 24, frames=4)
    return out


@pytest.fixture(scope="module")
def mixed_video(tiny, media, motion, shapes_dir):
    """Samples with a video and an image, a video alone (a file), an image alone, and text only."""
    _, processor = tiny
    rows = [_row(media, video=[f"f{i}.png" for i in range(5)], fps=3),
            {"video": "clip.mp4", "text": "What happens?", "answer": "noise"},
            {"image": str(shapes_dir / "images" / "000001.png"), "text": "Shape?", "answer": "circle"},
            {"text": "Say hi.", "answer": "hi"},
            json.loads((motion / "train.jsonl").read_text().splitlines()[0])]
    rows[-1]["video"] = [str(motion / p) for p in rows[-1]["video"]]
    path = media / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(video_min_pixels=VIDEO_LIMITS.min_pixels, video_max_pixels=VIDEO_LIMITS.max_pixels)
    data = load_dataset(str(path), processor, cfg)
    return data, [data[i] for i in range(len(data))]


def test_loss_and_gradients_equal_the_models_own_forward(tiny, mixed_video):
    """sft_loss_sum (host M-RoPE with video grids, our lm_head + loss) against Qwen3-VL's forward
    with labels, which computes its positions and places the video features itself."""
    model, _ = tiny
    model = copy.deepcopy(model)
    _, items = mixed_video
    batch = collate(items, pad_id=0)
    assert "pixel_values_videos" in batch and "pixel_values" in batch
    loss_sum, n = sft_loss_sum(model, batch)
    (loss_sum / n).backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                                    "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    ref = model(**inputs, labels=batch["labels"]).loss
    ref.backward()
    assert torch.allclose(loss_sum / n, ref, rtol=1e-5, atol=1e-6)
    visual = [k for k in ours if ".visual." in k]
    assert visual and all(ours[k].abs().sum() > 0 for k in visual if "blocks.0." in k)  # the videos reach the tower
    for k, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(ours[k], p.grad, rtol=1e-4, atol=1e-6), k


def test_a_video_changes_the_loss(tiny, mixed_video):
    """The frames matter: other pixels, another loss (so the video is not silently dropped)."""
    model, _ = tiny
    _, items = mixed_video
    batch = collate(items[:1], pad_id=0)
    with torch.no_grad():
        loss, _ = sft_loss_sum(model, batch)
        batch["pixel_values_videos"] = torch.flip(batch["pixel_values_videos"], dims=[0])
        flipped, _ = sft_loss_sum(model, batch)
    assert not torch.allclose(loss, flipped)


def test_packed_row_gives_the_padded_loss_and_gradients_with_videos(tiny, mixed_video):
    model, _ = tiny
    model = copy.deepcopy(model)
    _, items = mixed_video
    results = []
    for batch in (collate(items, pad_id=0), pack(items, pad_id=0)):
        model.zero_grad(set_to_none=True)
        loss, n = sft_loss_sum(model, batch)
        loss.backward()
        results.append((float(loss), n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    (padded, n_padded, g_padded), (packed, n_packed, g_packed) = results
    assert n_padded == n_packed
    assert packed == pytest.approx(padded, rel=1e-5)
    for k in g_padded:
        assert torch.allclose(g_packed[k], g_padded[k], rtol=1e-4, atol=1e-6), k


@pytest.mark.parametrize("packing", ["false", "true"])
def test_sft_trains_and_evaluates_on_video_rows(motion, tmp_path, packing):
    cfg = tiny_sft_config(motion, tmp_path / "run", f"data.packing={packing}", "train.max_steps=3",
                          "data.video_min_pixels=512", "data.video_max_pixels=20480")
    out = run_sft(cfg)
    assert out["final_step"] == 3
    ev = out["eval"]
    assert ev["n"] == 4 and set(ev["by_task"]) == {"motion"} and len(ev["examples"]) == 4
    assert np.isfinite(ev["loss"]) and ev["loss"] > 0


def test_truncation_never_cuts_a_video(tiny, media):
    _, processor = tiny
    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    sample = parse_row(json.dumps({"video": "clip.mp4", "text": "?", "answer": "a b c d e f g h"}), media, "x:1")
    full = tokenize_sample(encoder, sample, 10_000, "fail")
    last_video = max(i for i, t in enumerate(full.ids) if t == encoder.video_token_id)
    assert tokenize_sample(encoder, sample, last_video, "truncate").startswith("too long")
    kept = tokenize_sample(encoder, sample, len(full.ids) - 2, "truncate")
    assert kept.keep == len(full.ids) - 2
    with pytest.raises(DataError, match=r"x:1: .*video_max_pixels"):
        tokenize_sample(encoder, sample, 20, "fail")


def test_bad_video_rows_name_the_row_and_what_to_do(media, monkeypatch):
    def err(row):
        with pytest.raises(DataError) as e:
            parse_row(json.dumps(row), media, "d.jsonl:3")
        assert str(e.value).startswith("d.jsonl:3")
        return str(e.value)

    base = {"text": "?", "answer": "a"}
    assert "at least 2 frames" in err({**base, "video": ["f0.png"]})
    assert "same size" in err({**base, "video": ["f0.png", "small.png"]})
    assert "not found" in err({**base, "video": ["f0.png", "nope.png"]})
    assert "'fps' must be a positive number" in err({**base, "video": ["f0.png", "f1.png"], "fps": 0})
    assert "read from the file" in err({**base, "video": "clip.mp4", "fps": 4})
    assert "has no 'video'" in err({**base, "fps": 4})
    assert "video file" in err({**base, "video": "missing.mp4"})
    (media / "junk.mp4").write_bytes(b"not a video at all" * 50)
    assert "cannot be read" in err({**base, "video": "junk.mp4"})
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": [{"type": "video", "video": "clip.mp4"}]}]}
    assert "images or videos" in err(chat)
    monkeypatch.setitem(sys.modules, "av", None)  # PyAV not installed
    assert "pip install 'vlforge[video]'" in err({**base, "video": "clip.mp4"})


def test_a_truncated_video_file_fails_data_check_not_training(tiny, media, tmp_path):
    _, processor = tiny
    data = (media / "clip.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(data[:len(data) // 3])
    (tmp_path / "clip.mp4").write_bytes(data)
    rows = [{"video": str(tmp_path / "clip.mp4"), "text": "?", "answer": "a"},
            {"video": str(tmp_path / "cut.mp4"), "text": "?", "answer": "a"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = check_file(str(tmp_path / "d.jsonl"), processor, DataConfig())
    assert report["valid_rows"] == 1 and report["videos"] == 1 and report["video_tokens_mean"] > 0
    assert any("cut.mp4" in e for e in report["first_errors"])


def test_generation_paths_refuse_video_prompts(motion, tmp_path):
    from vlforge.config import GRPOConfig, load_config
    from vlforge.recipes.grpo import run_grpo
    from vlforge.recipes.infer import evaluate_jsonl

    cfg = load_config(GRPOConfig, None, ["model.preset=tiny", f"data.train={motion / 'train.jsonl'}",
                                         "train.device=cpu", f"train.output_dir={tmp_path / 'g'}"])
    with pytest.raises(DataError, match=r"train.jsonl:1: has a video; .*vlforge sft"):
        run_grpo(cfg)
    assert not (tmp_path / "g").exists()  # refused before the run began
    with pytest.raises(DataError, match=r"val.jsonl:1: has a video"):
        evaluate_jsonl(None, motion / "val.jsonl")


def test_fsdp2_on_several_processes_refuses_video_rows(motion, tmp_path, monkeypatch):
    from vlforge.recipes import sft

    monkeypatch.setattr(sft, "torchrun_env", lambda: (0, 2, 0))
    cfg = tiny_sft_config(motion, tmp_path / "run", "distributed.strategy=fsdp2")
    with pytest.raises(DataError, match="FSDP2 on several processes does not train on videos"):
        sft.run_sft(cfg)
    sft.refuse_sharded_video(read_report(motion), tiny_sft_config(motion, tmp_path / "r2", "distributed.strategy=ddp"))


def read_report(folder):
    from vlforge.data.jsonl import LoadReport

    report = LoadReport()
    read_jsonl(folder / "train.jsonl", report=report)
    assert report.first_video
    return report


def test_synth_motion_and_data_check_commands(tmp_path, capsys):
    from vlforge.cli import main

    assert main(["data", "synth", "motion", "--n", "6", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["data", "check", str(tmp_path / "train.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid_rows"] == 5 and report["videos"] == 5 and report["images"] == 0
    assert report["video_tokens_mean"] > 0 and report["tasks"] == {"motion": 5}
    assert main(["data", "check", str(tmp_path / "train.jsonl")]) == 0
    assert "5 videos" in capsys.readouterr().out
