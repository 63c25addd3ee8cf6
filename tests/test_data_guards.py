"""Data rows are never silently wrong or unbounded (issue 41): layouts whose images would be lost are
refused with file:line, the key and what to write instead; an `<image>` placeholder no image is bound
to is refused; a text too long for data.max_length is never tokenized whole (counted through the real
tokenizer); a bad image path says what it is (a directory, a symlink loop) in data check, training,
infer's and serve's image loading."""

import json
from pathlib import Path

import pytest
from PIL import Image

from vlforge.config import DataConfig
from vlforge.data.check import check_file, format_check
from vlforge.data.dataset import CUT_MARGIN, load_dataset
from vlforge.data.encode import IGNORE_INDEX, IMAGE_PAD, Encoder, ImageLimits
from vlforge.data.inline import DataError
from vlforge.data.jsonl import LoadReport, read_jsonl
from vlforge.data.video import read_video_header


@pytest.fixture
def folder(tmp_path):
    Image.new("RGB", (64, 64), "red").save(tmp_path / "red.png")
    return tmp_path


def write(folder, rows):
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = {"image": "red.png", "text": "What colour?", "answer": "red"}
USER_ASKS = [{"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "red"}]

# (row, what the error must say) for rows that used to load with their images silently dropped and
# are still ambiguous; the layouts now read (ShareGPT/LLaVA, top-level images bound to placeholders)
# are tested in tests/test_formats.py
REFUSED = {
    "ms-swift images, counts differ": ({"messages": USER_ASKS, "images": ["red.png", "red.png"]},
                                       ["1 <image> placeholder", "2 images", "counts must be equal"]),
    "top-level image, no placeholder": ({"messages": [{"role": "user", "content": "What colour?"},
                                                      {"role": "assistant", "content": "red"}], "image": "red.png"},
                                        ["0 <image> placeholders", "1 image"]),
    "top-level videos": ({"messages": USER_ASKS, "videos": ["a.mp4"]}, ["1 <image> placeholder in the text but 0 images"]),
    "simple videos": ({"videos": ["a.mp4"], "text": "What?", "answer": "x"}, ["'videos' is not a key"]),
    "placeholder, chat string": ({"messages": USER_ASKS}, ["messages[0].content:", "<image> placeholder"]),
    "placeholder, chat part": (
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                   {"type": "text", "text": "<video> what moves?"}]},
                      {"role": "assistant", "content": "x"}]},
        ["messages[0].content[1]:", "<video> placeholder", '{"type": "video", "video": path}']),
    "placeholder, simple text, no image": ({"text": "<image>\nWhat colour?", "answer": "red"},
                                           ["1 <image> placeholder in the text but 0 images"]),
    "placeholder, answer": ({"image": "red.png", "text": "Draw it", "answer": "<image>"}, ["'answer':"]),
    "LLaVA, counts differ": ({"image": "red.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat colour?<image>"}, {"from": "gpt", "value": "red"}]},
        ["2 <image> placeholders in the text but 1 image"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_rows_that_would_lose_their_images_are_refused_naming_file_line_and_key(folder, name):
    row, says = REFUSED[name]
    path = write(folder, [GOOD, row])
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value).startswith(f"{path}:2:"), str(err.value)
    for words in says:
        assert words in str(err.value), (words, str(err.value))


def test_data_check_counts_those_rows_as_errors_and_native_rows_keep_their_images(folder, tiny):
    """The trial's row (ms-swift's layout) was "valid with 0 images" in data check: now read, and its
    ambiguous forms (placeholder and image counts that differ) errors; the native layouts keep every
    image (an "image" or "<image>"-free text, an images list, image parts)."""
    _, processor = tiny
    native = [GOOD, {"images": ["red.png", "red.png"], "prompt": "Same image twice?", "answer": "yes"},
              {"messages": [{"role": "user", "content": [{"type": "image", "image": "red.png"},
                                                         {"type": "text", "text": "Describe the image."}]},
                            {"role": "assistant", "content": "A red square."}]}]
    refused = [REFUSED[name][0] for name in ("ms-swift images, counts differ", "LLaVA, counts differ",
                                             "placeholder, simple text, no image")]
    report = check_file(str(write(folder, native + refused)), processor, DataConfig())
    assert (report["rows"], report["valid_rows"], report["errors"], report["images"]) == (6, 3, 3, 4)
    assert report["image_tokens_mean"] > 0
    assert any("data.jsonl:4: 1 <image> placeholder in the text but 2 images" in e for e in report["first_errors"])


