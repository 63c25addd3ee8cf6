"""Reward functions: builtins, user-file loading, weighted combination, error reporting."""

import pytest

from vlforge.rl.rewards import (
    BUILTIN_REWARDS,
    CombinedReward,
    RewardError,
    RewardSpec,
    choice,
    exact_match,
    format_reward,
    load_reward,
    numeric,
)


def test_exact_match():
    assert exact_match("  Paris. ", "paris") == 1.0
    assert exact_match("The   Eiffel\nTower!", "the eiffel tower") == 1.0
    assert exact_match("<think>hmm, maybe Rome</think><answer> Paris </answer>", "Paris") == 1.0
    assert exact_match("Paris is the answer", "Paris") == 0.0
    assert exact_match("<answer>Rome</answer>", "Paris") == 0.0
    assert exact_match("", "Paris") == 0.0


@pytest.mark.parametrize(
    "completion, answer, want",
    [
        ("B", "B", 1.0),
        ("b", "B", 1.0),
        ("(C)", "C", 1.0),
        ("C. Paris", "(C)", 1.0),
        ("I think the answer: D because of x", "D", 1.0),
        ("The answer is (a)", "A", 1.0),
        ("<answer>E</answer>", "E. fifty", 1.0),
        ("Looking at option (B) and then (C)", "B", 1.0),
        ("The answer is a bit unclear, but C.", "C", 1.0),
        ("B", "C", 0.0),
        ("The answer: A", "B", 0.0),
        ("no letter here", "A", 0.0),
        ("F", "A", 0.0),
    ],
)
def test_choice(completion, answer, want):
    assert choice(completion, answer) == want


def test_choice_bad_reference_raises():
    with pytest.raises(ValueError, match="no choice letter"):
        choice("A", "42")


def test_numeric():
    assert numeric("so x = 3, and the total is 42", "42") == 1.0
    assert numeric("The result is -0.5.", "-0.5") == 1.0
    assert numeric("about 1,234.5 dollars", "1234.5") == 1.0
    assert numeric("<answer>7</answer> (checked with 9 steps)", "7") == 1.0
    assert numeric("2e-3", "0.002") == 1.0
    assert numeric("42.0000001", "42") == 1.0  # within rel+abs 1e-6
    assert numeric("42.01", "42") == 0.0
    assert numeric("no numbers", "42") == 0.0
    assert numeric("42 then 43", "42") == 0.0  # last number counts
    assert numeric("42.01", "42", tol=0.1) == 1.0
    assert load_reward("numeric", tol=0.1)("42.01", "42") == 1.0
    with pytest.raises(ValueError, match="not a number"):
        numeric("1", "one")


def test_format():
    good = "<think>\nstep 1\nstep 2\n</think>\n<answer>42</answer>\n"
    assert format_reward(good, "") == 1.0
    assert format_reward("<answer>42</answer>", "") == 0.0
    assert format_reward(good + " trailing text", "") == 0.0
    assert format_reward("<think>a</think>", "") == 0.0
    assert format_reward("[[42]]", "", pattern=r"^\[\[.*\]\]$") == 1.0
    assert load_reward("format", pattern=r"^\[\[.*\]\]$")("[[x]]", "") == 1.0
    assert set(BUILTIN_REWARDS) == {"exact_match", "choice", "numeric", "format"}


def test_load_user_reward_from_file(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def length_penalty(completion, answer, max_len=10, **kwargs):\n"
        "    return -max(0, len(completion) - max_len) / max_len\n"
        "def uses_field(completion, answer, difficulty=1, **kwargs):\n"
        "    return float(difficulty)\n"
        "NOT_A_FN = 3\n"
    )
    fn = load_reward(f"{f}:length_penalty")
    assert fn("x" * 15, "") == -0.5
    assert load_reward(f"{f}:length_penalty", max_len=5)("x" * 15, "") == -2.0
    combined = CombinedReward([RewardSpec(f"{f}:uses_field")])
    assert combined(["a", "b"], ["", ""], [{"difficulty": 3}, {"difficulty": 0.5}]).total == [3.0, 0.5]


