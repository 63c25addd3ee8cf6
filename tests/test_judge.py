"""Model-judged rewards: batched reward functions, score parsing, and a judge taught by SFT (the tiny
Qwen3-VL fine-tuned on CPU to answer yes or no to given prompts) scoring responses through its real
model path: in process, in a GRPO step, in `vlforge eval`, and served by `vlforge serve` over
loopback; the scores are checked against what it was taught. Judges that fail (unreadable images,
an endpoint that never answers, refuses or is busy, a batch out of time or memory) stop with an
error naming the judge and the sample, after bounded retries."""

import functools
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from vlforge.config import ConfigError
from vlforge.data.jsonl import read_jsonl
from vlforge.infer.model import InferenceModel
from vlforge.rl import RewardSpec, batched, build_rewards
from vlforge.rl.rewards import RewardError
from vlforge.rl import judge as judge_module
from vlforge.rl.judge import DEFAULT_PROMPT, JudgeError, ModelJudge, parse_score

# The judge is taught (judge_dir) two templates on the first four shapes samples: the default one,
# answered "yes" when the candidate is the sample's answer and "no" when it is WRONG, and TOPIC
# (no {completion}: what a GRPO step's random responses cannot change), answered "yes" for the
# colour questions (samples 0 and 2) and "no" for the others.
TOPIC = "Is this about colour, yes or no? {question}"
WRONG = "purple"
TOPIC_REPLIES = ["yes", "no", "yes", "no"]


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
    with pytest.raises(ConfigError, match="give model .* or endpoint"):
        ModelJudge.validate(score="number")
    with pytest.raises(ConfigError, match="endpoint '127.0.0.1:8000' is not an http"):
        ModelJudge.validate(endpoint="127.0.0.1:8000")
    with pytest.raises(ConfigError, match="quant is for a local model"):
        ModelJudge.validate(endpoint="http://127.0.0.1:8000/v1", quant="nf4")
    with pytest.raises(ConfigError, match=r"timeout_s must be > 0 \(got 0\)"):
        ModelJudge.validate(model="tiny", timeout_s=0)
    with pytest.raises(ConfigError, match=r"retries an integer >= 0 \(got -1\)"):
        ModelJudge.validate(model="tiny", retries=-1)
    ModelJudge.validate(endpoint="http://127.0.0.1:8000/v1", model="served-name")  # a name, not a directory
    with pytest.raises(ConfigError, match="unexpected keyword argument 'load'; valid keys: model, prompt"):
        ModelJudge.validate(model="tiny", load="os:system")  # the recipe's loader, never a reward kwarg
    with pytest.raises(JudgeError, match="judge model tiny: no model loader was given"):
        ModelJudge.from_kwargs(model="tiny", device="cpu")(["yes"], ["yes"], [{}], [[{"role": "user", "content": "q"}]])


# ------------------------------------------------------------------------------ the taught judge


@pytest.fixture(scope="module")
def shown(shapes_dir):
    """The four samples the judge was taught about."""
    return read_jsonl(shapes_dir / "train.jsonl")[:4]


@pytest.fixture(scope="module")
def judge_dir(shown, tmp_path_factory):
    """The tiny preset fine-tuned with vlforge's SFT recipe (full, CPU, 80 steps, ~1 min on 2 cores) on
    the judge prompts of `shown` (their images in front, as the judge asks): its checkpoint. Checked
    here on the real model path (greedy generation), independently of the judge's parsing."""
    from PIL import Image

    from vlforge.config import SFTConfig, load_config
    from vlforge.recipes.sft import run_sft
    from vlforge.infer.model import InferenceModel, Request

    out = tmp_path_factory.mktemp("judge")
    taught = []
    for i, s in enumerate(shown):
        fill = dict(question=s.prompt_messages[-1]["content"][-1]["text"], answer=s.answer)
        taught += [(s, DEFAULT_PROMPT.format(**fill, completion=s.answer), "yes"),
                   (s, DEFAULT_PROMPT.format(**fill, completion=WRONG), "no"),
                   (s, TOPIC.format(**fill), TOPIC_REPLIES[i])]
    rows = [{"image": str(s.images[0]), "text": text, "answer": reply} for s, text, reply in taught]
    (out / "judge.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_sft(load_config(SFTConfig, None, [
        "model.preset=tiny", f"data.train={out / 'judge.jsonl'}", "precision.mode=fp32", "train.device=cpu",
        f"train.output_dir={out / 'run'}", "train.batch_size=12", "train.max_steps=80", "log.progress=false",
        "tiers.method=full", "tiers.language.train=true", "tiers.language.lr=3e-3", "tiers.projector.train=true",
        "tiers.projector.lr=1e-3", "tiers.vision.train=false", "optim.schedule=cosine", "optim.warmup_steps=0",
        "optim.weight_decay=0.0", "optim.max_grad_norm=1.0", "eval.every=0", "eval.at_start=false"]))
    losses = [json.loads(line)["loss"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.05 * losses[0], losses
    engine = InferenceModel.load(str(out / "run" / "checkpoint-80"), device="cpu")
    asked = [Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                     [Image.open(s.images[0]).convert("RGB")], max_new_tokens=4) for s, text, _ in taught]
    assert [c.text for c in engine.generate(asked)] == [reply for _, _, reply in taught]
    return out / "run" / "checkpoint-80"


# which sample, and whether the candidate is its answer (else WRONG): the judge's taught reply is yes / no
CASES = [(0, True), (1, True), (2, False), (3, True), (1, False), (0, False), (3, False), (2, True)]
WANT = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]  # what it was taught to answer, as scores


