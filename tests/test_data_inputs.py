"""Bad data input a user can hand us: empty or non-UTF-8 JSONL, truncated images, decompression bombs,
huge images. Each is a DataError naming file:line (or a skipped, counted row), never a traceback."""

import json
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from vlforge.cli import main
from vlforge.config import ConfigError, DataConfig
from vlforge.data.check import check_file
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import Encoder, ImageLimits, SkippedRow, encode
from vlforge.data.inline import DataError
from vlforge.data.jsonl import LoadReport, read_jsonl
from vlforge.data.sources import check_readable
from vlforge.recipes.sft import micro_batches

from helpers import tiny_sft_config

ROW = {"image": "red.png", "text": "What colour?", "answer": "red"}


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    return tmp_path


def write(folder, rows, name="data.jsonl"):
    path = folder / name
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def png_header(path, width, height):
    """A PNG that claims width x height but holds no pixel data: a decompression bomb costs nothing."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
                     + chunk(b"IEND", b""))
    return path


def truncate(path, keep=60):
    path.write_bytes(path.read_bytes()[:keep])  # the header survives, the pixels do not


# ----------------------------------------------------------------------------- empty files


@pytest.mark.parametrize("content", [b"", b"\n  \n\r\n\t\n"], ids=["zero-bytes", "blank-lines"])
def test_an_empty_jsonl_is_an_error_naming_the_file(tmp_path, tiny, content, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(content)
    for on_error in ("fail", "skip"):
        with pytest.raises(DataError, match=rf"^{path}: has no rows"):
            read_jsonl(path, on_error)
        with pytest.raises(DataError, match=rf"^{path}: has no rows"):
            load_dataset(str(path), tiny[1], DataConfig(on_error=on_error))
        with pytest.raises(DataError, match=rf"^{path}: has no rows"):
            check_readable(path, on_error)
    assert main(["data", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "has no rows" in err and "Traceback" not in err


def test_check_readable_is_the_preflight_before_a_model_loads(folder):
    with pytest.raises(DataError, match="dataset file not found"):
        check_readable(folder / "nope.jsonl")
    bad = write(folder, ['{"image": "red.png"'.encode(), {"image": "gone.png", "text": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"data.jsonl:1: malformed JSON"):
        check_readable(bad)
    with pytest.raises(DataError, match=r"data.jsonl: no usable rows \(2 read"):
        check_readable(bad, on_error="skip")
    good = write(folder, [ROW, ROW, b"{"], name="good.jsonl")
    report = check_readable(good, on_error="skip")
    assert (report.rows, report.kept) == (3, 2)


# ----------------------------------------------------------------------------- encodings


def test_non_utf8_bytes_name_the_line_or_are_skipped(folder, tiny):
    latin1 = json.dumps({"image": "red.png", "text": "Qu\u00e9 color?", "answer": "rojo"}, ensure_ascii=False)
    path = write(folder, [ROW, latin1.encode("latin-1"), ROW])
    with pytest.raises(DataError, match=r"data.jsonl:2: not valid UTF-8 \(byte 0xe9 at column \d+\); re-export"):
        read_jsonl(path)
    with pytest.raises(DataError, match=r"data.jsonl:2: not valid UTF-8"):
        load_dataset(str(path), tiny[1], DataConfig())
    report = LoadReport()
    assert len(read_jsonl(path, "skip", report)) == 2 and report.rows == 3 and sum(report.skipped.values()) == 1
    data = load_dataset(str(path), tiny[1], DataConfig(on_error="skip"))
    assert len(data) == 2 and data.report.kept == 2
    checked = check_file(str(path), tiny[1], DataConfig())
    assert checked["errors"] == 1 and checked["first_errors"][0].startswith(f"{path}:2: not valid UTF-8")
    # a byte-order mark at the start of the file (some editors write one) is not an error
    bom = write(folder, [b"\xef\xbb\xbf" + json.dumps(ROW).encode()], name="bom.jsonl")
    assert len(read_jsonl(bom)) == 1


def test_eval_on_a_non_utf8_jsonl_is_a_one_line_error(folder, capsys):
    path = write(folder, [ROW, b'{"image": "red.png", "text": "\xff", "answer": "red"}'])
    assert main(["eval", "tiny", "--data", str(path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: not valid UTF-8" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- truncated images


def test_data_check_decodes_every_image(folder, tiny):
    Image.new("RGB", (64, 64), "blue").save(folder / "cut.png")
    truncate(folder / "cut.png")
    path = write(folder, [ROW, {"image": "cut.png", "text": "What colour?", "answer": "blue"}])
    assert len(read_jsonl(path)) == 2  # the header is intact: training-time loading only reads headers
    report = check_file(str(path), tiny[1], DataConfig())
    assert report["valid_rows"] == 1 and report["errors"] == 1
    assert report["first_errors"][0].startswith(f"{path}:2: image {folder / 'cut.png'} is truncated or corrupt")
    assert main(["data", "check", str(path)]) == 1


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "worker-process"])
def test_a_truncated_image_at_training_time_is_skipped_and_counted(tmp_path, tiny, workers):
    rows = [{"image": f"{i}.png", "text": "What colour?", "answer": "red"} for i in range(6)]
    for copy in ("clean", "broken"):
        (tmp_path / copy).mkdir()
        for i in range(6):
            Image.new("RGB", (32 + 16 * i, 32), "red").save(tmp_path / copy / f"{i}.png")  # distinct token counts
    clean = load_dataset(str(write(tmp_path / "clean", rows)), tiny[1], DataConfig(on_error="skip"))
    path = write(tmp_path / "broken", rows)
    data = load_dataset(str(path), tiny[1], DataConfig(on_error="skip"))
    strict = load_dataset(str(path), tiny[1], DataConfig())
    truncate(tmp_path / "broken/3.png")  # broken after loading, as on a flaky disk: found only when decoded
    assert isinstance(data[3], SkippedRow) and "data.jsonl:4: image" in data[3].error
    with pytest.raises(DataError, match=r"data.jsonl:4: image .*3.png is truncated or corrupt.*data.on_error=skip"):
        strict[3]
    ours = micro_batches(data, 2, seed=0, epoch=0, position=0, num_workers=workers)  # the count rides in the batch
    theirs = micro_batches(clean, 2, seed=0, epoch=0, position=0, num_workers=0)
    def rows(batch):  # each row's tokens without padding
        return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]

    seen = 0
    for _ in range(6):  # two epochs: the sample order is the clean run's, minus the broken row
        (a, ea, pa), (b, eb, pb) = next(ours), next(theirs)
        assert (ea, pa) == (eb, pb) and "skipped_rows" not in b
        skipped = int(a.get("skipped_rows", 0))
        seen += skipped
        missing = [r for r in rows(b) if r not in rows(a)]
        assert len(rows(a)) == 2 - skipped and missing == ([tuple(data.tokenized[3].ids)] if skipped else [])
    assert seen == 2


def test_sft_with_on_error_skip_trains_past_a_broken_image(folder, tmp_path):
    # batch_size 1: the step whose only row is broken has nothing to learn from and is skipped
    rows = [{"image": f"{i}.png", "text": "What colour?", "answer": "red"} for i in range(3)]
    for i in range(3):
        Image.new("RGB", (32, 32), "red").save(folder / f"{i}.png")
    truncate(folder / "1.png")
    path = write(folder, rows)
    from vlforge.recipes.sft import run_sft

    cfg = tiny_sft_config(folder, tmp_path / "run", f"data.train={path}", "data.val=null", "data.on_error=skip",
                          "train.batch_size=1", "train.max_steps=3", "log.every=1")
    assert run_sft(cfg)["final_step"] == 3
    steps = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "loss" in s]
    broken = [s for s in steps if s.get("skipped_rows")]
    assert len(steps) == 3 and len(broken) == 1 and broken[0]["skipped"] and math.isnan(broken[0]["loss"])
    assert all(math.isfinite(s["loss"]) and not s["skipped"] for s in steps if s is not broken[0])


# ----------------------------------------------------------------------------- bombs and huge images


def test_decompression_bombs_are_refused_from_the_header(folder, tiny):
    png_header(folder / "bomb.png", 20000, 20000)
    bomb = {"image": "bomb.png", "text": "What colour?", "answer": "red"}
    path = write(folder, [ROW, bomb])
    with pytest.raises(DataError, match=r"data.jsonl:2: image .*bomb.png is too large to decode safely"):
        read_jsonl(path)
    with pytest.raises(DataError, match=r"data.jsonl:2: image .*bomb.png is too large"):
        load_dataset(str(path), tiny[1], DataConfig())
    assert len(load_dataset(str(path), tiny[1], DataConfig(on_error="skip"))) == 1
    report = check_file(str(path), tiny[1], DataConfig())
    assert report["errors"] == 1 and "data.jsonl:2: image" in report["first_errors"][0]
    # under PIL's own limit, ours decides: data.max_image_pixels
    with pytest.raises(DataError, match=r"data.jsonl:1: image .*red.png is 64x64 = 4,096 pixels, over the limit "
                                        r"of 4,000 .* raise data.max_image_pixels"):
        load_dataset(str(path), tiny[1], DataConfig(max_image_pixels=4000))
    png_header(folder / "thin.png", 4000, 10)  # the image processor refuses aspect ratios over 200
    with pytest.raises(DataError, match=r"thin.png is 4000x10: .*aspect ratios over 200"):
        read_jsonl(write(folder, [{"image": "thin.png", "text": "q", "answer": "a"}]))
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        DataConfig(max_image_pixels=0)
    with pytest.raises(ConfigError, match="data.max_image_pixels"):
        DataConfig(max_image_pixels=10**9)


def test_infer_and_chat_refuse_a_bomb_and_chat_goes_on(folder, capsys):
    from vlforge.recipes.infer import chat
    from vlforge.infer.model import InferenceModel

    bomb = png_header(folder / "bomb.png", 20000, 20000)
    assert main(["infer", "tiny", "--image", str(bomb), "--prompt", "colour?", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: image {bomb} is too large to decode safely") and "Traceback" not in err

    engine = InferenceModel.load("tiny", device="cpu", dtype=torch.float32)
    lines = iter([f"/image {bomb}", f"/image {folder / 'red.png'}", "what colour?", "/quit"])
    said = []
    chat(engine, read=lambda _: next(lines), write=said.append, max_new_tokens=2)
    assert said[1].startswith(f"cannot open {bomb}: image {bomb} is too large")
    assert said[2] == f"(attached {folder / 'red.png'})" and len(said) == 4  # ... and it answered


def _gradient(width, height):
    """A smooth image: it compresses well and differs little between resampling filters."""
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    rgb = np.stack([x + 0 * y, y + 0 * x, (x + y) / 2], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_huge_images_decode_reduced_with_the_processors_tokens(folder, tiny, fmt):
    """A 3000x2000 image for a 128x128-pixel budget reaches the processor far smaller than the file,
    yet the token ids and image grid equal transformers' processor on the full-size image."""
    _, processor = tiny
    limits = ImageLimits(32 * 32, 128 * 128)
    name = f"big.{fmt.lower()}"
    _gradient(3000, 2000).save(folder / name, fmt, quality=95)
    path = write(folder, [{"image": name, "text": "What colour?", "answer": "red"}])
    data = load_dataset(str(path), processor, DataConfig(min_pixels=limits.min_pixels, max_pixels=limits.max_pixels))
    encoder = data.encoder
    reduced = encoder.decode_image(folder / name)
    target_h, target_w = encoder.resized(3000, 2000)
    assert reduced.width < 3000 / 2 and 2 * target_w <= reduced.width and 2 * target_h <= reduced.height
    ours = encode(encoder, data.samples[0], data.tokenized[0])

    with Image.open(folder / name) as im:
        full = im.convert("RGB")
    text = processor.apply_chat_template(data.samples[0].messages, tokenize=False)
    theirs = processor(text=[text], images=[full], return_tensors="pt",
                       size={"shortest_edge": limits.min_pixels, "longest_edge": limits.max_pixels})
    assert ours["input_ids"].tolist() == theirs["input_ids"][0].tolist()
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert (ours["pixel_values"] - theirs["pixel_values"]).abs().mean() < 0.01  # normalised units (range ~4)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_reduced_decoding_backs_off_where_rounding_would_move_the_grid(tiny, tmp_path, fmt):
    encoder = Encoder(tiny[1], ImageLimits(32 * 32, 64 * 64))

    def moves(w, h, k):  # does decoding at 1/k (sizes rounded up) change the processor's grid?
        return encoder.resized(-(-w // k), -(-h // k)) != encoder.resized(w, h)

    # sizes where the largest reduction that keeps twice the target size would move the grid
    h = 611
    sizes = [(w, h) for w in range(1000, 1600) if moves(w, h, 8 if fmt == "JPEG" else
                                                         min(w // (2 * encoder.resized(w, h)[1]),
                                                             h // (2 * encoder.resized(w, h)[0])))]
    assert sizes, "no size found where rounding matters: the test would prove nothing"
    for w, h in sizes[:3]:
        path = tmp_path / f"{w}.{fmt.lower()}"
        _gradient(w, h).save(path, fmt)
        decoded = encoder.decode_image(path)
        assert encoder.resized(*decoded.size) == encoder.resized(w, h)


def test_grpo_with_on_error_skip_rolls_out_past_a_broken_image(tmp_path):
    from test_grpo import grpo_config

    from vlforge.recipes.grpo import run_grpo

    rows = [{"image": f"{i}.png", "text": "What colour is the shape?", "answer": "red"} for i in range(4)]
    for i in range(4):
        Image.new("RGB", (32, 32), "red").save(tmp_path / f"{i}.png")
    path = write(tmp_path, rows)
    truncate(tmp_path / "2.png")  # the header opens (check_readable passes), decoding fails in the rollout
    args = [f"data.train={path}", "train.max_steps=2"]  # 2 steps x 2 prompts: every row is drawn
    with pytest.raises(DataError, match=r"data.jsonl:3: image .*2.png is truncated or corrupt"):
        run_grpo(grpo_config(tmp_path, tmp_path / "strict", tmp_path, *args))
    result = run_grpo(grpo_config(tmp_path, tmp_path / "skip", tmp_path, *args, "data.on_error=skip"))
    assert result["final_step"] == 2
    steps = [json.loads(line) for line in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(s["groups_trained"] for s in steps if "groups_trained" in s) == [1, 2]  # one prompt left out
