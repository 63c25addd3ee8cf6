"""Datasets as users have them (issue 45): ShareGPT/LLaVA JSON, OpenAI messages with data URLs,
parquet and `datasets` folders with embedded images (written by the real `datasets` / pyarrow),
column mapping; each tokenizes to the ids of the equivalent native JSONL. Streaming opens a
million-row parquet set materialising only the rows a batch takes; its shuffle is a function of
(seed, epoch), so a resume mid-epoch gives the same batches. Bad rows name file:row."""

import base64
import io
import json
import os

import pickle

import pytest
import torch
from PIL import Image

os.environ["HF_DATASETS_OFFLINE"] = "1"  # set before `datasets` is imported: the writers below never reach the Hub
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from vlforge.config import DataConfig, GRPOConfig, load_config  # noqa: E402
from vlforge.data.check import check_file  # noqa: E402
from vlforge.data.convert import convert  # noqa: E402
from vlforge.data.dataset import StreamDataset, block_order, load_dataset  # noqa: E402
from vlforge.data.encode import SkippedRow  # noqa: E402
from vlforge.data.inline import DataError  # noqa: E402
from vlforge.data.jsonl import LoadReport
from vlforge.data.sources import open_source, read_samples  # noqa: E402
from vlforge.recipes.sft import micro_batches, run_sft  # noqa: E402

from helpers import tiny_sft_config  # noqa: E402


def png(colour, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "red.png").write_bytes(png("red"))
    (tmp_path / "blue.png").write_bytes(png("blue", (32, 64)))
    return tmp_path


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def image_features():
    return datasets.Features({"images": datasets.List(datasets.Image()), "problem": datasets.Value("string"),
                              "answer": datasets.Value("string")})


# the native rows every other format below is equivalent to
NATIVE = [
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", "text": "\nand "},
                                               {"type": "image", "image": "blue.png"},
                                               {"type": "text", "text": ": which is taller?"}]},
                  {"role": "assistant", "content": "the second"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Colour? "},
                                               {"type": "image", "image": "red.png"}]},
                  {"role": "assistant", "content": "red"}]},
]
LLAVA = [
    {"id": "0", "images": ["red.png", "blue.png"], "system": "Be brief.",
     "conversations": [{"from": "human", "value": "<image>\nand <image>: which is taller?"},
                       {"from": "gpt", "value": "the second"}]},
    {"id": "1", "image": "red.png", "conversations": [{"from": "human", "value": "Colour? <image>"},
                                                      {"from": "gpt", "value": "red"}]},
]


SWIFT = [  # ms-swift / LLaMA-Factory's OpenAI style: string contents, the images beside the messages
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "<image>\nand <image>: which is taller?"},
                  {"role": "assistant", "content": "the second"}], "images": ["red.png", "blue.png"]},
    {"messages": [{"role": "user", "content": "Colour? <image>"}, {"role": "assistant", "content": "red"}],
     "images": ["red.png"]},
]


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


def openai_rows(folder):
    return [
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": [
                          {"type": "image_url", "image_url": {"url": data_url((folder / "red.png").read_bytes())}},
                          {"type": "text", "text": "\nand "},
                          {"type": "image_url", "image_url": {"url": "blue.png"}},  # a local path in the folder
                          {"type": "text", "text": ": which is taller?"}]},
                      {"role": "assistant", "content": "the second"}]},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Colour? "},
            {"type": "image_url", "image_url": {"url": f"file://{folder / 'red.png'}"}}]},
            {"role": "assistant", "content": "red"}]},
    ]


def ids_and_pixels(path, processor, **cfg):
    data = load_dataset(str(path), processor, DataConfig(**cfg))
    return [t.ids for t in data.tokenized], [data[i]["pixel_values"] for i in range(len(data))]