def graded(shown):
    """(completions, answers, prompts) of CASES."""
    completions = [shown[i].answer if right else WRONG for i, right in CASES]
    return completions, [shown[i].answer for i, _ in CASES], [shown[i].prompt_messages for i, _ in CASES]


def test_the_judge_scores_what_its_model_answers_to_each_samples_images_and_response(judge_dir, shown):
    """Each response gets one request (its sample's images, the template filled in with its question,
    reference and response), answered greedily by the judge's model in batches: the scores are what
    the model was taught to answer (yes 1, no 0), in order; every reply parsed."""
    judge = ModelJudge.from_kwargs(load=InferenceModel.load, model=str(judge_dir), max_new_tokens=4, batch_size=3,
                                   device="cpu")
    completions, answers, prompts = graded(shown)
    requests = judge.requests(completions, answers, prompts)
    assert [len(r.images) for r in requests] == [1] * 8
    text = requests[2].messages[0]["content"][-1]["text"]
    assert f"Candidate answer: {WRONG}" in text and f"Reference answer: {shown[2].answer}" in text
    assert judge(completions, answers, [{}] * 8, prompts) == WANT
    assert judge.take_counts() == (0, 8) and judge.take_counts() == (0, 0)


def test_replies_that_give_no_score_score_0_and_are_counted(shown):
    """The untaught tiny preset (random weights) answers neither yes nor no to these prompts."""
    judge = ModelJudge.from_kwargs(load=InferenceModel.load, model="tiny", max_new_tokens=4, device="cpu")
    completions, answers, prompts = graded(shown)
    assert judge(completions[:3], answers[:3], [{}] * 3, prompts[:3]) == [0.0] * 3
    assert judge.take_counts() == (3, 3)


def topic_rows(shown, tmp_path) -> Path:
    """The taught samples as a dataset file (prompts and answers, their images)."""
    path = tmp_path / "taught.jsonl"
    path.write_text("".join(json.dumps({"image": str(s.images[0]), "text": s.prompt_messages[-1]["content"][-1]["text"],
                                        "answer": s.answer, "task": s.fields.get("task")}) + "\n" for s in shown))
    return path


def test_a_grpo_step_scored_by_a_judge_model(judge_dir, shown, shapes_dir, tmp_path):
    """A GRPO step over the four taught prompts (G = 4 responses each), rewarded by the judge with the
    TOPIC template: every response of prompts 0 and 2 scores 1 and of 1 and 3 scores 0, whatever it
    says, so the step's reward is exactly 0.5 and every group's rewards tie."""
    from test_grpo import grpo_config
    from vlforge.recipes.grpo import run_grpo

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "tiers.method=lora", "rl.mini_batch_size=8",
                      f"data.train={topic_rows(shown, tmp_path)}", "rollout.prompts_per_step=4")
    cfg.rl.rewards[0].name = "judge"
    cfg.rl.rewards[0].kwargs = {"model": str(judge_dir), "prompt": TOPIC, "max_new_tokens": 4}
    run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward_mean"] == row["reward/judge"] == 0.5
    assert row["reward/judge/unparsed_frac"] == 0.0 and row["zero_var_group_frac"] == 1.0


