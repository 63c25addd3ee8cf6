"""The inference engine: batching, streaming, per-request limits, stop strings; infer/eval CLIs."""

import contextlib
import io
import json

import pytest
import torch
from PIL import Image

from vlforge.infer.model import InferenceModel, Request


@pytest.fixture(scope="module")
def engine():
    return InferenceModel.load("tiny", device="cpu", dtype=torch.float32)


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
    assert out.getvalue().strip()
    eval_args = ["eval", "tiny", "--device", "cpu", "--max-new-tokens", "3"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*eval_args, "--data", str(shapes_dir / "val.jsonl"), "--out", str(tmp_path / "answers.json")]) == 0
    first = json.loads((tmp_path / "answers.json").read_text())
    assert first["n"] == 8 and len(first["answers"]) == 8
    assert {a["task"] for a in first["answers"]} <= {"colour", "shape", "position", "count"}
    # the same rows with every other reference replaced by the model's own (greedy, deterministic)
    # answer: exactly those rows are right, whatever the random model says
    rows = [json.loads(line) for line in (shapes_dir / "val.jsonl").read_text().splitlines()]
    for i, (row, a) in enumerate(zip(rows, first["answers"])):
        assert a["answer"], "the tiny model gave an empty answer; pick rows where it does not"
        if i % 2 == 0:
            row["answer"] = a["answer"]
        row["image"] = str(shapes_dir / row["image"])
    (tmp_path / "half.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*eval_args, "--data", str(tmp_path / "half.jsonl"), "--out", str(tmp_path / "half.json")]) == 0
    report = json.loads((tmp_path / "half.json").read_text())
    assert [a["correct"] for a in report["answers"]] == [i % 2 == 0 for i in range(8)]
    assert report["accuracy"] == 0.5
    by_task: dict[str, list[bool]] = {}
    for i, row in enumerate(rows):
        by_task.setdefault(row["task"], []).append(i % 2 == 0)
    assert report["by_task"] == {k: sum(v) / len(v) for k, v in sorted(by_task.items())}
    # --reward: each answer scored as GRPO scores a rollout (its text, the reference, the row's fields)
    (tmp_path / "rewards.py").write_text("def task_len(completion, answer, task, **row):\n"
                                         "    return float(len(task)) + (completion.strip() == answer)\n")
    scored = tmp_path / "scored.json"
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert main([*eval_args, "--data", str(tmp_path / "half.jsonl"), "--out", str(scored), "--reward",
                     "exact_match", "--reward", f"{tmp_path / 'rewards.py'}:task_len"]) == 0
    scored = json.loads(scored.read_text())
    key = f"{tmp_path / 'rewards.py'}:task_len"
    for i, (a, row) in enumerate(zip(scored["answers"], rows)):
        assert a["rewards"] == {"exact_match": float(i % 2 == 0), key: len(row["task"]) + float(i % 2 == 0)}
        assert a["reward"] == sum(a["rewards"].values())
    assert scored["rewards"]["exact_match"] == 0.5 and scored["reward_mean"] == pytest.approx(
        sum(a["reward"] for a in scored["answers"]) / 8)
    assert "exact_match 0.500" in said.getvalue()
    with contextlib.redirect_stderr(io.StringIO()) as err:  # refused before the model loads
        assert main([*eval_args, "--data", str(tmp_path / "half.jsonl"), "--reward", "nope"]) != 0
    assert "--reward: " in err.getvalue() and "nope" in err.getvalue()


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


def test_chat_says_an_unknown_command_is_unknown_instead_of_sending_it(engine):
    script = iter(["/imgae cat.png", "/help", "/image", "//usr holds programs?", "/quit"])
    said: list[str] = []
    sent = []
    original = engine.generate

    def spy(requests, on_text=None):
        sent.append(requests[0].messages[-1]["content"][-1]["text"])
        return original(requests, on_text)

    engine.generate = spy
    try:
        from vlforge.recipes.infer import CHAT_COMMANDS, chat

        chat(engine, read=lambda prompt: next(script), write=said.append, max_new_tokens=2)
    finally:
        engine.generate = original
    assert sent == ["/usr holds programs?"]  # only the escaped message reached the model, its // made /
    assert any(line.startswith("unknown command /imgae;") and CHAT_COMMANDS in line for line in said), said
    assert any(line.startswith("unknown command /help;") for line in said)
    assert "/image needs a file: /image PATH" in said


# ---------------------------------------------------------------------------------- image limits


MIN_PIXELS, MAX_PIXELS = 64 * 64, 128 * 128  # the saved processor's own (the tiny preset's: 32*32, 1024*1024)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny preset saved as a model directory (like a released model) whose preprocessor config
    upscales images below 64x64 pixels and downscales those above 128x128."""
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    model, processor = load_model(ModelConfig(preset="tiny"))
    tok = processor.tokenizer
    # as in Qwen's released generation_config: <|im_end|> and <|endoftext|> end generation
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]
    processor.image_processor.size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}
    out = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def _noise(size, seed=0) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy())


@pytest.mark.parametrize("size", [(300, 200), (20, 28)], ids=["large", "small"])
def test_greedy_answer_equals_transformers_generate(tiny_dir, tmp_path, size):
    """Same directory, same image: transformers' own processor + generate and the engine agree, so
    the engine resized the image as the model's preprocessor config says (not by fixed limits)."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    from vlforge.recipes.infer import answer, user_message

    image, prompt, n = _noise(size), "What is in the picture?", 10
    image.save(tmp_path / "image.png")
    processor = AutoProcessor.from_pretrained(str(tiny_dir), local_files_only=True)
    model = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    text = processor.apply_chat_template([user_message(prompt, 1)], tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    _, gh, gw = inputs["image_grid_thw"][0].tolist()
    resized = gh * gw * processor.image_processor.patch_size ** 2
    assert MIN_PIXELS <= resized <= MAX_PIXELS  # the premise: the image was resized to the dir's limits
    assert resized < size[0] * size[1] / 2 if size[0] > 100 else resized > size[0] * size[1] * 2
    # vlforge never generates the lm_head's rows past the tokenizer (generate.forward.never_generated: no text)
    padded = list(range(len(processor.tokenizer), model.lm_head.out_features))
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, suppress_tokens=padded)
    expected = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    engine = InferenceModel.load(str(tiny_dir), device="cpu", dtype=torch.float32)
    assert (engine.encoder.limits.min_pixels, engine.encoder.limits.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    request = Request([user_message(prompt, 1)], [image], max_new_tokens=n)
    assert engine.prompt_tokens(request) == inputs["input_ids"].shape[1]
    assert answer(engine, prompt, [str(tmp_path / "image.png")], max_new_tokens=n) == expected


def test_pixel_limits_overridden_for_tokens_and_pixels_alike(tiny_dir):
    from vlforge.config import ConfigError
    from vlforge.recipes.infer import user_message

    # a bound not given stays the directory's: one that ends up above the other is an error naming both
    with pytest.raises(ConfigError, match=r"min pixels 4096 \(the model's own.*max pixels 2304 \(--max-pixels\)"):
        InferenceModel.load(str(tiny_dir), device="cpu", dtype=torch.float32, max_pixels=48 * 48)
    with pytest.raises(ConfigError, match=r"\(--min-pixels\) is above max pixels 16384 \(the model's own"):
        InferenceModel.load(str(tiny_dir), device="cpu", dtype=torch.float32, min_pixels=200 * 200)
    engine = InferenceModel.load(str(tiny_dir), device="cpu", dtype=torch.float32, min_pixels=16 * 16,
                                  max_pixels=48 * 48)
    assert (engine.encoder.limits.min_pixels, engine.encoder.limits.max_pixels) == (16 * 16, 48 * 48)
    image = _noise((300, 200))
    request = Request([user_message("hi", 1)], [image])
    text = engine.processor.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
    inputs = engine.processor(text=[text], images=[image], return_tensors="pt")  # the processor itself
    assert engine.prompt_tokens(request) == inputs["input_ids"].shape[1]
    _, gh, gw = inputs["image_grid_thw"][0].tolist()
    assert gh * gw * 8 * 8 <= 48 * 48


@pytest.mark.parametrize("argv, message", [
    (["infer", "tiny", "--prompt", "x", "--max-new-tokens", "-1"], "must be >= 1"),
    (["infer", "tiny", "--prompt", "x", "--temperature", "-0.5"], "must be a finite number >= 0"),
    (["infer", "tiny", "--prompt", "x", "--min-pixels", "0"], "must be >= 1"),
    (["chat", "tiny", "--max-new-tokens", "0"], "must be >= 1"),
    (["eval", "tiny", "--data", "x.jsonl", "--batch-size", "0"], "must be >= 1"),
    (["eval", "tiny", "--data", "x.jsonl", "--max-new-tokens", "0"], "must be >= 1"),
    (["eval", "tiny", "--data", "x.jsonl", "--max-samples", "0"], "must be >= 1"),
    (["eval", "tiny", "--data", "x.jsonl", "--batch-size", "two"], "not a whole number"),
])
def test_bad_numbers_are_usage_errors(argv, message, capsys):
    from vlforge.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err


def test_min_above_max_pixels_is_a_clear_error(tiny_dir, capsys):
    from vlforge.cli import main

    assert main(["infer", str(tiny_dir), "--device", "cpu", "--prompt", "x", "--min-pixels", "5000",
                 "--max-pixels", "4000"]) == 2
    assert "error: --min-pixels 5000 is above --max-pixels 4000" in capsys.readouterr().err
    # one flag against the directory's own other bound (64*64 .. 128*128)
    assert main(["infer", str(tiny_dir), "--device", "cpu", "--prompt", "x", "--max-pixels", "1000"]) == 2
    assert ("error: min pixels 4096 (the model's own, from its preprocessor config) is above max pixels 1000 "
            "(--max-pixels)") in capsys.readouterr().err


def test_infer_says_when_the_model_produced_no_text(tiny_dir, tmp_path, capsys):
    """A model that ends its turn at once (here: its generation config allows no other first token,
    as a barely trained checkpoint often behaves) gets a hint on stderr, not just an empty line."""
    import shutil

    from vlforge.cli import main

    silent = tmp_path / "silent"
    shutil.copytree(tiny_dir, silent)
    config = json.loads((silent / "generation_config.json").read_text())
    end = config["eos_token_id"][0]
    vocab = json.loads((silent / "config.json").read_text())["text_config"]["vocab_size"]
    config["suppress_tokens"] = [t for t in range(vocab) if t != end]
    (silent / "generation_config.json").write_text(json.dumps(config))
    hint = "the model produced no text before its end-of-turn token"
    assert main(["infer", str(silent), "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out == "\n" and hint in out.err
    assert main(["infer", str(tiny_dir), "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and hint not in out.err  # a model that says something gets no hint


# ---------------------------------------------------------------------------------- cancellation


def test_cancelled_row_stops_at_the_next_token_and_the_batch_goes_on(engine):
    ask = {"role": "user", "content": [{"type": "text", "text": "tell me a long story"}]}
    other = {"role": "user", "content": [{"type": "text", "text": "and another one, a little longer"}]}
    n = 40
    alone = engine.generate([Request([other], max_new_tokens=n, min_new_tokens=n)])[0]
    requests = [Request([ask], max_new_tokens=n, min_new_tokens=n),
                Request([other], max_new_tokens=n, min_new_tokens=n)]
    seen = []

    def on_text(row, text):
        if row == 0:
            seen.append(text)
            if len(seen) == 2:
                requests[0].cancelled.set()  # what the server does when the client disconnects

    cancelled, done = engine.generate(requests, on_text=on_text)
    assert cancelled.finish_reason == "cancelled" and cancelled.completion_tokens < n // 4
    assert cancelled.text.startswith("".join(seen))
    assert done.text == alone.text and done.completion_tokens == n and done.finish_reason == "length"


def test_infer_sends_the_videos_frames_to_the_model(engine, tmp_path, monkeypatch):
    """`vlforge infer --video` (recipes/infer.answer): what generate/'s engine prefills holds the
    video as transformers' processor makes it of the decoded file (PyAV, sampled by its video
    processor): its tokens (as image tokens, one image per temporal patch: frames_as_images), its
    `<t seconds>` stamps and its frames' pixels, bit for bit."""
    import functools

    from transformers.video_utils import load_video

    from test_video import write_mp4
    from vlforge.recipes.infer import answer

    clip = write_mp4(tmp_path / "clip.mp4", 20, 8)
    gen, prompts = engine.gen_engine(), []
    prefill = gen._prefill

    def spy(admitted, *args):  # the prompts the engine prefills (its own method, on the instance)
        prompts.extend(r.prompt for _, r, _ in admitted)
        return prefill(admitted, *args)

    monkeypatch.setattr(gen, "_prefill", spy)
    answer(engine, "What happens?", [], video_paths=[str(clip)], max_new_tokens=2)
    [prompt] = prompts

    processor, encoder = engine.processor, engine.encoder
    vp = processor.video_processor
    frames, metadata = load_video(str(clip), backend="pyav",
                                  sample_indices_fn=functools.partial(vp.sample_frames, fps=vp.fps))
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "video"}, {
        "type": "text", "text": "What happens?"}]}], tokenize=False, add_generation_prompt=True)
    ref = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                    return_tensors="pt")
    [(t, h, w)] = ref["video_grid_thw"].tolist()
    assert t >= 2  # several temporal patches: several stamps
    assert prompt.image_grid_thw.tolist() == [[1, h, w]] * t
    assert torch.equal(prompt.pixel_values, ref["pixel_values_videos"])
    assert int((prompt.input_ids == encoder.image_token_id).sum()) == t * h * w // vp.merge_size ** 2
    ours = processor.tokenizer.decode(prompt.input_ids)
    stamps = [s.split(">")[0] for s in processor.tokenizer.decode(ref["input_ids"][0]).split("<")[1:]
              if s.split(">")[0].endswith(" seconds")]
    assert len(stamps) == t and all(f"<{s}>" in ours for s in stamps)
