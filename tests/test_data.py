import json
import shutil

import pytest
import torch
from PIL import Image

from vlforge.config import DataConfig
from vlforge.data.check import check_file
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import IGNORE_INDEX, collate
from vlforge.data.inline import DataError
from vlforge.data.jsonl import read_jsonl
from vlforge.data.synth import synth_shapes


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    Image.new("RGB", (64, 32), "blue").save(tmp_path / "blue.png")
    (tmp_path / "broken.png").write_bytes(b"not an image at all")
    return tmp_path


def write(folder, rows):
    path = folder / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"image": "red.png", "text": "What colour?", "answer": "red"}
BAD_ROWS = [
    ('{"image": "red.png", "text": "x", ', "malformed JSON"),
    ({"image": "red.png", "answer": "red"}, "missing key 'text'"),
    ({"image": "red.png", "text": "What colour?"}, "missing key 'answer'"),
    ({"image": "nope.png", "text": "What colour?", "answer": "red"}, "nope.png not found"),
    ({"image": "broken.png", "text": "What colour?", "answer": "red"}, "cannot be decoded"),
    ({"image": "red.png", "text": "What colour?", "answer": "  "}, "'answer' is empty"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "last message must be a non-empty assistant"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "needs 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}, {"role": "assistant", "content": "x"}]},
     "parts must be"),
    ('[1, 2]', "must be a JSON object"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_each_bad_row_names_file_and_line(folder, row, message):
    path = write(folder, [GOOD, GOOD, row])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:3:")
    assert message in str(err.value)


def test_skip_mode_counts_bad_rows(folder):
    path = write(folder, [GOOD] + [r for r, _ in BAD_ROWS] + [GOOD])
    from vlforge.data.jsonl import LoadReport

    report = LoadReport()
    samples = read_jsonl(path, on_error="skip", report=report)
    assert len(samples) == 2
    assert report.rows == len(BAD_ROWS) + 2
    assert sum(report.skipped.values()) == len(BAD_ROWS)


def test_both_schemas_and_multi_image(folder, tiny):
    _, processor = tiny
    rows = [
        {"images": ["red.png", "blue.png"], "prompt": "Which is wider?", "answer": "the second", "task": "cmp"},
        {"messages": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": [{"type": "image", "image": str(folder / "blue.png")},
                                         {"type": "text", "text": "And this?"}]},
            {"role": "assistant", "content": "blue"}]},
    ]
    data = load_dataset(str(write(folder, rows)), processor, DataConfig())
    assert len(data) == 2 and data.samples[0].fields == {"task": "cmp"}
    assert data.samples[1].answer == "blue"
    tok = processor.tokenizer
    for i, expected in [(0, ["the second"]), (1, ["red", "blue"])]:
        item = data[i]
        assert item["image_grid_thw"].shape[0] == 2
        assert int(item["mm_token_type_ids"].sum()) == int((item["image_grid_thw"].prod(-1) // 4).sum())
        # loss only on assistant content + its <|im_end|>: decode each labelled span
        labels = item["labels"].tolist()
        spans, current = [], []
        for t in labels:
            if t == IGNORE_INDEX:
                if current:
                    spans.append(current)
                current = []
            else:
                current.append(t)
        spans += [current] if current else []
        assert [tok.decode(s) for s in spans] == [e + "<|im_end|>" for e in expected]


def test_truncation_never_cuts_an_image(folder, tiny):
    _, processor = tiny
    short = len(load_dataset(str(write(folder, [GOOD])), processor, DataConfig()).tokenized[0].ids)
    path = write(folder, [GOOD, {"image": "red.png", "text": "What colour? " * 30, "answer": "red " * 40}])
    with pytest.raises(DataError, match=r"data.jsonl:2: .* exceed data.max_length"):
        load_dataset(str(path), processor, DataConfig(max_length=short + 5, too_long="fail"))
    dropped = load_dataset(str(path), processor, DataConfig(max_length=short + 5, too_long="drop"))
    assert len(dropped) == 1 and dropped.report.skipped["too long"] == 1
    # truncate: keeps every image token and cuts only answer tokens
    kept = load_dataset(str(path), processor, DataConfig(max_length=150, too_long="truncate"))
    assert len(kept) == 2 and kept.truncated == 1
    item = kept[1]
    assert len(item["input_ids"]) == 150 and (item["labels"] != IGNORE_INDEX).any()
    assert int(item["mm_token_type_ids"].sum()) == 16
    # a limit that would cut inside the image span drops the sample instead of cutting it
    with pytest.raises(DataError, match="no usable rows"):
        load_dataset(str(write(folder, [GOOD])), processor, DataConfig(max_length=10, too_long="truncate"))


def test_undecodable_image_found_late_names_the_row(folder, tiny):
    _, processor = tiny
    path = write(folder, [GOOD, {"image": "late.png", "text": "What colour?", "answer": "red"}])
    shutil.copy(folder / "red.png", folder / "late.png")
    data = load_dataset(str(path), processor, DataConfig())
    raw = (folder / "red.png").read_bytes()
    (folder / "late.png").write_bytes(raw[:60])  # truncated after validation
    with pytest.raises(DataError, match=r"data.jsonl:2: image .*late.png is truncated or corrupt"):
        data[1]


def test_collate_pads_right_and_left(tiny, shapes_dir):
    _, processor = tiny
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    items = [data[i] for i in range(4)]
    right = collate(items, data.encoder.pad_id)
    left = collate(items, data.encoder.pad_id, left_pad=True)
    for i, it in enumerate(items):
        n = len(it["input_ids"])
        assert torch.equal(right["input_ids"][i, :n], it["input_ids"])
        assert torch.equal(left["input_ids"][i, -n:], it["input_ids"])
        assert int(right["attention_mask"][i].sum()) == n
    assert right["pixel_values"].shape[0] == sum(it["pixel_values"].shape[0] for it in items)


def test_synth_is_deterministic_and_checkable(tmp_path):
    a = synth_shapes(tmp_path / "a", 20, seed=3)
    b = synth_shapes(tmp_path / "b", 20, seed=3)
    assert a["train"].read_text() == b["train"].read_text()
    assert (tmp_path / "a/images/000007.png").read_bytes() == (tmp_path / "b/images/000007.png").read_bytes()
    rows = [json.loads(line) for line in a["train"].read_text().splitlines()]
    assert {r["task"] for r in rows} == {"colour", "shape", "position", "count"}
    counts = [r for r in rows if r["task"] == "count"]
    assert all(r["answer"] in {"1", "2", "3", "4"} for r in counts)


def test_data_check_reports_lengths_and_errors(folder, tiny):
    _, processor = tiny
    path = write(folder, [GOOD, GOOD, '{"broken"', {"image": "red.png", "text": "q " * 200, "answer": "a"}])
    report = check_file(str(path), processor, DataConfig(max_length=100))
    assert report["rows"] == 4 and report["valid_rows"] == 3 and report["errors"] == 1
    assert report["over_max_length"] == 1
    assert report["tokens"]["max"] > 200 > report["tokens"]["p50"]
    assert "data.jsonl:3" in report["first_errors"][0]
