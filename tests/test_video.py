"""Video rows (frame lists and video files) for SFT.

Against transformers' own Qwen3-VL processor: the prompt's token ids (per temporal patch a
`<t seconds>` and its tokens), the video pixels and grid, mm_token_type_ids. Against the model's own
forward: the loss and every gradient of a batch with videos and images. Packed rows equal padded
ones with videos; the recipe trains on video rows (padded and packed) and evaluates them. Bad video
input is a DataError naming the row; generation paths that do not read videos refuse them.
"""

import copy
import functools
import io
import json
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.video_utils import VideoMetadata, load_video

from vlforge.config import DataConfig
from vlforge.data.check import check_file
from vlforge.data.dataset import load_dataset, tokenize_sample
from vlforge.data.encode import (Encoder, ImageLimits, collate, encode, encode_prompt, frames_as_images, pack,
                                 visuals_per_prompt)
from vlforge.data.inline import DataError
from vlforge.data.jsonl import parse_row, read_jsonl
from vlforge.data.video import Video, read_video_header
from vlforge.data.synth import synth_motion
from vlforge.data.video import VideoLimits, decode_file_frames, frame_timestamps, sampled_frames
from vlforge.train.losses import sft_loss_sum
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


def _row(**part):
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
    sample = parse_row(json.dumps(_row(**part)), media, "x.jsonl:1")
    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    ours = encode(encoder, sample, tokenize_sample(encoder, sample, 4096, "fail"), videos_as_images=False)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "video"},
                                             {"type": "text", "text": "What happens?"}]},
                {"role": "assistant", "content": "it moves"}]
    # The chat template wraps the video in <|vision_start|>..<|vision_end|> and the processor then writes each
    # frame with a pair of its own; transformers 5.17 kept the outer pair too (5.25 does not; the published
    # Qwen3-VL processor, and later transformers, drop it). Giving the processor the bare video token makes
    # every version write the published layout, which is what vlforge writes.
    text = processor.apply_chat_template(messages, tokenize=False).replace(
        "<|vision_start|><|video_pad|><|vision_end|>", "<|video_pad|>")
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
    """Samples with a video and an image, a video alone (a file), an image alone, and text only:
    (dataset, its items as training takes them (videos as images), the items as transformers' processor
    gives them (pixel_values_videos))."""
    _, processor = tiny
    rows = [_row(video=[f"f{i}.png" for i in range(5)], fps=3),
            {"video": "clip.mp4", "text": "What happens?", "answer": "noise"},
            {"image": str(shapes_dir / "images" / "000001.png"), "text": "Shape?", "answer": "circle"},
            {"text": "Say hi.", "answer": "hi"},
            json.loads((motion / "train.jsonl").read_text().splitlines()[0])]
    rows[-1]["video"] = [str(motion / p) for p in rows[-1]["video"]]
    path = media / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(video_min_pixels=VIDEO_LIMITS.min_pixels, video_max_pixels=VIDEO_LIMITS.max_pixels)
    data = load_dataset(str(path), processor, cfg)
    native = [encode(data.encoder, s, t, videos_as_images=False) for s, t in zip(data.samples, data.tokenized)]
    return data, [data[i] for i in range(len(data))], native


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("form", ["as images", "native"])
def test_loss_and_gradients_equal_the_models_own_forward(tiny, mixed_video, form):
    """sft_loss_sum on the batch training builds (videos as images) and on transformers' form (host
    M-RoPE with video grids), against Qwen3-VL's forward with labels on the videos, which computes
    its positions and places the video features itself."""
    model, _ = tiny
    model = copy.deepcopy(model)
    _, items, native = mixed_video
    batch = collate(items if form == "as images" else native, pad_id=0)
    assert ("pixel_values_videos" in batch) == (form == "native") and "pixel_values" in batch
    loss_sum, n = sft_loss_sum(model, batch)
    (loss_sum / n).backward()
    ours = _grads(model)
    model.zero_grad(set_to_none=True)
    reference = collate(native, pad_id=0)
    inputs = {k: reference[k] for k in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values",
                                        "image_grid_thw", "pixel_values_videos", "video_grid_thw")}
    ref = model(**inputs, labels=reference["labels"]).loss
    ref.backward()
    torch.testing.assert_close(loss_sum / n, ref, rtol=1e-5, atol=1e-6)
    assert all(ours[k].abs().sum() > 0 for k in ours if ".visual.blocks.0." in k)  # the videos reach the tower
    for k, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(ours[k], p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_a_video_changes_the_loss(tiny, mixed_video):
    """The frames matter: other pixels, another loss (so the video is not silently dropped)."""
    model, _ = tiny
    data, items, _ = mixed_video
    assert data.samples[1].videos and not data.samples[1].images
    batch = collate(items[1:2], pad_id=0)
    with torch.no_grad():
        loss, _ = sft_loss_sum(model, batch)
        batch["pixel_values"] = torch.flip(batch["pixel_values"], dims=[0])
        flipped, _ = sft_loss_sum(model, batch)
    assert not torch.allclose(loss, flipped)


@pytest.mark.parametrize("form", ["as images", "native"])
def test_packed_row_gives_the_padded_loss_and_gradients_with_videos(tiny, mixed_video, form):
    model, _ = tiny
    model = copy.deepcopy(model)
    _, items, native = mixed_video
    items = items if form == "as images" else native
    results = []
    for batch in (collate(items, pad_id=0), pack(items, pad_id=0)):
        model.zero_grad(set_to_none=True)
        loss, n = sft_loss_sum(model, batch)
        loss.backward()
        results.append((float(loss.detach()), n, _grads(model)))
    (padded, n_padded, g_padded), (packed, n_packed, g_packed) = results
    assert n_padded == n_packed
    assert packed == pytest.approx(padded, rel=1e-5)
    for k in g_padded:
        torch.testing.assert_close(g_packed[k], g_padded[k], rtol=1e-4, atol=1e-6, msg=k)


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
    with pytest.raises(DataError, match=r"d.jsonl:3: video: video .*clip.mp4 has frames of 64x48 = 3,072 pixels, over"):
        parse_row(json.dumps({**base, "video": "clip.mp4"}), media, "d.jsonl:3", max_image_pixels=3000)
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


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_frames_as_images_gives_the_models_own_logits(tiny, mixed_video, preset):
    """A prompt's videos shown as images (one per temporal patch, in token order), the form
    generate/'s engine reads: the model's own logits on the videos (bit-equal without images beside),
    dense and MoE (transformers' Qwen3-VL-MoE has its own copy of the code it relies on)."""
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    model = tiny[0] if preset == "tiny" else load_model(ModelConfig(preset=preset))[0]
    data, _, _ = mixed_video
    encoder = data.encoder
    for sample in data.samples:
        item = encode_prompt(encoder, sample)
        as_images = frames_as_images(item, encoder)
        if sample.videos:
            assert "pixel_values_videos" not in as_images and not (as_images["input_ids"] == encoder.video_token_id).any()
            assert visuals_per_prompt(as_images) == len(sample.images) + sum(
                int(t) for t in item["video_grid_thw"][:, 0])
        with torch.no_grad():
            ref = model(**{k: v[None] if k in ("input_ids", "mm_token_type_ids") else v for k, v in item.items()}).logits
            ours = model(**{k: v[None] if k in ("input_ids", "mm_token_type_ids") else v
                            for k, v in as_images.items()}).logits
        if sample.images and sample.videos:  # one tower call instead of transformers' two: GEMMs of other
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # shapes round differently (3e-7)
        else:
            assert torch.equal(ours, ref), sample.source


def test_engine_answers_video_prompts_as_transformers_generate_does(tiny, mixed_video):
    from vlforge.train.evaluate import _generate_answers_hf, generate_answers
    from vlforge.config import PrecisionConfig
    from vlforge.train.precision import PrecisionPolicy

    model, _ = tiny
    data, _, _ = mixed_video
    kwargs = dict(batch_size=3, max_new_tokens=6, policy=PrecisionPolicy(PrecisionConfig(mode="fp32"), "cpu"),
                  device=torch.device("cpu"))
    ours = generate_answers(model, data.encoder, data.samples, **kwargs)
    theirs = _generate_answers_hf(model, data.encoder, data.samples, synced=False, **kwargs)
    assert ours == theirs and any(ours)


def test_grpo_trains_on_video_prompts(motion, tmp_path, monkeypatch):
    """The rollouts see the videos (each prompt's frames, one image per temporal patch, as the
    dataset encodes them) and the logged reward is the mean of the reward function over what they
    generated (a reward that varies with the reply: len(reply) % 3)."""
    from vlforge.config import GRPOConfig, load_config
    from vlforge.recipes import grpo as recipe

    (tmp_path / "rewards.py").write_text("def varied(completion, answer, **row):\n    return float(len(completion) % 3)\n")
    cfg = load_config(GRPOConfig, None, [
        "model.preset=tiny", f"data.train={motion / 'train.jsonl'}", f"data.val={motion / 'val.jsonl'}",
        "train.device=cpu", f"train.output_dir={tmp_path / 'g'}", "precision.mode=fp32", "train.max_steps=2",
        "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "rl.mini_batch_size=4",
        "log.progress=false", "eval.max_samples=2", "data.video_min_pixels=512", "data.video_max_pixels=20480",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:varied'}}]"])
    rounds = []
    generate_groups = recipe.generate_groups

    def spy(engine, encoder, prompts, images, *args, **kwargs):  # what each rollout round was given, and made
        rollout = generate_groups(engine, encoder, prompts, images, *args, **kwargs)
        rounds.append((prompts, images, rollout, encoder))
        return rollout

    monkeypatch.setattr(recipe, "generate_groups", spy)
    out = recipe.run_grpo(cfg)
    assert out["final_step"] == 2 and out["eval"]["n"] == 2 and len(rounds) == 2
    metrics = [json.loads(line) for line in (tmp_path / "g" / "metrics.jsonl").read_text().splitlines()]
    data = load_dataset(str(motion / "train.jsonl"), rounds[0][3].processor, cfg.data)
    patches = {int(encode_prompt(data.encoder, s)["video_grid_thw"][:, 0].sum()) for s in data.samples}
    for (prompts, images, rollout, encoder), row in zip(rounds, metrics):
        # every prompt shows its video: its temporal patches as images, their tokens and pixels
        assert len(images) == 2 and set(images) <= patches and min(images) >= 2
        assert prompts["pixel_values"] is not None and len(prompts["image_grid_thw"]) == sum(images)
        per_image = (prompts["image_grid_thw"].prod(-1) // encoder.merge ** 2).split(images)
        assert (prompts["input_ids"] == encoder.image_token_id).sum(1).tolist() == [int(n.sum()) for n in per_image]
        texts = [encoder.tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
                 for ids, m in zip(rollout.response_ids, rollout.response_mask)]
        assert row["reward_mean"] == pytest.approx(sum(len(t) % 3 for t in texts) / len(texts), abs=1e-6)
        assert row["response_length_mean"] == pytest.approx(float(rollout.response_mask.sum(1).float().mean()))
    assert any(row["reward_mean"] > 0 for row in metrics)  # the replies did score


def test_vlforge_eval_answers_video_rows_as_the_trainers_eval_does(tiny, motion):
    """`vlforge eval` (the serving engine's requests, videos decoded there) == SFT's evaluation."""
    from vlforge.config import PrecisionConfig
    from vlforge.train.evaluate import generate_answers
    from vlforge.train.precision import PrecisionPolicy
    from vlforge.recipes.infer import evaluate_dataset
    from vlforge.infer.model import InferenceModel

    model, processor = tiny
    engine = InferenceModel(copy.deepcopy(model), processor, torch.device("cpu"), "tiny")  # it freezes its model
    report = evaluate_dataset(engine, motion / "val.jsonl", batch_size=3, max_new_tokens=6)
    samples = read_jsonl(motion / "val.jsonl")
    assert report["n"] == len(samples) == 4 and all(s.videos for s in samples)
    answers = generate_answers(model, engine.encoder, samples, batch_size=2, max_new_tokens=6,
                               policy=PrecisionPolicy(PrecisionConfig(mode="fp32"), "cpu"), device=torch.device("cpu"))
    assert [row["answer"] for row in report["answers"]] == answers


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



def test_infer_answers_a_video_file_from_the_command_line(media, capsys):
    from vlforge.cli import main

    assert main(["infer", "tiny", "--device", "cpu", "--video", str(media / "clip.mp4"), "--prompt", "What happens?",
                 "--max-new-tokens", "4"]) == 0
    assert main(["infer", "tiny", "--device", "cpu", "--video", str(media / "nope.mp4"), "--prompt", "?"]) == 2
    assert "nope.mp4" in capsys.readouterr().err


def test_chat_attaches_videos_and_keeps_them_in_the_history(tiny, media):
    from vlforge.recipes.infer import chat
    from vlforge.infer.model import InferenceModel

    model, processor = tiny
    engine = InferenceModel(copy.deepcopy(model), processor, torch.device("cpu"), "tiny")  # it freezes its model
    script = iter([f"/video {media / 'clip.mp4'}", "what happens?", "and then?", f"/video {media / 'nope.mp4'}",
                   "/reset", "hi", "/quit"])
    said, seen = [], []
    original = engine.generate

    def spy(requests, on_text=None):
        r = requests[0]
        seen.append((len(r.messages), len(r.videos), sum(p == {"type": "video"} for m in r.messages
                                                         for p in m["content"] if isinstance(m["content"], list))))
        return original(requests, on_text)

    engine.generate = spy
    chat(engine, read=lambda prompt: next(script), write=said.append, max_new_tokens=3)
    assert seen == [(1, 1, 1), (3, 1, 1), (1, 0, 0)]
    assert any(line.startswith(f"cannot open {media / 'nope.mp4'}") for line in said)


def test_a_judge_is_shown_the_samples_videos(motion):
    from vlforge.infer.model import InferenceModel
    from vlforge.rl.judge import ModelJudge

    samples = read_jsonl(motion / "val.jsonl")[:2]
    judge = ModelJudge.from_kwargs(load=InferenceModel.load, model="tiny", score="yes_no", max_new_tokens=3,
                                   batch_size=2, device="cpu")
    prompts = [s.prompt_messages for s in samples]
    requests = judge.requests(["left", "right"], [s.answer for s in samples], prompts)
    assert [r.videos for r in requests] == [s.videos for s in samples] and all(r.videos for r in requests)
    assert all(sum(p.get("type") == "video" for p in r.messages[0]["content"]) == 1 for r in requests)
    twice = judge.requests(["left", "right"], [samples[0].answer] * 2, [prompts[0]] * 2)  # one prompt's G responses
    assert twice[0].video_frames[0] is twice[1].video_frames[0]  # decoded once
    with_videos = judge.vlm.prompt_tokens(requests[0])
    assert len(judge(["left", "right"], [s.answer for s in samples], [{}, {}], prompts)) == 2
    blind = ModelJudge.from_kwargs(load=InferenceModel.load, model="tiny", score="yes_no", images=False,
                                   device="cpu")
    plain = blind.requests(["left"], [samples[0].answer], prompts[:1])[0]
    assert not plain.videos and blind.vlm.prompt_tokens(plain) < with_videos


def test_a_container_without_a_frame_count_counts_its_video_packets(tmp_path):
    """MKV counts no frames: the video stream's packets are counted (its duration would also count an
    audio track longer than the video, and every such file would fail mid-training)."""
    with av.open(str(tmp_path / "a.mkv"), "w", format="matroska") as container:
        video = container.add_stream("mpeg4", rate=8)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        audio = container.add_stream("mp2", rate=16000)
        for i in range(20):
            for packet in video.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), 10 * i, np.uint8),
                                                                  format="rgb24")):
                container.mux(packet)
        for packet in video.encode():
            container.mux(packet)
        for start in range(0, 56_000, 1152):  # 3.5 s of silence, longer than the 2.5 s of video
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1152), np.int16), format="s16", layout="mono")
            frame.sample_rate, frame.pts = 16000, start
            for packet in audio.encode(frame):
                container.mux(packet)
        for packet in audio.encode():
            container.mux(packet)
    with av.open(str(tmp_path / "a.mkv")) as container:
        assert container.streams.video[0].frames == 0 and container.duration / av.time_base > 3
    assert read_video_header(tmp_path / "a.mkv", "x", decode=True).frames == 20