def test_eval_rewards_from_a_grpo_run_scores_with_its_judge(judge_dir, shown, tmp_path):
    """`vlforge eval --rewards-from` builds a run's judge reward as GRPO does (on eval's --device): each
    answer's judge score is what the judge was taught for its sample, times the reward's weight."""
    import contextlib
    import io

    from vlforge.cli import main

    (tmp_path / "grpo.yaml").write_text(
        "rl:\n  rewards:\n    - {name: judge, weight: 3.0, kwargs: {model: " + json.dumps(str(judge_dir))
        + ", prompt: " + json.dumps(TOPIC) + ", max_new_tokens: 4}}\n")
    out = tmp_path / "eval.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["eval", "tiny", "--device", "cpu", "--data", str(topic_rows(shown, tmp_path)),
                     "--max-new-tokens", "3", "--rewards-from", str(tmp_path / "grpo.yaml"), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["answers"]
    assert [r["rewards"]["judge"] for r in rows] == [1.0, 0.0, 1.0, 0.0]
    assert [r["reward"] for r in rows] == [3.0, 0.0, 3.0, 0.0]


# --------------------------------------------------------------------------- the judge over HTTP


@pytest.fixture(scope="module")
def served_judge(judge_dir):
    """`vlforge serve`'s app around the taught judge (uvicorn on a loopback port): its /v1 URL."""
    pytest.importorskip("uvicorn")
    from test_serve import LiveServer
    from vlforge.serve.app import create_app
    from vlforge.serve.config import ServeConfig
    from vlforge.infer.model import InferenceModel

    engine = InferenceModel.load(str(judge_dir), device="cpu")
    with LiveServer(create_app(engine, ServeConfig(max_tokens=64))) as server:
        yield server.url + "/v1"


