"""The sample logs of a run (train/samples.py): GRPO groups with a tool that returns images, eval
answers of SFT and GRPO, bounded, resume-safe. Real runs of the tiny model, read back from disk."""

import json
import shutil

import pytest
from helpers import tiny_sft_config
from PIL import Image
from test_tools import IMAGE_TOOL, grpo_by_hand, tool_data, tool_model  # noqa: F401 (fixtures)

from vlforge.config import GRPOConfig, load_config
from vlforge.train.metrics import read_metrics
from vlforge.train.samples import THUMB_SIDE, read_samples
from vlforge.rl.rewards import exact_match

VARIED = "def varied(completion, answer, **row):\n    return float(len(completion) % 3)\n"


def shapes_grpo(shapes_dir, out, tmp_path, *overrides) -> GRPOConfig:
    (tmp_path / "rewards.py").write_text(VARIED)
    return load_config(GRPOConfig, None, [
        "model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}", f"data.val={shapes_dir / 'val.jsonl'}",
        "precision.mode=fp32", "train.device=cpu", f"train.output_dir={out}", "train.max_steps=4", "log.progress=false",
        "rollout.group_size=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=5", "rl.mini_batch_size=4",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:varied'}}, {{name: exact_match}}]", "eval.every=2",
        "eval.max_samples=3", "eval.max_new_tokens=3", "train.save_every=2", "log.samples_per_step=1", *overrides])


@pytest.mark.slow  # the tool model is taught to call first (~30 s), then two GRPO steps with tools
def test_grpo_samples_with_a_tool_that_returns_images(tool_model, tool_data, tmp_path):  # noqa: F811 (fixtures)
    """Every group of each step (samples_per_step >= prompts_per_step): the rewards' means are the
    metrics' (total, per function, accuracy), the advantages are GRPO's of those rewards, and each tool
    turn's image is the picture the tool drew for that turn's result; eval rows are the probes' answers."""
    from vlforge.demo import packaged_config
    from vlforge.recipes.grpo import run_grpo

    (tmp_path / "t.py").write_text(IMAGE_TOOL)
    (tmp_path / "rewards.py").write_text("def parity(completion, answer, **row):\n    return float(len(completion) % 2)\n")
    out = tmp_path / "run"
    run_grpo(load_config(GRPOConfig, packaged_config("demo-tools-grpo.yaml"), [
        f"model.path={tool_model}", f"data.train={tool_data['prompts']}", "log.progress=false",
        "rollout.group_size=4", "rollout.prompts_per_step=2", "rl.mini_batch_size=8", "rl.dynamic_sampling=false",
        f"tools.names=['{tmp_path / 't.py'}:calculator']", f"train.output_dir={out}", "train.max_steps=2",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:parity'}}, {{name: exact_match}}]", "log.samples_per_step=2",
        f"data.val={tool_data['prompts']}", "eval.max_samples=2", "eval.every=2"]))
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    groups = read_samples(out, "grpo")
    assert [g["step"] for g in groups] == [1, 1, 2, 2]
    pictures = 0
    for row in rows:
        responses = [r for g in groups if g["step"] == row["step"] for r in g["responses"]]
        assert len(responses) == 8
        mean = lambda xs: sum(xs) / len(xs)
        assert mean([r["reward"] for r in responses]) == pytest.approx(row["reward_mean"], abs=1e-6)
        assert mean([r["rewards"]["exact_match"] for r in responses]) == pytest.approx(row["reward/exact_match"])
        assert mean([r["correct"] for r in responses]) == pytest.approx(row["accuracy"])
        assert [r["advantage"] for r in responses] == pytest.approx(grpo_by_hand([r["reward"] for r in responses], 4),
                                                                    abs=1e-5)
        assert mean([r["length"] for r in responses]) == pytest.approx(row["response_length_mean"], abs=1e-4)
        assert mean([r["truncated"] for r in responses]) == pytest.approx(row["truncated_frac"])
        for r in responses:
            assert r["turns"][-1] == {"role": "assistant", "content": r["text"]}
            for turn in r["turns"]:
                if turn["role"] == "tool" and turn["ok"]:
                    [name] = turn["images"]  # the picture the tool drew: its colour says the result's length
                    with Image.open(out / "samples" / name) as im:
                        shade = 40 * (len(turn["content"]) % 6)
                        assert im.convert("RGB").getpixel((0, 0)) == (shade, 255 - shade, 90)
                        assert max(im.size) <= THUMB_SIDE
                    pictures += 1
    assert pictures > 0
    for g in groups:  # the prompt's own images, as thumbnails that decode
        for name in g["images"]:
            with Image.open(out / "samples" / name) as im:
                im.verify()
    # the evaluation's answers (as conversations with the tools): the eval.json examples, scored
    probes = read_samples(out, "eval")
    examples = json.loads((out / "eval.json").read_text())["examples"]
    assert [p["answer"] for p in probes] == [e["generated"] for e in examples]
    assert [p["reference"] for p in probes] == [e["answer"] for e in examples]
    assert [p["correct"] for p in probes] == [bool(exact_match(p["answer"], p["reference"])) for p in probes]