def test_data_check_finds_a_video_file_whose_frame_size_changes(tmp_path):
    def segment(size):
        out = io.BytesIO()
        with av.open(out, "w", format="mpegts") as container:
            stream = container.add_stream("mpeg2video", rate=8)
            stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
            for _ in range(4):
                for packet in stream.encode(av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), 100, np.uint8),
                                                                       format="rgb24")):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        return out.getvalue()

    (tmp_path / "joined.ts").write_bytes(segment((64, 48)) + segment((96, 48)))
    with pytest.raises(DataError, match=r"x: video file .*joined.ts changes its frame size from 64x48 to 96x48"):
        read_video_header(tmp_path / "joined.ts", "x", decode=True)


def test_large_frames_are_reduced_as_decoded_with_the_processors_grid(tiny, tmp_path):
    """Frames far larger than the processor keeps are decoded reduced (held that way until the
    sample is encoded): the same grid and tokens as the processor gives the full-size frames."""
    _, processor = tiny
    write_mp4(tmp_path / "big.mp4", 6, 2, size=(640, 480))
    sample = parse_row(json.dumps({"video": "big.mp4", "text": "?", "answer": "a"}), tmp_path, "x:1")
    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    frames = encoder.decode_video(sample.videos[0])
    assert frames.shape[0] == 6 and frames.shape[1] < 480 / 2 and frames.shape[2] < 640 / 2
    ours = encode(encoder, sample, tokenize_sample(encoder, sample, 4096, "fail"), videos_as_images=False)
    full, metadata = load_video(str(tmp_path / "big.mp4"), backend="pyav",
                                sample_indices_fn=lambda metadata, **kw: np.array(encoder.video_frames(sample.videos[0])))
    ref = processor.video_processor(videos=[full], size={"shortest_edge": VIDEO_LIMITS.min_pixels,
                                                         "longest_edge": VIDEO_LIMITS.max_pixels},
                                    do_sample_frames=False, return_tensors="pt", cap_pixels_per_frame=False)
    assert torch.equal(ours["video_grid_thw"], ref["video_grid_thw"])
    assert (ours["pixel_values_videos"] - ref["pixel_values_videos"]).abs().mean() < 0.05  # a box filter first