class Relay:
    """A loopback HTTP server in front of `target` that answers the first `busy` requests 503 (an
    OpenAI-style error) and relays the others to it: counts what it was asked."""

    def __init__(self, target: str, busy: int = 0):
        self.asked = 0
        relay = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                import urllib.error
                import urllib.request

                relay.asked += 1
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if relay.asked <= busy:
                    status, reply = 503, json.dumps({"error": {"message": "busy, try again"}}).encode()
                else:
                    forward = urllib.request.Request(target + self.path.removeprefix("/v1"), body,
                                                     {"Content-Type": "application/json"})
                    try:
                        with urllib.request.urlopen(forward, timeout=60) as r:
                            status, reply = r.status, r.read()
                    except urllib.error.HTTPError as e:
                        status, reply = e.code, e.read()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class Silent:
    """A loopback TCP server that accepts every connection and never answers: counts them."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.held = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                self.held.append(self.sock.accept()[0])
            except OSError:
                return

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.sock.close()
        for conn in self.held:
            conn.close()


def test_a_judge_served_by_vlforge_serve_scores_what_it_answers(served_judge, shown):
    """endpoint: the same judge behind `vlforge serve` over loopback, the images sent inline: the
    scores are what it was taught, as in process."""
    judge = ModelJudge.from_kwargs(endpoint=served_judge, max_new_tokens=4, batch_size=3)
    completions, answers, prompts = graded(shown)
    assert judge(completions, answers, [{}] * 8, prompts) == WANT
    assert judge.take_counts() == (0, 8)


def test_a_busy_endpoint_is_asked_again_and_a_refusal_is_not(served_judge, shown, monkeypatch):
    """A 503 is retried (the reply then comes from the real judge); a 400 from the real server (its
    max_tokens limit) stops at once, naming the endpoint, the sample and the server's reason; a
    server busy for longer than `retries` allow stops after retries + 1 tries."""
    monkeypatch.setattr(judge_module, "RETRY_PAUSE_S", 0.01)
    completions, answers, prompts = graded(shown)
    with Relay(served_judge, busy=1) as relay:
        judge = ModelJudge.from_kwargs(endpoint=relay.url, max_new_tokens=4, batch_size=1, retries=1)
        assert judge(completions[:2], answers[:2], [{}] * 2, prompts[:2]) == WANT[:2]
        assert relay.asked == 3
    with Relay(served_judge) as relay:
        judge = ModelJudge.from_kwargs(endpoint=relay.url, max_new_tokens=65, retries=3)
        refused = (rf"judge endpoint {relay.url} refused sample 0 \(question 'What colour is the shape\?'\): "
                   r"HTTP 400: max_tokens=65 is above this server's limit")
        with pytest.raises(JudgeError, match=refused):
            judge(completions[:1], answers[:1], [{}], prompts[:1])
        assert relay.asked == 1
    with Relay(served_judge, busy=10) as relay:
        judge = ModelJudge.from_kwargs(endpoint=relay.url, max_new_tokens=4, retries=2)
        with pytest.raises(JudgeError, match=r"gave no reply for sample 0 .* in 3 tries \(last: HTTP 503: busy, try"):
            judge(completions[:1], answers[:1], [{}], prompts[:1])
        assert relay.asked == 3


def test_an_endpoint_that_never_answers_or_is_not_there_stops_the_step_after_its_retries(shown, monkeypatch):
    monkeypatch.setattr(judge_module, "RETRY_PAUSE_S", 0.01)
    completions, answers, prompts = graded(shown)
    with Silent() as silent:
        judge = ModelJudge.from_kwargs(endpoint=silent.url, timeout_s=0.5, retries=2)
        with pytest.raises(JudgeError, match=rf"judge endpoint {silent.url} gave no reply for sample 0 \(question "
                                             r"'What colour is the shape\?'\) in 3 tries \(last: no answer within "
                                             r"timeout_s=0.5 s\); check that the server runs"):
            judge(completions[:1], answers[:1], [{}], prompts[:1])
        assert len(silent.held) == 3
    with Silent() as gone:
        url = gone.url
    rewards = build_rewards([RewardSpec("judge", kwargs={"endpoint": url, "retries": 1})],
                            factories={"judge": functools.partial(ModelJudge.from_kwargs,
                                                                  load=InferenceModel.load)})
    with pytest.raises(RewardError, match=r"reward 'judge' failed on a batch of 1: JudgeError: judge endpoint "
                                          rf"{url} gave no reply for sample 0 .* in 2 tries \(last: ConnectionRefused"):
        rewards(completions[:1], answers[:1], [{}], prompts=prompts[:1])


def test_an_image_the_judge_cannot_read_is_an_error_naming_the_judge_and_the_sample(judge_dir, shown, tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png at all")
    completions, answers, prompts = graded(shown)
    missing = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "gone.png")},
                                            {"type": "text", "text": "What colour is the shape?"}]}]
    broken = [{"role": "user", "content": [{"type": "image", "image": str(tmp_path / "broken.png")},
                                           {"type": "text", "text": "What colour is the shape?"}]}]
    local = ModelJudge.from_kwargs(load=InferenceModel.load, model=str(judge_dir), max_new_tokens=4, device="cpu")
    remote = ModelJudge.from_kwargs(endpoint="http://127.0.0.1:9/v1", retries=0)  # fails before it asks
    for judge in (local, remote):
        with pytest.raises(JudgeError, match=rf"judge {judge.where}, sample 1: image file .*gone.png (is missing|not "
                                             "found).*fix or drop the row"):
            judge(completions[:2], answers[:2], [{}] * 2, [prompts[0], missing])
        with pytest.raises(JudgeError, match=rf"judge {judge.where}, sample 2: image .*broken.png cannot be decoded"):
            judge(completions[:3], answers[:3], [{}] * 3, [prompts[0], prompts[1], broken])


def test_a_local_judge_out_of_time_or_memory(judge_dir, shown, monkeypatch):
    """A batch past timeout_s is stopped at the engine's next sync point: an error naming the judge and
    the samples. A batch out of memory is split in halves while retries last (the replies still the
    model's); past them, an error naming the samples and what to lower. The out-of-memory is raised
    in front of the real engine for batches over 2 requests: a device whose memory holds two."""
    completions, answers, prompts = graded(shown)
    late = ModelJudge.from_kwargs(load=InferenceModel.load, model=str(judge_dir), max_new_tokens=4, device="cpu",
                                  timeout_s=1e-9)
    with pytest.raises(JudgeError, match=rf"judge model {judge_dir}: no reply within timeout_s=1e-09 s for samples "
                                         r"\[0, 1, 2\] \(a batch of 3, up to max_new_tokens=4 each\); raise timeout_s"):
        late(completions[:3], answers[:3], [{}] * 3, prompts[:3])
    judge = ModelJudge.from_kwargs(load=InferenceModel.load, model=str(judge_dir), max_new_tokens=4, device="cpu",
                                   batch_size=8, retries=2)
    real, sizes = judge.vlm.generate, []

    def small_device(requests, *args, **kwargs):
        sizes.append(len(requests))
        if len(requests) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(requests, *args, **kwargs)

    monkeypatch.setattr(judge.vlm, "generate", small_device)
    assert judge(completions, answers, [{}] * 8, prompts) == WANT
    assert sizes == [8, 4, 2, 2, 4, 2, 2]
    judge.retries = 1
    with pytest.raises(JudgeError, match=rf"judge model {judge_dir}: out of memory answering samples 0..3 "
                                         r"\(CUDA out of memory.*\); lower the judge's batch_size"):
        judge(completions, answers, [{}] * 8, prompts)