def test_load_reward_errors(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def ok(c, a, **kw):\n    return 1.0\nNOT_A_FN = 3\n")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_reward(f"{tmp_path}/missing.py:fn")
    with pytest.raises(AttributeError, match=r"no function 'nope'.*ok"):
        load_reward(f"{f}:nope")
    with pytest.raises(TypeError, match="NOT_A_FN.*not callable"):
        load_reward(f"{f}:NOT_A_FN")
    with pytest.raises(ValueError, match="exact_match.*path/to/file.py:function_name"):
        load_reward("exactmatch")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ImportError, match="boom") as ei:
        load_reward(f"{bad}:fn")
    assert isinstance(ei.value.__cause__, RuntimeError)


def test_combined_weighted_sum():
    combined = CombinedReward(
        [
            RewardSpec("exact_match", weight=1.0),
            RewardSpec("format", weight=0.5),
            RewardSpec("numeric", 2.0, {"tol": 0.1}),
        ]
    )
    completions = ["<think>x</think><answer>4</answer>", "4.05", "<answer>5</answer>"]
    res = combined(completions, ["4", "4", "4"])
    assert res.per_fn == {"exact_match": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0], "numeric": [1.0, 1.0, 0.0]}
    assert res.total == [1.0 + 0.5 + 2.0, 2.0, 0.0]
    dup = CombinedReward(["format", RewardSpec("format", kwargs={"pattern": "^x"})])
    assert dup(["x"], [""]).per_fn == {"format": [0.0], "format#2": [1.0]}
    with pytest.raises(ValueError, match="lengths differ"):
        combined(["a"], ["a", "b"])


def test_fields_named_completion_or_answer_are_not_forwarded(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def echo(completion, answer, **kw):\n    return float(len(kw))\n")
    res = CombinedReward([f"{f}:echo"])(["c"], ["a"], [{"answer": "dup", "completion": "dup", "img": 1}])
    assert res.total == [1.0]


@pytest.mark.parametrize("bad_return", ["'abc'", "None", "float('nan')", "float('inf')"])
def test_bad_return_raises_reward_error(tmp_path, bad_return):
    f = tmp_path / "bad.py"
    f.write_text(f"def flaky(completion, answer, **kw):\n    return 1.0 if completion == 'ok' else {bad_return}\n")
    combined = CombinedReward(["exact_match", f"{f}:flaky"])
    with pytest.raises(RewardError) as ei:
        combined(["ok", "ok", "second " * 30], ["ok", "ok", "ans"])
    msg = str(ei.value)
    assert f"{f}:flaky" in msg and "sample 2" in msg
    assert repr(("second " * 30)[:80]) in msg and "'ans'" in msg
    assert ei.value.__cause__ is not None


def test_raising_function_raises_reward_error(tmp_path):
    f = tmp_path / "boom.py"
    f.write_text("def boom(completion, answer, **kw):\n    raise KeyError('needs image')\n")
    with pytest.raises(RewardError, match=r"boom.*sample 0.*needs image") as ei:
        CombinedReward([f"{f}:boom"])(["x"], ["y"])
    assert isinstance(ei.value.__cause__, KeyError)


def test_number_like_returns_accepted(tmp_path):
    f = tmp_path / "types.py"
    f.write_text(
        "import numpy as np\n"
        "def b(c, a, **kw): return True\n"
        "def i(c, a, **kw): return 3\n"
        "def n(c, a, **kw): return np.float32(0.5)\n"
    )
    res = CombinedReward([f"{f}:b", f"{f}:i", f"{f}:n"])(["x"], ["y"])
    assert res.total == [4.5] and all(type(v[0]) is float for v in res.per_fn.values())