def test_a_chat_template_without_video_parts_is_a_data_error_naming_the_row(tiny, media):
    _, processor = tiny
    encoder = Encoder(copy.copy(processor), IMAGE_LIMITS, VIDEO_LIMITS)
    encoder.processor.chat_template = processor.chat_template.replace(
        "{%- elif part['type'] == 'video' or 'video' in part -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}",
        "")
    assert encoder.processor.chat_template != processor.chat_template
    sample = parse_row(json.dumps({"video": "clip.mp4", "text": "?", "answer": "a"}), media, "d.jsonl:7")
    with pytest.raises(DataError, match=r"d.jsonl:7: the chat template produced 0 video placeholders for 1 videos"):
        tokenize_sample(encoder, sample, 4096, "fail")


def test_checkpoints_carry_the_runs_image_and_video_limits_to_inference(motion, tmp_path):
    """A run's data.* image and video limits are written into the processor its checkpoints save, so
    `vlforge serve/eval/infer` read its videos (and images) as it was trained on them."""
    from vlforge.infer.model import InferenceModel

    cfg = tiny_sft_config(motion, tmp_path / "run", "train.max_steps=1", "data.val=null", "data.max_pixels=65536",
                          "data.video_min_pixels=512", "data.video_max_pixels=20480", "data.video_fps=1.5",
                          "data.video_max_frames=12")
    run_sft(cfg)
    engine = InferenceModel.load(str(tmp_path / "run" / "checkpoint-1"), device="cpu")
    assert engine.encoder.limits.max_pixels == 65536
    assert engine.encoder.video_limits == VideoLimits(fps=1.5, max_frames=12, min_pixels=512, max_pixels=20480)


