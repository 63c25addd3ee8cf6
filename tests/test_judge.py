"""Model-judged rewards: batched reward functions, the judge's prompts and score parsing on the
real tiny Qwen3-VL through InferenceEngine, and a GRPO step scored by it."""

import json

import pytest

from vlforge.config import ConfigError
from vlforge.rl import RewardSpec, batched, build_rewards
from vlforge.rl.rewards import RewardError
from vlforge.serve.judge import DEFAULT_PROMPT, ModelJudge, parse_score


def test_a_batched_reward_is_called_once_a_batch_with_the_prompts(tmp_path):
    calls = []

    @batched
    def length_vs_question(completions, answers, fields, prompts):
        calls.append(len(completions))
        return [len(c) / (1 + len(p[-1]["content"])) for c, p in zip(completions, prompts)]

    rewards = build_rewards([RewardSpec("judge", 2.0), RewardSpec("exact_match")],
                            factories={"judge": lambda: length_vs_question})
    prompts = [[{"role": "user", "content": "abc"}], [{"role": "user", "content": "a"}]]
    result = rewards(["red", "blue"], ["red", "red"], [{}, {}], prompts=prompts)
    assert calls == [2]
    assert result.per_fn["judge"] == [0.75, 2.0] and result.total == [2.5, 4.0]


def test_a_batched_reward_that_fails_is_a_reward_error_naming_it():
    @batched
    def short(completions, answers, fields, prompts):
        return [1.0]

    @batched
    def nan(completions, answers, fields, prompts):
        return [1.0, float("nan")]

    with pytest.raises(RewardError, match="'judge' returned 1 scores for 2 samples"):
        build_rewards(["judge"], factories={"judge": lambda: short})(["a", "b"], ["a", "b"])
    with pytest.raises(RewardError, match="'judge' on sample 1"):
        build_rewards(["judge"], factories={"judge": lambda: nan})(["a", "b"], ["a", "b"])


@pytest.mark.parametrize("reply,score,expected", [
    ("Yes.", "yes_no", 1.0), ("no, it is blue", "yes_no", 0.0), ("  YES", "yes_no", 1.0), ("maybe", "yes_no", None),
    ("", "yes_no", None), ("8/10", "number", 0.8), ("Score: 12", "number", 1.0), ("-3", "number", 0.0),
    ("none", "number", None)])
def test_parse_score(reply, score, expected):
    assert parse_score(reply, score, scale=10) == expected


def test_bad_judge_settings_fail_before_loading(tmp_path):
    with pytest.raises(ConfigError, match="is not a directory"):
        ModelJudge.validate(model=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="is not a directory"):  # a random-weight preset is no judge
        ModelJudge.validate(model="qwen3vl-8b")
    with pytest.raises(ConfigError, match="a placeholder other than"):
        ModelJudge.validate(model="tiny", prompt="Grade {response}")
    with pytest.raises(ConfigError, match="score 'stars'"):
        ModelJudge.validate(model="tiny", score="stars")
    with pytest.raises(ConfigError, match="unexpected keyword argument 'max_tokens'.*valid keys: model, prompt"):
        ModelJudge.validate(model="tiny", max_tokens=3)
    with pytest.raises(ConfigError, match="--quant nf5"):
        ModelJudge.validate(model="tiny", quant="nf5")
    with pytest.raises(ConfigError, match="missing a required argument: 'model'"):
        ModelJudge.validate(score="number")


def test_the_judge_asks_its_model_with_the_samples_images_and_parses_its_greedy_replies(shapes_dir):
    """Each response gets one request (the sample's images, the template filled in); the scores are
    what the model's greedy replies to exactly those requests parse to (replies with no score: 0,
    counted)."""
    from vlforge.data.jsonl import read_jsonl

    samples = read_jsonl(shapes_dir / "train.jsonl")[:3]
    judge = ModelJudge.from_kwargs(model="tiny", score="number", max_new_tokens=4, batch_size=2, device="cpu")
    completions, answers = ["red", "a blue circle", "3"], [s.answer for s in samples]
    prompts = [s.prompt_messages for s in samples]
    requests = judge.requests(completions, answers, prompts)
    assert [len(r.images) for r in requests] == [len(s.images) for s in samples]
    text = requests[1].messages[0]["content"][-1]["text"]
    assert "Candidate answer: a blue circle" in text and f"Reference answer: {answers[1]}" in text
    replies = [c.text for c in judge.engine.generate(requests)]
    scores = judge(completions, answers, [{}] * 3, prompts)
    parsed = [parse_score(r, "number") for r in replies]
    assert scores == [0.0 if p is None else p for p in parsed]
    assert judge.take_counts() == (sum(p is None for p in parsed), 3) and judge.take_counts() == (0, 0)
    assert "{question}" in DEFAULT_PROMPT


def test_a_grpo_step_scored_by_a_judge_model(shapes_dir, tmp_path):
    from test_grpo import grpo_config
    from vlforge.recipes.grpo import run_grpo

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "tiers.method=lora", "rl.mini_batch_size=8")
    cfg.rl.rewards[0].name, cfg.rl.rewards[0].kwargs = "judge", {"model": "tiny", "max_new_tokens": 3}
    run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_mean"] == pytest.approx(row["reward/judge"])  # the judge's scores are the step's rewards
    assert 0.0 <= row["reward/judge/unparsed_frac"] <= 1.0


def test_eval_rewards_from_a_grpo_run_scores_with_its_judge(shapes_dir, tmp_path):
    """`vlforge eval --rewards-from` builds a run's judge reward as GRPO does (on eval's --device):
    each answer's judge score is what the judge gives that answer."""
    import contextlib
    import io

    from vlforge.cli import main
    from vlforge.data.jsonl import read_jsonl

    (tmp_path / "grpo.yaml").write_text(
        "rl:\n  rewards:\n    - {name: judge, weight: 3.0, kwargs: {model: tiny, score: number, max_new_tokens: 4}}\n")
    out = tmp_path / "eval.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["eval", "tiny", "--device", "cpu", "--data", str(shapes_dir / "val.jsonl"), "--max-samples", "3",
                     "--max-new-tokens", "3", "--rewards-from", str(tmp_path / "grpo.yaml"), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["answers"]
    judge = ModelJudge.from_kwargs(model="tiny", score="number", max_new_tokens=4, device="cpu")
    samples = read_jsonl(shapes_dir / "val.jsonl")[:3]
    want = judge([r["answer"] for r in rows], [s.answer for s in samples], [{}] * 3, [s.prompt_messages for s in samples])
    assert [r["rewards"]["judge"] for r in rows] == want
    assert [r["reward"] for r in rows] == [3.0 * w for w in want]