def test_the_missing_text_error_names_the_layouts_read(folder):
    with pytest.raises(DataError) as err:
        read_jsonl(write(folder, [{"image": "red.png", "question": "What colour?", "answer": "red"}]))
    assert str(err.value).startswith(f"{folder / 'data.jsonl'}:1: missing key 'text'")
    assert '"messages"' in str(err.value) and '"answer"' in str(err.value)


# -- a text too long to fit data.max_length is never tokenized whole ----------------------------


@pytest.fixture
def tokenized_chars(tiny, monkeypatch):
    """The characters of every text the tiny processor's (real) tokenizer is called with, less those of
    the image placeholders' expansion (<|image_pad|> once per image token: bounded by the image sizes)."""
    tokenizer = tiny[1].tokenizer
    seen, real = [], type(tokenizer).__call__

    def spy(self, text=None, *args, **kwargs):
        for t in [text] if isinstance(text, str) else text or []:
            seen.append(len(t) - len(IMAGE_PAD) * max(0, t.count(IMAGE_PAD) - 1))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    return seen


MAX_LENGTH = 64


def huge_row(chars: int, in_answer: bool) -> dict:
    words = "the red square sits left of a blue circle " * (chars // 42)
    return {"image": "red.png", "text": "Describe it." if in_answer else words, "answer": words if in_answer else "red"}


@pytest.mark.parametrize("too_long", ["drop", "fail", "truncate"])
def test_a_multi_megabyte_row_is_never_tokenized_whole(folder, tiny, tokenized_chars, too_long):
    """A 3 MB text under data.max_length=64: each policy acts as on any over-long row, and the
    tokenizer never sees more than (max_length + CUT_MARGIN) x chars-per-token characters at once."""
    _, processor = tiny
    path = write(folder, [GOOD, huge_row(3_000_000, in_answer=too_long == "truncate")])
    cfg = DataConfig(max_length=MAX_LENGTH, too_long=too_long)
    if too_long == "fail":
        with pytest.raises(DataError, match=r"data.jsonl:2: its text alone \(3,0\d\d,\d\d\d characters, at most \d+ a "
                                            r"token\) is at least [\d,]+ tokens, which exceed data.max_length=64"):
            load_dataset(str(path), processor, cfg)
    else:
        data = load_dataset(str(path), processor, cfg)
        if too_long == "drop":
            assert len(data) == 1 and data.report.skipped["too long"] == 1
        else:  # the image and the start of the answer kept, max_length tokens of a bounded prefix
            assert len(data) == 2 and data.truncated == 1 and data.lengths == [len(data.tokenized[0].ids), MAX_LENGTH]
            item = data[1]
            assert (item["labels"] != IGNORE_INDEX).any() and int(item["mm_token_type_ids"].sum()) == 16
    per_token = Encoder(processor, ImageLimits(32 * 32, 1024 * 1024)).chars_per_token
    assert per_token and max(tokenized_chars) <= (MAX_LENGTH + CUT_MARGIN) * per_token < 3_000_000 // 100


def test_data_check_counts_the_huge_row_over_max_length_at_a_lower_bound(folder, tiny, tokenized_chars):
    _, processor = tiny
    path = write(folder, [GOOD, huge_row(3_000_000, in_answer=False)])
    report = check_file(str(path), processor, DataConfig(max_length=MAX_LENGTH))
    per_token = Encoder(processor, ImageLimits(32 * 32, 1024 * 1024)).chars_per_token
    assert report["valid_rows"] == 2 and report["over_max_length"] == 1 == report["over_max_length_untokenized"]
    assert report["tokens"]["max"] >= 3_000_000 // per_token  # at least its characters / the most a token holds
    assert "not tokenized whole" in format_check(report)
    assert max(tokenized_chars) <= (MAX_LENGTH + CUT_MARGIN) * per_token


def test_a_truncated_long_row_keeps_the_tokens_of_the_whole_text(folder, tiny):
    """A row just past the bound: the max_length tokens truncation keeps from the bounded prefix are
    those of the whole text's tokenization, labels included (the prefix is cut CUT_MARGIN tokens later)."""
    _, processor = tiny
    row = huge_row(40_000, in_answer=True)
    data = load_dataset(str(write(folder, [row])), processor, DataConfig(max_length=MAX_LENGTH, too_long="truncate"))
    enc, sample, kept = data.encoder, data.samples[0], data.tokenized[0]
    whole = enc.token_ids(sample.messages, [(64, 64)], tools=sample.tools)
    assert len(whole) > len(kept.ids) and kept.keep == MAX_LENGTH
    assert kept.ids[:MAX_LENGTH] == whole[:MAX_LENGTH]
    assert kept.labels[:MAX_LENGTH] == enc.assistant_labels(whole)[:MAX_LENGTH]


# -- image and video paths that are no file say what they are ----------------------------------


@pytest.fixture
def bad_paths(folder):
    (folder / "adir").mkdir()
    (folder / "loop.png").symlink_to(folder / "loop2.png")
    (folder / "loop2.png").symlink_to(folder / "loop.png")
    (folder / "dangling.png").symlink_to(folder / "gone.png")
    return folder


PATH_PROBLEMS = [("adir", "is a directory, not a file"), ("loop.png", "is a symlink loop"),
                 ("dangling.png", "is a broken symlink"), ("nope.png", "not found (paths are relative")]


@pytest.mark.parametrize("name,says", PATH_PROBLEMS)
def test_bad_image_paths_say_what_they_are_in_data_check_and_training(bad_paths, tiny, name, says):
    _, processor = tiny
    path = write(bad_paths, [GOOD, {"image": name, "text": "What colour?", "answer": "red"}])
    with pytest.raises(DataError) as err:
        load_dataset(str(path), processor, DataConfig())
    assert str(err.value).startswith(f"{path}:2: image file {bad_paths / name} {says}")
    report = check_file(str(path), processor, DataConfig())
    assert report["errors"] == 1 and says in report["first_errors"][0]


def test_bad_paths_in_video_rows_and_infer_loading_say_what_they_are(bad_paths, tiny):
    _, processor = tiny
    report = LoadReport()
    rows = [{"video": "adir", "text": "What moves?", "answer": "x"},
            {"video": ["red.png", "loop.png"], "text": "What moves?", "answer": "x"}]
    read_jsonl(write(bad_paths, [GOOD, *rows]), on_error="skip", report=report)
    assert "video file" in report.first_errors[0] and "is a directory, not a file" in report.first_errors[0]
    assert "frame 1: image file" in report.first_errors[1] and "is a symlink loop" in report.first_errors[1]
    encoder = Encoder(processor, ImageLimits(32 * 32, 1024 * 1024))  # infer / chat's /image
    for name, says in PATH_PROBLEMS[:3]:
        with pytest.raises(DataError, match=f"image file .*{name} {says}"):
            encoder.decode_image(bad_paths / name, "--image")
    with pytest.raises(DataError, match="video file .*adir is a directory"):  # infer's --video, chat's /video
        read_video_header(Path(bad_paths / "adir"), "--video")


def test_serve_says_a_local_image_path_is_a_directory_or_a_symlink_loop(bad_paths):
    pytest.importorskip("fastapi", reason="the serve extra: pip install 'vlforge[serve]'")
    from vlforge.serve.config import ServeConfig
    from vlforge.serve.images import ImageLoader
    from vlforge.serve.schema import APIError

    loader = ImageLoader(ServeConfig(allow_files=str(bad_paths)))
    assert loader.load("red.png", "image").size == (64, 64)
    for name, says in (("adir", "is a directory, not a file"), ("loop.png", "is a symlink that leads to no file"),
                       (str(bad_paths / "loop.png"), "a symlink loop")):
        with pytest.raises(APIError) as err:
            loader.load(name, "messages.0.content.0.image_url")
        assert err.value.status == 400 and says in err.value.message and "not found" not in err.value.message