def test_llava_json_swift_and_openai_jsonl_tokenize_like_native_jsonl(folder, tiny):
    _, processor = tiny
    ids, pixels = ids_and_pixels(jsonl(folder / "native.jsonl", NATIVE), processor)
    (folder / "llava.json").write_text(json.dumps(LLAVA))
    for path in (folder / "llava.json", jsonl(folder / "llava.jsonl", LLAVA), jsonl(folder / "swift.jsonl", SWIFT),
                 jsonl(folder / "openai.jsonl", openai_rows(folder))):
        got_ids, got_pixels = ids_and_pixels(path, processor)
        assert got_ids == ids, path.name
        assert all(torch.equal(a, b) for a, b in zip(got_pixels, pixels)), path.name
    # the placeholders bound two different images in order: swapping them changes the ids
    swapped = [{**LLAVA[0], "images": ["blue.png", "red.png"]}, LLAVA[1]]
    assert ids_and_pixels(jsonl(folder / "swapped.jsonl", swapped), processor)[0][0] != ids[0]


def write_geometry(folder, n=2, name="geo.parquet"):
    """A verl / EasyR1-style RL set: images as embedded bytes, `problem` with <image>, `answer`."""
    ds = datasets.Dataset.from_dict({
        "images": [[{"bytes": png("red" if i % 2 else "blue"), "path": None}] for i in range(n)],
        "problem": [f"<image>Which colour is shape {i}?" for i in range(n)],
        "answer": ["red" if i % 2 else "blue" for i in range(n)]}, features=image_features())
    ds.to_parquet(str(folder / name))
    return ds


def test_parquet_and_save_to_disk_with_embedded_images_tokenize_like_native_jsonl(folder, tiny):
    _, processor = tiny
    ds = write_geometry(folder)
    ds.save_to_disk(str(folder / "geo_disk"))
    (folder / "blue48.png").write_bytes(png("blue"))
    native = [{"images": ["blue48.png" if i % 2 == 0 else "red.png"], "prompt": f"Which colour is shape {i}?",
               "answer": "red" if i % 2 else "blue"} for i in range(2)]
    ids, pixels = ids_and_pixels(jsonl(folder / "native.jsonl", native), processor)
    for path in (folder / "geo.parquet", folder / "geo_disk"):
        got_ids, got_pixels = ids_and_pixels(path, processor, columns={"prompt": "problem"})
        assert got_ids == ids, path.name
        assert all(torch.equal(a, b) for a, b in zip(got_pixels, pixels)), path.name
    # without the mapping the set has no question: the error names the row and the columns it has
    with pytest.raises(DataError, match=r"geo\.parquet:row 0: missing key 'text' \(or 'prompt'\)"):
        load_dataset(str(folder / "geo.parquet"), processor, DataConfig())


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(folder, tiny):
    _, processor = tiny
    bad = {
        "missing column": ({"images": [[{"bytes": png("red"), "path": None}]], "question": ["<image>Colour?"],
                            "answer": ["red"]}, "missing column 'problem' (data.columns.prompt)"),
        "undecodable bytes": ({"images": [[{"bytes": b"not an image", "path": None}]], "problem": ["<image>Colour?"],
                               "answer": ["red"]}, "images[0] (an embedded image of 12 bytes) cannot be decoded"),
        "placeholders != images": ({"images": [[{"bytes": png("red"), "path": None}]],
                                    "problem": ["<image><image>Same?"], "answer": ["yes"]},
                                   "2 <image> placeholders in the text but 1 image"),
    }
    good = {"images": [[{"bytes": png("red"), "path": None}]], "problem": ["<image>Colour?"], "answer": ["red"]}
    for name, (columns, says) in bad.items():
        table = pa.concat_tables([pa.table(good), pa.table(columns)], promote_options="default") \
            if "problem" in columns else pa.table(columns)
        path = folder / f"{name.replace(' ', '_')}.parquet"
        pq.write_table(table, path)
        row = 1 if "problem" in columns else 0
        with pytest.raises(DataError) as err:
            load_dataset(str(path), processor, DataConfig(columns={"prompt": "problem"}))
        assert str(err.value).startswith(f"{path}:row {row}: "), str(err.value)
        assert says in str(err.value), str(err.value)
    remote = openai_rows(folder)[:1]
    remote[0]["messages"][1]["content"][2]["image_url"]["url"] = "https://example.com/blue.png"
    outside = openai_rows(folder)[1:]
    outside[0]["messages"][0]["content"][1]["image_url"]["url"] = "../elsewhere.png"
    path = jsonl(folder / "openai_bad.jsonl", openai_rows(folder) + remote + outside)
    with pytest.raises(DataError, match=r"openai_bad\.jsonl:3: messages\[1\]\.content\[2\]: image_url "
                                        r"https://example\.com/blue\.png is a remote URL"):
        load_dataset(str(path), processor, DataConfig())
    report = check_file(str(path), processor, DataConfig())  # every bad row, counted; the good ones decoded
    assert (report["rows"], report["valid_rows"], report["errors"], report["images"]) == (4, 2, 2, 3)
    assert any("openai_bad.jsonl:4: messages[0].content[1]: image" in e and "outside the dataset's folder" in e
               for e in report["first_errors"]), report["first_errors"]
    skipped = load_dataset(str(path), processor, DataConfig(on_error="skip"))
    assert len(skipped) == 2 and sum(skipped.report.skipped.values()) == 2