def _encode(path, frames: int, fps: int, codec: str, gop: int, b_frames: int, size=(32, 24), pts=None):
    """A video whose frame k shows k (its grey level and a row of noise); `pts`: each frame's
    timestamp in milliseconds (a variable rate), else the encoder's constant-rate clock."""
    rng = np.random.default_rng(1)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        stream.codec_context.gop_size, stream.codec_context.max_b_frames = gop, b_frames
        if pts is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        for k in range(frames):
            pixels = np.full((size[1], size[0], 3), (7 * k) % 256, np.uint8)
            pixels[0] = rng.integers(0, 255, (size[0], 3))
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            if pts is not None:
                frame.pts, frame.time_base = pts[k], Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


@pytest.mark.parametrize("kind", ["mp4", "mov", "mkv", "avi", "webm", "ts", "variable-rate", "dropped-frames"])
def test_sparse_frames_of_long_files_are_reached_by_seeking_and_equal_a_full_decode(kind, tmp_path, monkeypatch):
    """Frames sampled far apart are reached by seeking to the keyframe before each (B-frames
    included: a seek that lands past its frame goes back further), and are the frames a decode from
    the start counts (transformers' pyav reader's way), found by their packets' timestamps: with a
    variable frame rate too, and with frames missing from a constant-rate clock (a stalled screen
    recorder: frame 1200 is not the one at 40 s). MPEG-TS's imprecise seeks fall back to the decode
    from the start where they land wrong."""
    import vlforge.data.video as video_module

    codec = {"webm": "libvpx", "ts": "mpeg2video"}.get(kind, "mpeg4")
    path = tmp_path / f"v.{'mp4' if '-' in kind else kind}"
    pts = {"variable-rate": [int(k * 1000 / 30 + (k % 3) * 9) for k in range(1500)],
           "dropped-frames": [int(k * 1000 / 30) for k in range(1515) if not 100 <= k < 115]}.get(kind)
    try:
        _encode(path, 1500, 30, codec, gop=40, b_frames=0 if kind == "webm" else 2, pts=pts)
    except (av.FFmpegError, ValueError) as e:  # an encoder this PyAV build lacks
        pytest.skip(f"{codec}: {e}")
    video = read_video_header(path, "v")
    assert video.frames == 1500
    seeks, real = [], video_module._seeked_frames
    monkeypatch.setattr(video_module, "_seeked_frames", lambda *a: seeks.append(real(*a)) or seeks[-1])
    with av.open(str(path)) as container:
        everything = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    for indices in ([0, 500, 1000, 1499], [3, 4, 260, 261, 262, 900], [1200], list(range(0, 1500, 250))):
        got = video_module.decode_file_frames(video, indices, "v")
        assert np.array_equal(got, np.stack([everything[i] for i in indices])), (kind, indices)
    assert len(seeks) == 4  # every set has a gap of more than SEEK_GAP frames
    if kind != "ts":  # (MPEG-TS seeks by byte estimates: some sets land right, the others fall back)
        assert all(s is not None for s in seeks)