def test_sft_eval_samples_and_the_switch(shapes_dir, tmp_path):
    """SFT's evaluation writes each probe (image, question, answer, reference, match) at each eval step;
    their accuracy is the metrics'. log.samples_eval=0 writes none."""
    from vlforge.recipes.sft import run_sft

    out = tmp_path / "sft"
    run_sft(tiny_sft_config(shapes_dir, out, "eval.every=1", "log.samples_eval=3"))
    probes = read_samples(out, "eval")
    val = [json.loads(line) for line in (shapes_dir / "val.jsonl").read_text().splitlines()][:3]
    assert [(p["step"], p["probe"]) for p in probes] == [(s, i) for s in (1, 2) for i in range(3)]
    for p in probes:
        row = val[p["probe"]]
        assert (p["question"], p["reference"]) == (row["text"], row["answer"])
        with Image.open(shapes_dir / row["image"]) as src, \
                Image.open(out / "samples" / p["images"][0]) as thumb:
            assert thumb.size == src.size  # small images are kept at their size
            assert thumb.convert("RGB").tobytes() == src.convert("RGB").tobytes()
    examples = json.loads((out / "eval.json").read_text())["examples"]
    assert [p["answer"] for p in probes if p["step"] == 2] == [e["generated"] for e in examples][:3]
    run_sft(tiny_sft_config(shapes_dir, tmp_path / "off", "eval.every=1", "log.samples_eval=0"))
    assert read_samples(tmp_path / "off", "eval") == []
    # train.overwrite removes the run's samples/, and refuses a samples/ holding a file of the user's
    from vlforge.config import ConfigError
    from vlforge.train.runtime import prepare_output_dir, release_output_dir

    (out / "samples" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="also holds samples/"):
        prepare_output_dir(out, "never", overwrite=True)
    assert (out / "samples" / "notes.txt").read_text() == "mine"
    (out / "samples" / "notes.txt").unlink()
    prepare_output_dir(out, "never", overwrite=True)
    release_output_dir(out)
    assert not (out / "samples").exists()


def test_grpo_samples_resume_without_duplicates_and_stay_bounded(shapes_dir, tmp_path):
    """A run killed after logging steps past its last checkpoint (checkpoint-4 gone, a torn line):
    the resume redoes steps 3-4 and the logs hold each step once, steps 1-2 untouched. Then the
    folder's bound: past log.samples_max_mb no row is written."""
    from vlforge.recipes.grpo import run_grpo

    out = tmp_path / "run"
    run_grpo(shapes_grpo(shapes_dir, out, tmp_path))
    first = (out / "samples" / "grpo.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in first] == [1, 2, 3, 4]
    shutil.rmtree(out / "checkpoint-4")  # killed after logging step 4, before its save
    with open(out / "samples" / "grpo.jsonl", "a") as f:
        f.write('{"step": 5, "group": 0, "pro')  # torn mid-write
    run_grpo(shapes_grpo(shapes_dir, out, tmp_path, "train.resume=auto"))
    again = (out / "samples" / "grpo.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in again] == [1, 2, 3, 4] and again[:2] == first[:2]
    assert [(p["step"], p["probe"]) for p in read_samples(out, "eval")] == [(s, i) for s in (2, 4) for i in range(3)]
    # bounded: a limit below one step's rows keeps the folder at its images, with no rows
    small = tmp_path / "small"
    run_grpo(shapes_grpo(shapes_dir, small, tmp_path, "log.samples_max_mb=0.0005", "eval.every=0"))
    assert read_samples(small, "grpo") == []
    assert sum(f.stat().st_size for f in (small / "samples").rglob("*") if f.is_file()) <= 0.0005 * 2**20 + 4 * 2**10
