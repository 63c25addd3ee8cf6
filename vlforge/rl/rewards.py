"""Reward functions for GRPO.

A reward function has the signature::

    def my_reward(completion: str, answer: str, **sample_fields) -> float

- ``completion``: the decoded model response (the generated text only, no prompt).
- ``answer``: the reference answer of the dataset row.
- ``**sample_fields``: every other field of the dataset row, as keyword arguments (so always
  accept ``**kwargs``; fields named ``completion`` / ``answer`` are not forwarded). With
  ``tools.names`` also ``transcript`` (the response's assistant turns and tool results as chat
  messages: rollout/multiturn.ToolRollout.transcripts), ``tool_calls`` and ``failed_tool_calls``.
- returns a finite number (int, float, bool or any ``numbers.Real``, e.g. numpy scalars);
  anything else, or an exception, becomes a :class:`RewardError` naming the function and sample.

Built-ins (``BUILTIN_REWARDS``): ``exact_match``, ``choice``, ``numeric``, ``format``.
Custom functions are loaded with ``load_reward("path/to/file.py:function_name")``; extra keyword
arguments are bound with ``functools.partial`` (e.g. ``load_reward("numeric", tol=1e-3)``).
:class:`CombinedReward` scores a batch with several weighted functions.

A batched reward (decorated with :func:`batched`, or any callable with ``batched = True``) scores
the whole batch in one call, ``fn(completions, answers, fields, prompts) -> list of numbers``:
``prompts[i]`` is sample i's prompt messages (chat messages; image parts carry the image path), so
a reward that runs a model (rl/judge.py's ModelJudge) can batch its work. Names the recipe
builds itself (``judge``) come in as ``factories``.
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from vlforge.plugins import load_callable

RewardFn = Callable[..., float]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
# Multiple-choice letter, tried in this order; the first match of the first pattern that matches wins.
_CHOICE_PATTERNS = [
    re.compile(r"(?i:answer)\s*(?:is\b)?\s*[:：]?\s*\(?([A-E])\b"),  # "answer: B", "Answer is (C)"
    re.compile(r"\(([A-Ea-e])\)"),  # "(B)", "(b)"
    re.compile(r"(?<![A-Za-z0-9])([A-E])[.):](?!\w)"),  # "B." "B)" "B:"
    re.compile(r"(?<![A-Za-z0-9])([A-E])(?![A-Za-z0-9])"),  # standalone capital "B"
]


class RewardError(RuntimeError):
    """A reward function raised or returned something that is not a finite number."""


def extract_answer_tag(text: str) -> str:
    """Inside of the last ``<answer>...</answer>`` in ``text``, or ``text`` itself if there is none."""
    found = _ANSWER_TAG.findall(text)
    return found[-1] if found else text


def normalize_text(text: str) -> str:
    """Strip, lower-case, collapse whitespace, drop trailing ``.``, ``!``, ``;``."""
    return " ".join(text.lower().split()).rstrip(".!;").rstrip()


def exact_match(completion: str, answer: str, **_: Any) -> float:
    """1.0 if the completion (or the inside of its ``<answer>`` tag) equals the answer after
    :func:`normalize_text`, else 0.0."""
    return float(normalize_text(extract_answer_tag(completion)) == normalize_text(answer))


def extract_choice(text: str) -> str | None:
    """First multiple-choice letter A-E in ``text`` (upper-case), or None.

    Looks inside ``<answer>`` if present; a text that is a single letter (any case) is that letter;
    otherwise ``answer: B`` / ``answer is B``, then ``(B)``, then ``B.`` / ``B)`` / ``B:``, then a
    standalone capital letter, each searched left to right.
    """
    text = extract_answer_tag(text).strip()
    if len(text) == 1 and text.upper() in "ABCDE":
        return text.upper()
    for pattern in _CHOICE_PATTERNS:
        m = pattern.search(text)
        if m:
            return m.group(1).upper()
    return None


def choice(completion: str, answer: str, **_: Any) -> float:
    """1.0 if the completion's first choice letter equals the answer's letter, else 0.0."""
    want = extract_choice(answer)
    if want is None:
        raise ValueError(f"reference answer {answer!r} holds no choice letter A-E")
    return float(extract_choice(completion) == want)


def extract_last_number(text: str) -> float | None:
    """Last number in ``text`` (``-3``, ``1,234.5``, ``.5``, ``2e-3``), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def numeric(completion: str, answer: str, tol: float = 1e-6, **_: Any) -> float:
    """1.0 if the last number of the completion (inside ``<answer>`` if present) is within
    ``tol`` of ``float(answer)``, relative and absolute (``math.isclose(rel_tol=tol, abs_tol=tol)``)."""
    try:
        want = float(str(answer).replace(",", "").strip())
    except ValueError as e:
        raise ValueError(f"reference answer {answer!r} is not a number") from e
    got = extract_last_number(extract_answer_tag(completion))
    return float(got is not None and math.isclose(got, want, rel_tol=tol, abs_tol=tol))


def format_reward(completion: str, answer: str = "", pattern: str = DEFAULT_FORMAT_PATTERN, **_: Any) -> float:
    """1.0 if the completion matches ``pattern`` (``re.match`` with DOTALL), else 0.0.
    Default: ``<think>...</think><answer>...</answer>`` and nothing else."""
    return float(re.match(pattern, completion, re.DOTALL) is not None)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "choice": choice,
    "numeric": numeric,
    "format": format_reward,
}