@pytest.mark.parametrize("degrees", [-90, 90, 180])
def test_a_rotated_video_file_is_shown_upright(tiny, tmp_path, degrees):
    """A file whose display matrix turns its frames (a phone's portrait video: -90, stored as landscape
    frames) is shown as a player shows it: the header's size is the shown one, each decoded frame is the
    stored one turned, and the row's grid follows the shown orientation (its tokens were planned from
    the shown size: the processor agrees)."""
    _, processor = tiny
    rng = np.random.default_rng(1)
    path = tmp_path / "phone.mp4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 96, 48, "yuv420p"
        stream.set_display_rotation(degrees)
        for _ in range(6):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (48, 96, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    video = read_video_header(path, "x.jsonl:1")
    turns = (degrees // 90) % 4
    assert video.rotation == turns and video.size == ((48, 96) if turns % 2 else (96, 48))
    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    stored = encoder.decode_video(Video(path, video.frames, video.fps, video.coded_size))  # no rotation applied
    shown = encoder.decode_video(video)
    assert np.array_equal(shown, np.stack([np.rot90(f, turns) for f in stored]))
    Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(tmp_path / "im.png")
    sample = parse_row(json.dumps(_row(video="phone.mp4")), tmp_path, "x.jsonl:1")
    ours = encode(encoder, sample, tokenize_sample(encoder, sample, 4096, "fail"), videos_as_images=False)
    _, h, w = ours["video_grid_thw"][0].tolist()
    assert (h > w) == bool(turns % 2)  # portrait when turned a quarter


def test_a_variable_rate_file_is_sampled_by_time_and_stamped_with_its_own_timestamps(tiny, tmp_path):
    """A phone or screen recording varies its frame rate: here 30 fps for its first second, then 5 fps
    for 6 s. Its frames are spread evenly over its time (by index, as the processor spreads a constant
    rate, most would fall in the first second), the prompt's `<t seconds>` are the container's own
    timestamps of the frames shown (PyAV's decoded frame.time, read here independently), and the frames
    decoded are those. A constant-rate file keeps the processor's i / fps (tested equal to it above)."""
    _, processor = tiny
    pts = [round(k * 1000 / 30) for k in range(30)] + [1000 + k * 200 for k in range(30)]
    path = _encode(tmp_path / "vfr.mp4", len(pts), 30, "mpeg4", gop=10, b_frames=2, pts=pts)
    video = read_video_header(path, "v")
    with av.open(str(path)) as container:
        decoded = [(f.time, f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    real = [t - decoded[0][0] for t, _ in decoded]
    assert video.times == pytest.approx(real, abs=1e-6) and real[-1] == pytest.approx(6.8)
    assert read_video_header(write_mp4(tmp_path / "cfr.mp4", 20, 8), "v").times is None

    encoder = Encoder(processor, IMAGE_LIMITS, VIDEO_LIMITS)
    shown = encoder.video_frames(video)
    assert len(shown) == int(60 / video.fps * 2)  # the count the average rate gives, as before
    step = real[-1] / (len(shown) - 1)
    for k, i in enumerate(shown):  # each within half the slow part's frame interval of its evenly spaced time
        assert abs(real[i] - k * step) <= 0.1 + 1e-6, (k, i, real[i])
    assert sum(real[i] < 1.0 for i in shown) <= 2  # by index: 5 of 13 in the first second

    stamps = [s.split(" seconds")[0] for s in encoder.video_text(video).split("<")[1:] if " seconds>" in s]
    patch = processor.video_processor.temporal_patch_size
    padded = shown + [shown[-1]] * (-len(shown) % patch)
    expected = [f"{(real[padded[k]] + real[padded[k + patch - 1]]) / 2:.1f}" for k in range(0, len(padded), patch)]
    assert stamps == expected
    by_index = frame_timestamps(shown, video.fps, patch)  # what the average rate alone would have stamped
    assert [f"{t:.1f}" for t in by_index] != expected
    got = decode_file_frames(video, shown, "v")
    assert np.array_equal(got, np.stack([decoded[i][1] for i in shown]))