def million_row_parquet(path, rows=1_000_000, group=10_000):
    item = pa.array([[{"bytes": png("red", (32, 32)), "path": None}]])  # one image, repeated by reference
    images = pa.repeat(item[0], rows) if hasattr(pa, "repeat") else pa.array([item[0].as_py()] * rows)
    questions = pa.array([f"<image>Row {i}: colour?" for i in range(rows)])
    pq.write_table(pa.table({"images": images, "problem": questions, "answer": pa.repeat(pa.scalar("red"), rows)}),
                   path, row_group_size=group)


def test_a_million_row_parquet_set_streams_materialising_only_the_rows_batches_take(tmp_path, tiny):
    _, processor = tiny
    path = tmp_path / "big.parquet"
    million_row_parquet(path)
    cfg = DataConfig(train=str(path), columns={"prompt": "problem"}, stream=True, stream_window=2)
    data = load_dataset(str(path), processor, cfg)
    assert isinstance(data, StreamDataset) and len(data) == 1_000_000
    assert data.samples.source.materialised == 0  # opened: row-group sizes read from the footer, no rows
    stream_ = micro_batches(data, 4, seed=0, epoch=0, position=0, num_workers=0)
    batches = [next(stream_) for _ in range(3)]
    assert data.samples.source.materialised == 12  # the three batches' rows, nothing else
    assert data.samples.source.groups_read == 2  # the block shuffle: one window of 2 row groups decoded
    assert all(len(b["input_ids"]) == 4 and b["pixel_values"].shape[0] > 0 for b, _, _ in batches)
    # the order is the block shuffle: the first window's rows come from two row groups of 10,000
    order = block_order(data.lengths.blocks, 2, 0, 0)
    assert len({i // 10_000 for i in order[:20_000]}) == 2 and order[:12] != sorted(order[:12])


def small_parquet(folder, n=24, group=4):
    rows = {"images": [[{"bytes": png(c, (32 + 8 * (i % 3), 32)), "path": None}] for i, c in
                       enumerate(["red", "blue", "green"] * (n // 3))],
            "problem": [f"<image>Row {i}: colour?" for i in range(n)],
            "answer": [["red", "blue", "green"][i % 3] for i in range(n)]}
    path = folder / "small.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=group)
    return path


def test_resume_mid_epoch_on_streamed_parquet_gives_the_same_batches(tmp_path, tiny):
    _, processor = tiny
    path = small_parquet(tmp_path)
    cfg = DataConfig(train=str(path), columns={"prompt": "problem"}, stream=True, stream_window=2)
    data = load_dataset(str(path), processor, cfg)
    straight = micro_batches(data, 3, seed=5, epoch=0, position=0, num_workers=0)
    first = [next(straight) for _ in range(10)]  # 8 batches an epoch: two of the next epoch too
    _, epoch, position = first[4]
    resumed_data = load_dataset(str(path), processor, cfg)  # a fresh process's dataset
    resumed = micro_batches(resumed_data, 3, seed=5, epoch=epoch, position=position, num_workers=0)
    for (a, ea, pa_), (b, eb, pb) in zip(first[5:], (next(resumed) for _ in range(5))):
        assert (ea, pa_) == (eb, pb)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    # DataLoader workers get a pickled copy: no decoded row group or open file travels with it
    copy = pickle.loads(pickle.dumps(resumed_data))
    assert "_cache" not in vars(copy.samples.source) and len(pickle.dumps(resumed_data)) < 100_000
    assert torch.equal(copy[7]["input_ids"], data[7]["input_ids"])
    # the two epochs differ (the shuffle acted), and each is a permutation of the rows
    e0, e1 = block_order(data.lengths.blocks, 2, 5, 0), block_order(data.lengths.blocks, 2, 5, 1)
    assert sorted(e0) == sorted(e1) == list(range(24)) and e0 != e1 and e0 != list(range(24))


def test_streamed_rows_too_long_or_bad_become_counted_skips(tmp_path, tiny):
    _, processor = tiny
    path = small_parquet(tmp_path, n=6, group=3)
    table = pq.read_table(path).to_pylist()
    table[1]["answer"] = "word " * 400  # too long for max_length=64
    table[2]["images"] = [{"bytes": b"broken", "path": None}]
    pq.write_table(pa.Table.from_pylist(table), path)
    cfg = DataConfig(train=str(path), columns={"prompt": "problem"}, stream=True, max_length=64, on_error="skip")
    data = load_dataset(str(path), processor, cfg)
    items = [data[i] for i in range(6)]
    assert [type(x).__name__ for x in items] == ["dict", "SkippedRow", "SkippedRow", "dict", "dict", "dict"]
    assert "small.parquet:row 1: too long" in items[1].error and "small.parquet:row 2: " in items[2].error
    with pytest.raises(DataError, match=r"small\.parquet:row 2: images\[0\]"):
        load_dataset(str(path), processor, DataConfig(**{**vars(cfg), "on_error": "fail"}))[2]
    assert isinstance(items[1], SkippedRow)


def test_data_convert_writes_native_jsonl_and_image_files_that_read_the_same(folder, tiny):
    _, processor = tiny
    write_geometry(folder, n=4)
    cfg = DataConfig(columns={"prompt": "problem"})
    out = folder / "out" / "geo.jsonl"
    report = convert(folder / "geo.parquet", out, cfg)
    assert (report.rows, report.kept) == (4, 4)
    assert len(list((folder / "out" / "geo-images").iterdir())) == 2  # two distinct images, written once each
    assert ids_and_pixels(out, processor)[0] == ids_and_pixels(folder / "geo.parquet", processor,
                                                                  columns={"prompt": "problem"})[0]
    with pytest.raises(DataError, match="exists"):
        convert(folder / "geo.parquet", out, cfg)  # never over a file
    from vlforge.cli import main  # the command: the same, its overrides mapping the column

    assert main(["data", "convert", str(folder / "geo.parquet"), str(folder / "cli.jsonl"),
                 "data.columns.prompt=problem"]) == 0
    assert (folder / "cli.jsonl").read_text() == out.read_text().replace("geo-images/", "cli-images/")
    assert main(["data", "convert", str(folder / "geo.parquet"), str(folder / "bad.jsonl")]) == 2  # no mapping
    assert not (folder / "bad.jsonl").exists()


def test_sft_trains_from_parquet_as_from_the_equivalent_jsonl(shapes_dir, tmp_path):
    """The same 16 samples as embedded parquet and as JSONL: the same losses step for step (read
    whole, the same order); streamed, the run trains too (its block shuffle is another order)."""
    rows = [json.loads(line) for line in (shapes_dir / "train.jsonl").read_text().splitlines()][:16]
    ds = datasets.Dataset.from_dict({
        "images": [[{"bytes": (shapes_dir / r["image"]).read_bytes(), "path": None}] for r in rows],
        "question": [r["text"] for r in rows], "answer": [r["answer"] for r in rows],
        "task": [r["task"] for r in rows]}, features=datasets.Features({
            "images": datasets.List(datasets.Image()), "question": datasets.Value("string"),
            "answer": datasets.Value("string"), "task": datasets.Value("string")}))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    jsonl(tmp_path / "train.jsonl", [{**r, "image": str(shapes_dir / r["image"])} for r in rows])
    common = ["data.val=null", "train.max_steps=3", "data.num_workers=0"]
    parquet = [f"data.train={tmp_path / 'train.parquet'}", "data.columns.text=question"]
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "j", *common, f"data.train={tmp_path / 'train.jsonl'}"))
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "p", *common, *parquet))
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "s", *common, *parquet, "data.stream=true"))
    losses = lambda d: [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(losses(tmp_path / "j")) == 3
    assert losses(tmp_path / "p") == losses(tmp_path / "j")
    assert len(losses(tmp_path / "s")) == 3 and all(x == x for x in losses(tmp_path / "s"))


def test_grpo_runs_from_parquet_with_answers_reaching_the_reward(folder, tmp_path):
    write_geometry(folder, n=4)
    seen = tmp_path / "seen.txt"
    (tmp_path / "rewards.py").write_text(
        "def answer_seen(completion, answer, **row):\n"
        f"    open({str(seen)!r}, 'a').write(answer + '\\n')\n"
        "    return float(len(completion) % 3)\n")
    cfg = load_config(GRPOConfig, None, [
        "model.preset=tiny", f"data.train={folder / 'geo.parquet'}", "data.columns.prompt=problem",
        "data.val=null", "precision.mode=fp32", "train.device=cpu", f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=1", "log.progress=false", "rollout.group_size=2", "rollout.prompts_per_step=2",
        "rollout.max_new_tokens=3", "rl.mini_batch_size=4", "data.stream=true",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:answer_seen'}}]"])
    from vlforge.recipes.grpo import run_grpo

    run_grpo(cfg)
    answers = seen.read_text().split()
    assert len(answers) == 4 and set(answers) <= {"red", "blue"}  # 2 prompts x 2 samples, the `answer` column
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip()


def test_open_source_reads_no_rows_and_read_samples_and_data_check_count_them(folder, tiny):
    _, processor = tiny
    write_geometry(folder, n=3)
    source = open_source(folder / "geo.parquet")
    assert len(source) == 3 and source.materialised == 0
    report = LoadReport()
    samples = read_samples(folder / "geo.parquet", DataConfig(columns={"prompt": "problem"}), report=report)
    assert (report.rows, report.kept, len(samples)) == (3, 3, 3)
    assert [s.answer for s in samples] == ["blue", "red", "blue"]
    report = check_file(str(folder / "geo.parquet"), processor, DataConfig(columns={"prompt": "problem"}))
    assert (report["rows"], report["valid_rows"], report["errors"], report["images"]) == (3, 3, 0, 3)
    assert report["image_tokens_mean"] > 0 and report["tokens"]["max"] > 0


def test_eval_answers_a_parquet_set_as_its_jsonl_equivalent(folder):
    """`vlforge eval --data` reads every format training reads: an embedded-image parquet set (its
    question column mapped by --column) gets the answers, references and accuracy of the same rows as
    native JSONL; a set it cannot read is refused before the model loads."""
    from vlforge.cli import main

    write_geometry(folder, n=4)
    (folder / "blue.png").write_bytes(png("blue"))
    (folder / "red.png").write_bytes(png("red"))
    native = [{"image": "red.png" if i % 2 else "blue.png", "prompt": f"Which colour is shape {i}?",
               "answer": "red" if i % 2 else "blue"} for i in range(4)]
    jsonl(folder / "native.jsonl", native)
    reports = {}
    for name, extra in (("native.jsonl", []), ("geo.parquet", ["--column", "prompt=problem"])):
        out = folder / f"{name}.json"
        assert main(["eval", "tiny", "--device", "cpu", "--data", str(folder / name), "--max-new-tokens", "4",
                     "--out", str(out), *extra]) == 0
        reports[name] = json.loads(out.read_text())
    assert reports["geo.parquet"]["n"] == 4
    strip = lambda report: [{k: v for k, v in row.items() if k != "source"} for row in report["answers"]]  # noqa: E731
    assert strip(reports["geo.parquet"]) == strip(reports["native.jsonl"])
    assert main(["eval", "tiny", "--device", "cpu", "--data", str(folder / "geo.parquet")]) == 2  # no question column
    assert main(["eval", "tiny", "--device", "cpu", "--data", str(folder / "geo.parquet"), "--column", "prompt"]) == 2