def load_reward(spec: str, **kwargs: Any) -> RewardFn:
    """Resolve a reward spec to a callable, binding ``kwargs`` with ``functools.partial``.

    ``spec`` is a builtin name (``BUILTIN_REWARDS``) or ``path/to/file.py:function_name``.
    """
    if spec in BUILTIN_REWARDS:
        fn = BUILTIN_REWARDS[spec]
    elif ":" in spec:
        fn = load_callable(spec, "reward", "fn(completion: str, answer: str, **fields) -> float")
    else:
        raise ValueError(
            f"unknown reward {spec!r}: use a builtin ({', '.join(BUILTIN_REWARDS)}) "
            "or 'path/to/file.py:function_name'"
        )
    return functools.partial(fn, **kwargs) if kwargs else fn


def batched(fn: Callable) -> Callable:
    """Mark ``fn(completions, answers, fields, prompts) -> list[float]`` as a batched reward."""
    fn.batched = True
    return fn


def is_batched(fn: Any) -> bool:
    """Whether a reward callable scores whole batches (also through functools.partial)."""
    return bool(getattr(fn, "batched", False) or getattr(getattr(fn, "func", None), "batched", False))


def _check_score(value: Any) -> float:
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {value!r} of type {type(value).__name__}, expected a number")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned non-finite {score}")
    return score


def score_sample(fn: RewardFn, name: str, index: int, completion: str, answer: str, fields: Mapping[str, Any]) -> float:
    """``fn(completion, answer, **fields)`` as a float; any failure becomes a chained RewardError."""
    extra = {k: v for k, v in fields.items() if k not in ("completion", "answer")}
    try:
        return _check_score(fn(completion, answer, **extra))
    except Exception as e:
        raise RewardError(
            f"reward {name!r} failed on sample {index} "
            f"(completion={completion[:80]!r}, answer={str(answer)[:80]!r}): {type(e).__name__}: {e}"
        ) from e


@dataclass
class RewardSpec:
    """One weighted reward: ``name`` is a builtin or ``path.py:function``; ``kwargs`` bound via partial."""

    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RewardResult:
    """Scores of one batch: ``per_fn[key][i]`` unweighted, ``total[i]`` = sum_k weight_k * per_fn[k][i]."""

    per_fn: dict[str, list[float]]
    total: list[float]


class CombinedReward:
    """Weighted sum of reward functions over a batch.

    ``specs``: RewardSpec objects or bare spec strings (weight 1). Keys of ``RewardResult.per_fn``
    are the spec names; a repeated name gets a ``#2``, ``#3`` ... suffix.
    """

    def __init__(self, specs: Sequence[RewardSpec | str],
                 factories: Mapping[str, Callable[..., RewardFn]] | None = None):
        if not specs:
            raise ValueError("CombinedReward needs at least one reward spec")
        self.specs = [RewardSpec(s) if isinstance(s, str) else s for s in specs]
        factories = factories or {}
        self.fns = [factories[s.name](**s.kwargs) if s.name in factories else load_reward(s.name, **s.kwargs)
                    for s in self.specs]
        self.keys: list[str] = []
        for s in self.specs:
            n = sum(1 for k in self.keys if k == s.name or k.startswith(s.name + "#"))
            self.keys.append(s.name if n == 0 else f"{s.name}#{n + 1}")

    def __call__(
        self,
        completions: Sequence[str],
        answers: Sequence[str],
        fields: Sequence[Mapping[str, Any]] | None = None,
        prompts: Sequence[list[dict]] | None = None,
    ) -> RewardResult:
        """Score sample i = (completions[i], answers[i], fields[i]) with every function; batched ones
        also get `prompts` (each sample's prompt messages; empty lists when not given)."""
        n = len(completions)
        fields = fields if fields is not None else [{}] * n
        prompts = prompts if prompts is not None else [[] for _ in range(n)]
        if not (n == len(answers) == len(fields) == len(prompts)):
            raise ValueError(f"completions, answers, fields, prompts lengths differ: {n}, {len(answers)}, "
                             f"{len(fields)}, {len(prompts)}")
        per_fn = {
            key: _score_batch(fn, key, completions, answers, fields, prompts) if is_batched(fn) else
            [score_sample(fn, key, i, c, a, f) for i, (c, a, f) in enumerate(zip(completions, answers, fields))]
            for key, fn in zip(self.keys, self.fns)
        }
        total = [
            sum(s.weight * per_fn[k][i] for s, k in zip(self.specs, self.keys)) for i in range(len(completions))
        ]
        return RewardResult(per_fn=per_fn, total=total)


def _score_batch(fn: RewardFn, name: str, completions: Sequence[str], answers: Sequence[str],
                 fields: Sequence[Mapping[str, Any]], prompts: Sequence[list[dict]]) -> list[float]:
    """A batched reward's scores, checked like score_sample's; any failure a RewardError naming it."""
    try:
        scores = list(fn(list(completions), list(answers), list(fields), list(prompts)))
    except Exception as e:
        raise RewardError(f"reward {name!r} failed on a batch of {len(completions)}: {type(e).__name__}: {e}") from e
    if len(scores) != len(completions):
        raise RewardError(f"reward {name!r} returned {len(scores)} scores for {len(completions)} samples")
    out = []
    for i, value in enumerate(scores):
        try:
            out.append(_check_score(value))
        except (TypeError, ValueError) as e:
            raise RewardError(f"reward {name!r} on sample {i} (completion={completions[i][:80]!r}): {e}") from e
    return out


def build_rewards(specs: Sequence[RewardSpec | str],
                  factories: Mapping[str, Callable[..., RewardFn]] | None = None) -> CombinedReward:
    """Shorthand for ``CombinedReward(specs, factories)``."""
    return CombinedReward(specs, factories)
