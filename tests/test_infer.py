"""The inference engine: batching, streaming, per-request limits, stop strings; infer/eval CLIs."""

import contextlib
import io
import json

import pytest
import torch
from PIL import Image

from vlforge.serve.engine import InferenceEngine, Request


@pytest.fixture(scope="module")
def engine():
    return InferenceEngine.load("tiny", device="cpu", dtype=torch.float32)


def _requests():
    red, blue = Image.new("RGB", (64, 64), (220, 20, 20)), Image.new("RGB", (48, 80), (20, 20, 220))
    ask = lambda text, n: {"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": text}]}
    return [Request([ask("what colour is it?", 1)], [red], max_new_tokens=8),
            Request([ask("hello there, a longer prompt to force left padding", 0)], [], max_new_tokens=5),
            Request([ask("compare", 2)], [red, blue], max_new_tokens=6)]


def test_batched_greedy_equals_one_at_a_time(engine):
    batched = engine.generate(_requests())
    alone = [engine.generate([r])[0] for r in _requests()]
    assert [c.text for c in batched] == [c.text for c in alone]
    for r, c in zip(_requests(), batched):
        assert c.completion_tokens <= r.max_new_tokens  # each stops at its own limit inside the batch
        assert c.prompt_tokens == engine.prompt_tokens(r)
        assert c.finish_reason in ("stop", "length")


def test_streamed_text_concatenates_to_the_answer(engine):
    pieces: dict[int, list[str]] = {}
    out = engine.generate(_requests(), on_text=lambda i, text: pieces.setdefault(i, []).append(text))
    for i, c in enumerate(out):
        assert "".join(pieces.get(i, [])) == c.text


def test_stop_strings_cut_the_answer(engine):
    whole = engine.generate([_requests()[0]])[0]
    full = whole.text
    assert len(full) >= 2
    r = _requests()[0]
    r.stop = [full[1:3]]
    pieces = []
    cut = engine.generate([r], on_text=lambda i, text: pieces.append(text))[0]
    assert cut.text == full[:full.index(full[1:3])] and cut.finish_reason == "stop"
    assert "".join(pieces) == cut.text  # the stop string's first characters were never streamed
    # the row stopped generating there: fewer tokens than the full answer (which ran to its limit)
    assert whole.finish_reason != "length" or cut.completion_tokens < whole.completion_tokens


def test_infer_and_eval_commands(shapes_dir, tmp_path):
    from vlforge.cli import main

    image = json.loads((shapes_dir / "val.jsonl").read_text().splitlines()[0])["image"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["infer", "tiny", "--device", "cpu", "--image", str(shapes_dir / image), "--prompt", "colour?",
                     "--max-new-tokens", "3"]) == 0
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["eval", "tiny", "--device", "cpu", "--data", str(shapes_dir / "val.jsonl"),
                     "--max-new-tokens", "3", "--out", str(tmp_path / "answers.json")]) == 0
    report = json.loads((tmp_path / "answers.json").read_text())
    assert report["n"] == 8 and len(report["answers"]) == 8 and 0.0 <= report["accuracy"] <= 1.0
    assert {a["task"] for a in report["answers"]} <= {"colour", "shape", "position", "count"}


def test_chat_keeps_history_and_images(engine, shapes_dir):
    image = shapes_dir / json.loads((shapes_dir / "val.jsonl").read_text().splitlines()[0])["image"]
    script = iter([f"/image {image}", "what colour?", "and the shape?", "/image /no/such.png", "/reset", "hi", "/quit"])
    said: list[str] = []
    seen_requests = []
    original = engine.generate

    def spy(requests, on_text=None):
        seen_requests.append((len(requests[0].messages), len(requests[0].images)))
        return original(requests, on_text)

    engine.generate = spy
    try:
        from vlforge.recipes.infer import chat

        chat(engine, read=lambda prompt: next(script), write=said.append, max_new_tokens=3)
    finally:
        engine.generate = original
    # 1st turn: one message + the attached image; 2nd: history of 3 messages, image kept; after /reset: fresh
    assert seen_requests == [(1, 1), (3, 1), (1, 0)]
    assert any("cannot open /no/such.png" in line for line in said)
    assert "(conversation cleared)" in said
