"""Multi-turn tool rollouts: tools/ (tools, calls, results; how calls run: test_tool_runs.py), tool
messages in the data and the chat template, rollout/multiturn on a tiny model taught the calculator
by SFT, GRPO with tools."""

import json

import pytest
import torch

from vlforge.generate.engine import Engine
from vlforge.config import ConfigError, DataConfig, GRPOConfig, RolloutConfig, SFTConfig, ToolsConfig, load_config
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.data.inline import DataError
from vlforge.data.jsonl import read_jsonl
from vlforge.data.synth import synth_tool_use
from vlforge.tools.builtin import calculator
from vlforge.tools.calls import ToolCall, ToolCallStream, parse_tool_calls, split_tool_calls
from vlforge.tools.registry import load_tools
from vlforge.tools.runner import ToolProcesses, run_tool_calls
from vlforge.rollout.logprobs import sequence_logprobs
from vlforge.rollout.multiturn import generate_with_tools, tool_image_encoder

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
# a calculator that answers with a picture too (48 + 16 x the prompt's images wide)
IMAGE_TOOL = '''
from PIL import Image


def calculator(expression: str, images: list) -> list:
    """Evaluate an arithmetic expression, and show it.

    Args:
        expression: The expression.
    """
    from vlforge.tools.builtin import calculator as real

    value = real(expression)
    shade = 40 * (len(value) % 6)  # the picture depends on the result
    picture = Image.new("RGB", (48 + 16 * len(images), 64), (shade, 255 - shade, 90))
    return [picture, value]
'''


def grpo_by_hand(rewards: list[float], G: int) -> list[float]:
    """GRPO's advantages written out: (r - group mean) / (unbiased group std + 1e-6); 0 where a group's
    rewards are all equal."""
    out = []
    for g in range(0, len(rewards), G):
        group = rewards[g:g + G]
        mean = sum(group) / G
        std = (sum((r - mean) ** 2 for r in group) / (G - 1)) ** 0.5
        out += [0.0 if std == 0 else (r - mean) / (std + 1e-6) for r in group]
    return out


def surrogate_at_ratio_one(advantages: list[float], mask: torch.Tensor) -> float:
    """PPO's token-mean clipped surrogate where every ratio is 1: -sum_i A_i n_i / sum_i n_i (n_i: sequence
    i's trained tokens)."""
    n = mask.float().sum(-1).tolist()
    return -sum(a * k for a, k in zip(advantages, n)) / sum(n)


def test_calculator_evaluates_arithmetic_and_nothing_else():
    assert calculator("(2 + 3) * 4") == "20"
    assert calculator("7 / 2") == "3.5" and calculator("6 / 3") == "2" and calculator("-2 ** 3") == "-8"
    assert calculator("1 / 3") == "0.333333333333"
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 1000", "[1, 2]", "1 +", "(-8) ** 0.5",
                "(((10 ** 64) ** 64) ** 64) ** 64"):  # the last would hold the GIL for seconds, then hours
        with pytest.raises(ValueError):
            calculator(bad)


def test_tool_calls_are_parsed_in_qwen_format_and_malformed_ones_say_why():
    text = "I will compute.\n" + CALL % "2+3" + "\n" + \
        '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}\n</tool_call>' + \
        "<tool_call>\n{not json}\n</tool_call><tool_call>\n[1]\n</tool_call><tool_call>\n{\"name\": \"x\""
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "2+3"}), ToolCall("calculator", {"expression": "4"})]
    assert "not valid JSON" in calls[2].error and "must be" in calls[3].error
    assert len(calls) == 4  # the unterminated block at the end is no call
    assert parse_tool_calls("no tools here") == []


@pytest.mark.parametrize("max_calls", [0, 1])
def test_a_streamed_reply_splits_into_the_content_and_calls_of_the_whole(max_calls):
    """ToolCallStream (serve's streaming with tools): fed a reply in pieces, split at every point and
    at random points, its events add up to split_tool_calls of the whole reply: the same content,
    stripped, and the same calls (the first only with max_calls 1); malformed and unclosed blocks and
    a held "<tool_c" at the end stay content; text goes out before the reply ends."""
    import random

    call = lambda name, args: f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'  # noqa: E731
    replies = [f"Let me compute.\n{call('calculator', {'expression': '2*3'})}",
               f"  {call('a', {})}\n\n{call('b', {'y': 1})}  tail <tool_c",
               "no calls < tool <tool_ <toolx>\n\n", f"<tool_call>bad json</tool_call> and {call('z', {})}",
               'unclosed <tool_call>{"name": ', "", "   ", f"a {call('q', {})} b\n{call('r', {})}\n c"]
    rng = random.Random(0)
    for reply in replies:
        content, calls = split_tool_calls(reply)
        calls = calls[:max_calls] if max_calls else calls
        splits = [list(range(len(reply) + 1))] + [sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, k)))
                                                  for k in range(1, 6) for _ in range(20)]
        for cuts in splits:
            stream = ToolCallStream(max_calls)
            pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
            assert "".join(v for k, v in events if k == "content") == content, (reply, pieces)
            assert [v for k, v in events if k == "call"] == calls, (reply, pieces)
    stream = ToolCallStream()
    assert stream.feed("Sure, ") == [("content", "Sure,")] and stream.feed("<tool") == []  # the space waits


def test_tools_load_from_builtins_and_files_with_their_schemas(tmp_path):
    (tmp_path / "mytools.py").write_text(
        "def lookup(city: str, metric: bool = True) -> str:\n"
        "    '''Weather of a city.\n\n    Args:\n        city: The city.\n        metric: Celsius if true.\n    '''\n"
        "    return city.upper()\n\n"
        "def undocumented(x):\n    return x\n")
    tools = load_tools(["calculator", f"{tmp_path / 'mytools.py'}:lookup"])
    assert list(tools) == ["calculator", "lookup"]
    fn = tools["lookup"].schema["function"]
    assert fn["parameters"]["required"] == ["city"] and fn["description"] == "Weather of a city."
    with pytest.raises(ValueError, match="undocumented.*type hint"):
        load_tools([f"{tmp_path / 'mytools.py'}:undocumented"])
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        load_tools(["nope"])
    with pytest.raises(ValueError, match="missing.py.*not found"):
        load_tools([f"{tmp_path / 'missing.py'}:f"])
    with pytest.raises(ValueError, match="second tool named 'calculator'"):
        load_tools(["calculator", "calculator"])


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory):
    """`vlforge data synth tools`: 32 conversations (SFT) and their prompts (GRPO), checked by `data check`."""
    from vlforge.cli import main

    out = tmp_path_factory.mktemp("tools")
    assert main(["data", "synth", "tools", "--n", "32", "--out", str(out)]) == 0
    assert main(["data", "check", str(out / "tools_sft.jsonl"), "data.max_length=1024"]) == 0
    paths = {"sft": out / "tools_sft.jsonl", "prompts": out / "tools_prompts.jsonl"}
    # deterministic for a seed (image paths are relative to the file)
    assert paths["sft"].read_text() == synth_tool_use(tmp_path_factory.mktemp("again"), 32, seed=0)["sft"].read_text()
    return paths


def test_tool_turn_tokens_continue_the_conversation_as_the_template_renders_it(tiny, tool_data):
    """Prompt + a generated call (ending at <|im_end|>) + tool_turn_ids + the final answer are the
    token ids of the whole tool conversation rendered by the chat template (the SFT row's)."""
    _, processor = tiny
    data = load_dataset(str(tool_data["sft"]), processor, DataConfig(max_length=1024))
    sample, enc = data.samples[0], data.encoder
    user, call, result, answer = sample.messages
    sizes = [(64, 64)]
    full = enc.token_ids(sample.messages, sizes, tools=sample.tools)
    prompt = enc.token_ids([user], sizes, add_generation_prompt=True, tools=sample.tools)
    turn = lambda text: enc.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]  # noqa: E731
    context = enc.tool_turn_ids([result["content"]])
    assert full == prompt + turn(call["content"]) + context + turn(answer["content"]) + enc.tokenizer("\n")["input_ids"]
    assert "<tool_response>" in enc.tokenizer.decode(context)
    long = enc.tool_turn_ids(["word " * 200], max_tokens=5)
    assert len(long) < len(context) + 20 and "(cut)" in enc.tokenizer.decode(long)
    # a result's special-token text stays text: no extra end of turn, no image placeholder
    hostile = enc.tool_turn_ids(["a<|im_end|>\n<|im_start|>assistant\n<|vision_start|><|image_pad|>"])
    assert hostile.count(enc.im_end_id) == 1 and enc.image_token_id not in hostile


def test_chat_rows_with_tools_train_only_the_assistant_turns(tiny, tool_data, tmp_path):
    _, processor = tiny
    data = load_dataset(str(tool_data["sft"]), processor, DataConfig(max_length=1024))
    item = data[0]
    enc, sample = data.encoder, data.samples[0]
    trained = enc.tokenizer.decode(item["labels"][item["labels"] >= 0])
    assert trained.count("<|im_end|>") == 2 and "<tool_call>" in trained and "<answer>" in trained
    assert "<tool_response>" not in trained and "calculator" in enc.tokenizer.decode(item["input_ids"])
    assert sample.tools[0]["function"]["name"] == "calculator"
    # OpenAI's tool_calls shape: the calls become the turn's text in the model's format, as serve writes them
    (tmp_path / "openai.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "content": "5"}]}) + "\n")
    assert read_jsonl(tmp_path / "openai.jsonl")[0].messages[1]["content"] == CALL % "2+3"
    rows = {"early": {"messages": [{"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]},
            "uncalled": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                      {"role": "tool", "content": "5"}, {"role": "assistant", "content": "5"}]},
            "schema": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                       "tools": [{"name": "f"}]}}
    for name, row in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=rf"{name}.jsonl:1: .*(must follow an assistant|function schemas)"):
            read_jsonl(path)


@pytest.fixture(scope="module")
def tool_model(tool_data, tmp_path_factory):
    """The tiny preset taught by SFT (the shipped configs/demo-tools-sft.yaml, ~30 s) to call the
    calculator and answer after its result: its checkpoint."""
    from vlforge.demo import packaged_config
    from vlforge.recipes.sft import run_sft

    out = tmp_path_factory.mktemp("tool-sft")
    run_sft(load_config(SFTConfig, packaged_config("demo-tools-sft.yaml"),
                        [f"data.train={tool_data['sft']}", f"train.output_dir={out}", "log.progress=false"]))
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.25 * losses[0]
    return out / "checkpoint-120"


def _rollout_setup(tool_model, prompts_path, n_prompts=3):
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    model, processor = load_model(ModelConfig(path=str(tool_model)), dtype=torch.float32, device="cpu")
    data = load_dataset(str(prompts_path), processor, DataConfig(max_length=1024))
    tools = load_tools(["calculator"])
    schemas = [t.schema for t in tools.values()]
    encoded = [encode_prompt(data.encoder, data.samples[i], tools=schemas) for i in range(n_prompts)]
    return model.eval(), data.encoder, tools, encoded


def test_multi_turn_rollout_runs_the_calls_and_the_trainer_scores_only_generated_tokens(tool_model, tool_data):
    model, enc, tools, encoded = _rollout_setup(tool_model, tool_data["prompts"])
    prompts = collate(encoded, enc.pad_id, left_pad=True)
    cfg = RolloutConfig(group_size=4, max_new_tokens=200, temperature=0.7)
    patches = []  # the vision tower's patch rows per call
    hook = model.model.visual.register_forward_pre_hook(lambda m, args: patches.append(args[0].shape[0]))
    try:
        out = generate_with_tools(Engine(model), enc, prompts, [1, 1, 1], cfg, tools, seed=11, settings=ToolsConfig())
    finally:
        hook.remove()
    r = out.rollout
    assert sum(c > 0 for c in out.calls) >= 8 and bool(r.finished.all())
    # each turn's prefill encodes a prompt's image once, however many of its samples continue (8 of 12
    # here: some prompt has several), as the first turn does for its G samples
    per_image = int(prompts["image_grid_thw"][0].prod())
    continuing = {n // 4 for n in range(12) if out.calls[n]}
    assert patches[0] == 3 * per_image and patches[1] == len(continuing) * per_image
    context_tokens = 0
    for n in range(12):
        real = r.response_ids[n][r.response_mask[n].bool()].tolist()
        generated = r.generated_mask[n][r.response_mask[n].bool()].tolist()
        if out.calls[n] == 0:
            assert all(generated) and out.turns[n] == 1
            assert out.transcripts[n] == [{"role": "assistant", "content": out.completions[n]}]
            continue
        # turn 1 (the call, generated) + the call's result as the template renders it (read) + turn 2
        first = generated.index(0)
        end = first + generated[first:].index(1)
        calls = parse_tool_calls(enc.tokenizer.decode(real[:first], skip_special_tokens=False))
        results = [res.text for res in run_tool_calls([calls], tools, 5.0)[0]]
        assert real[first:end] == enc.tool_turn_ids(results) and all(generated[end:]) and out.turns[n] == 2
        assert enc.tokenizer.decode(real[end:], skip_special_tokens=True) == out.completions[n]
        # the transcript: the calling turn, its results, the last turn
        assert out.transcripts[n] == [
            {"role": "assistant", "content": enc.tokenizer.decode(real[:first], skip_special_tokens=True)},
            *({"role": "tool", "name": c.name, "content": res, "ok": True} for c, res in zip(calls, results)),
            {"role": "assistant", "content": out.completions[n]}]
        assert bool((r.logprobs[n][first:end] == 0).all())
        context_tokens += end - first
    assert context_tokens > 0
    # the trainer's log-probs of the generated tokens are the rollout's, padded and packed; 0 at the tool results
    gen = r.generated_mask.bool()
    with torch.no_grad():
        for packing in (False, True):
            logp, _ = sequence_logprobs(model, r, cfg.temperature, packing=packing)
            torch.testing.assert_close(logp[gen], r.logprobs[gen], atol=1e-4, rtol=1e-4)
            assert bool((logp[r.response_mask.bool() & ~gen] == 0).all())
        # the tool results are read: another result changes the later turn's log-probs
        n = next(i for i in range(12) if out.calls[i])
        first = r.generated_mask[n].tolist().index(0)
        r.response_ids[n, first + 4] = enc.tokenizer("7", add_special_tokens=False)["input_ids"][0]
        r.__dict__.pop("host", None)  # the host copy is made once: drop it after the change
        changed, _ = sequence_logprobs(model, r, cfg.temperature)
        later = gen[n].clone()
        later[:first] = False
        assert not torch.allclose(changed[n][later], logp[n][later], atol=1e-4)


def test_multi_turn_rollout_samples_the_same_split_over_ranks(tool_model, tool_data):
    """Each sequence's noise is its global row's in every turn: prompts 0-1 as rows 0-7 and prompt 2
    as rows 8-11 (two ranks) sample what the three prompts do in one call."""
    model, enc, tools, encoded = _rollout_setup(tool_model, tool_data["prompts"])
    cfg = RolloutConfig(group_size=4, max_new_tokens=200, temperature=1.0)
    whole = generate_with_tools(Engine(model), enc, collate(encoded, enc.pad_id, left_pad=True), [1, 1, 1], cfg, tools,
                                seed=5, settings=ToolsConfig())
    parts = [generate_with_tools(Engine(model), enc, collate(encoded[a:b], enc.pad_id, left_pad=True), [1] * (b - a), cfg,
                                 tools, first_row=a * 4, seed=5, settings=ToolsConfig()) for a, b in ((0, 2), (2, 3))]
    seqs = lambda o: [ids[m.bool()].tolist() for ids, m in zip(o.rollout.response_ids, o.rollout.response_mask)]  # noqa: E731
    assert seqs(whole) == seqs(parts[0]) + seqs(parts[1])
    assert whole.calls == parts[0].calls + parts[1].calls and sum(whole.turns) > 12


def test_a_call_that_leaves_no_room_for_the_next_turn_ends_the_response_truncated(tool_model, tool_data):
    model, enc, tools, encoded = _rollout_setup(tool_model, tool_data["prompts"], 2)
    cfg = RolloutConfig(group_size=4, max_new_tokens=72, temperature=0.7)
    out = generate_with_tools(Engine(model), enc, collate(encoded, enc.pad_id, left_pad=True), [1, 1], cfg, tools, seed=11,
                              settings=ToolsConfig())
    r = out.rollout
    called = [n for n in range(8) if parse_tool_calls(enc.tokenizer.decode(r.response_ids[n][r.response_mask[n].bool()]))]
    assert called and r.response_mask.sum(1).max() <= 72
    for n in called:  # even an empty result (~30 tokens) would not fit after a ~60-token call: the call never runs
        assert out.calls[n] == 0 and not bool(r.finished[n]) and out.turns[n] == 1 and out.unshown[n]
        assert bool(r.generated_mask[n].eq(r.response_mask[n]).all())
    assert not any(out.unshown[n] for n in range(8) if n not in called)


def test_grpo_with_tools_scores_the_last_turn_and_logs_tool_use(tool_model, tool_data, tmp_path, monkeypatch):
    """The recipe with the shipped tools config: rewards see the last turn; the policy loss, the KL
    and the lengths are over the generated tokens only (spies on the real functions: the masks the
    update passes are the rollouts' generated masks, which leave the tool results out)."""
    from vlforge.recipes import grpo as recipe

    rollouts, losses = [], []
    real_rollout, real_loss = recipe.generate_with_tools, recipe.policy_loss
    monkeypatch.setattr(recipe, "generate_with_tools",
                        lambda *a, **k: rollouts.append(real_rollout(*a, **k)) or rollouts[-1])
    monkeypatch.setattr(recipe, "policy_loss",
                        lambda logp, old, adv, mask, *a, **k: losses.append(mask) or real_loss(logp, old, adv, mask, *a, **k))
    seen = tmp_path / "seen.jsonl"  # what the reward was given besides the completion
    (tmp_path / "rewards.py").write_text(
        "import json\n"
        "def last_turn(completion, answer, transcript, tool_calls, failed_tool_calls, **row):\n"
        "    assert '<tool_response>' not in completion and '<|im_start|>' not in completion, completion\n"
        f"    open({str(seen)!r}, 'a').write(json.dumps([completion, transcript, tool_calls, failed_tool_calls]) + '\\n')\n"
        "    return float(completion.strip().startswith('<answer>'))\n")
    from vlforge.recipes.grpo import run_grpo

    from vlforge.demo import packaged_config

    shipped = packaged_config("demo-tools-grpo.yaml")  # tools: [calculator], 160 tokens, group 8
    common = [f"model.path={tool_model}", f"data.train={tool_data['prompts']}", "log.progress=false",
              "rollout.group_size=4", "rollout.prompts_per_step=2", "rl.mini_batch_size=8",
              "rl.dynamic_sampling=false", f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:last_turn'}}]"]
    run_grpo(load_config(GRPOConfig, shipped, [*common, f"train.output_dir={tmp_path / 'run'}", "train.max_steps=2",
                                               "rl.kl_beta=0.05"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["tool/calls_mean"] > 0.5 and 1.5 < row["tool/turns_mean"] <= 2 and row["tool/failed_frac"] < 0.5
        assert 0 <= row["tool/unshown_frac"] <= row["truncated_frac"]
        assert row["reward_mean"] > 0
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and abs(rows[0]["approx_kl"]) < 1e-5
    # one mini-batch a step of one rollout round: the masks are the rounds' generated masks
    assert len(rollouts) == len(losses) == 2
    for row, multi in zip(rows, rollouts):  # each step's loss: the surrogate of its rewards, at ratio 1
        rewards = [float(c.strip().startswith("<answer>")) for c in multi.completions]
        want = surrogate_at_ratio_one(grpo_by_hand(rewards, 4), multi.rollout.generated_mask)
        assert row["loss"] == pytest.approx(want + 0.05 * row["kl"], abs=1e-4)
    for multi, mask in zip(rollouts, losses):
        r = multi.rollout
        assert torch.equal(mask, r.generated_mask.float()) and not torch.equal(mask, r.response_mask.float())
    assert rows[0]["response_length_mean"] == pytest.approx(float(rollouts[0].rollout.generated_mask.sum(1).float().mean()))
    # each reward call got its response's transcript and tool counts: the rollouts' own
    given = [json.loads(line) for line in seen.read_text().splitlines()]
    assert given == [[c, tr, k, f] for multi in rollouts for c, tr, k, f in
                     zip(multi.completions, multi.transcripts, multi.calls, multi.failed_calls)]
    assert any(any(m["role"] == "tool" for m in tr) for _, tr, _, _ in given)
    assert all(tr[-1] == {"role": "assistant", "content": c} for c, tr, _, _ in given)
    # the evaluation answers as conversations with the tools too: greedy, the last turn scored (here
    # with the calls in worker processes, tools.processes, which the rollouts use as well)
    out = run_grpo(load_config(GRPOConfig, shipped, [*common, f"train.output_dir={tmp_path / 'val'}",
                                                     "train.max_steps=1", f"data.val={tool_data['prompts']}",
                                                     "eval.max_samples=4", "eval.at_start=true",
                                                     "tools.processes=2"]))
    [step] = [row for line in (tmp_path / "val" / "metrics.jsonl").read_text().splitlines()
              for row in [json.loads(line)] if "tool/calls_mean" in row]
    assert step["tool/calls_mean"] > 0.5 and step["tool/failed_frac"] < 0.5
    examples = json.loads((tmp_path / "val" / "eval.json").read_text())["examples"]
    assert out["first_eval"]["n"] == 4 and len(examples) == 4
    assert all(e["generated"].startswith("<answer>") and "<tool" not in e["generated"] for e in examples), examples
    with pytest.raises(ConfigError, match="tools.names: unknown tool 'nope'"):
        run_grpo(load_config(GRPOConfig, shipped, [*common, f"train.output_dir={tmp_path / 'bad'}",
                                                   "tools.names=[nope]"]))
    assert not (tmp_path / "bad").exists()  # refused before the run claimed a directory


@pytest.mark.parametrize("extra,match", [("rollout.engine=hf", "'rollout.engine' was removed"),
                                         ("rollout.router_replay=record", "not recorded"),
                                         ("tools.turns=0", "tools.turns")])
def test_tool_settings_that_cannot_run_are_refused(extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config(GRPOConfig, None, ["tools.names=[calculator]", extra])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp2+images"])
def test_grpo_with_tools_on_two_ranks_equals_one_process(tool_model, tool_data, tmp_path, strategy):
    """Multi-turn tool rollouts under torchrun: the ranks run different numbers of turns (engine calls
    on the gathered model: no collectives inside), and the rollouts, rewards, tool use and the
    update (one mini-batch a step: every rank takes its share of it) are one process's; so is the
    evaluation with the tools (greedy conversations on held-out prompts). The 2 ranks run their
    calls in worker processes (tools.processes), the one process on threads. `+images`: the
    calculator answers with a picture too (each rank's sequences' pictures through the sharded tower)."""
    import os
    import subprocess
    import sys

    from vlforge.demo import packaged_config

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    (tmp_path / "reward.py").write_text("def varied(completion, answer, **row):\n    return float(len(completion) % 3)\n")
    args = [str(packaged_config("demo-tools-grpo.yaml")), f"model.path={tool_model}",
            f"rl.rewards=[{{name: '{tmp_path / 'reward.py'}:varied'}}]",
            f"data.train={tool_data['prompts']}", "log.progress=false", "rollout.group_size=4",
            "rollout.prompts_per_step=4", "rl.mini_batch_size=16", "rl.dynamic_sampling=false", "rl.kl_beta=0.05",
            "train.max_steps=2", "tiers.language.lr=1e-3", "optim.max_grad_norm=null",
            f"data.val={tool_data['prompts']}", "eval.max_samples=6"]
    strategy, images = strategy.split("+")[0], strategy.endswith("+images")
    if images:
        (tmp_path / "t.py").write_text(IMAGE_TOOL)
        args.append(f"tools.names=['{tmp_path / 't.py'}:calculator']")
    rows = {}
    for name, prefix in (("one", [sys.executable]), ("two", [sys.executable, "-m", "torch.distributed.run",
                                                              "--standalone", "--nproc_per_node=2"])):
        extra = [f"distributed.strategy={strategy}", "tools.processes=2"] if name == "two" else []
        result = subprocess.run([*prefix, "-m", "vlforge", "grpo", *args, *extra, f"train.output_dir={tmp_path / name}"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[name] = [row for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                      for row in [json.loads(line)] if "reward_mean" in row]  # the steps (not the eval's row)
    assert len(rows["one"]) == 2
    for one, two in zip(rows["one"], rows["two"], strict=True):
        for key in ("reward_mean", "tool/calls_mean", "tool/turns_mean", "tool/failed_frac", "tool/unshown_frac",
                    "truncated_frac"):
            assert two[key] == one[key], key
        for key in ("response_length_mean", "loss", "grad_norm", "kl", "entropy"):
            assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
    # tools used (a quarter of the responses or more: 6 of 16 with the image tool), the policy moved
    assert rows["one"][0]["tool/calls_mean"] >= 0.25 and rows["one"][1]["kl"] > 1e-6
    if images:  # a call that ran returned a picture
        assert any(row["tool/failed_frac"] < 1 for row in rows["one"])
    evals = {name: json.loads((tmp_path / name / "eval.json").read_text()) for name in rows}
    assert evals["two"]["examples"] == evals["one"]["examples"] and evals["two"]["n"] == evals["one"]["n"] == 6
    assert evals["two"]["accuracy"] == evals["one"]["accuracy"]


def test_eval_answers_as_conversations_with_the_tools(tool_model, tool_data, tmp_path):
    """`vlforge eval --tool calculator`: each prompt answered greedily as a conversation with the tools
    (GRPO's multi-turn rollout, one sample a prompt): the answers are the last turns, not the calls;
    each row says its tool use, and rewards get the transcript and counts as GRPO's do."""
    import contextlib
    import io

    from vlforge.cli import main
    from vlforge.rl.rewards import numeric

    (tmp_path / "r.py").write_text("def tool_msgs(completion, answer, transcript, tool_calls, **row):\n"
                                   "    return float(sum(m['role'] == 'tool' for m in transcript))\n")
    out = tmp_path / "eval.json"
    args = ["eval", str(tool_model), "--device", "cpu", "--data", str(tool_data["prompts"]), "--max-samples", "4",
            "--max-new-tokens", "160", "--batch-size", "4", "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert main([*args, "--tool", "calculator", "--reward", f"{tmp_path / 'r.py'}:tool_msgs",
                     "--tool-processes", "2"]) == 0
    report = json.loads(out.read_text())
    assert report["n"] == 4 and report["tool_calls_mean"] > 0.5 and "tool calls an answer" in said.getvalue()
    for row in report["answers"]:
        assert "<tool_call>" not in row["answer"] and row["turns"] == 1 + (row["tool_calls"] > 0)
        assert row["rewards"][f"{tmp_path / 'r.py'}:tool_msgs"] == row["tool_calls"]  # every result was read
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*args, "--tool", "nope"]) != 0
    assert "--tool: unknown tool 'nope'" in err.getvalue()

    # --rewards-from: a GRPO run's rewards (weights, kwargs) and tools, from its config or a checkpoint of it;
    # its rollout.max_new_tokens is the budget, as in the run's own evaluation
    run = tmp_path / "run"
    (run / "checkpoint-3").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "rl:\n  rewards:\n"
        f"    - {{name: '{tmp_path / 'r.py'}:tool_msgs', weight: 2.0}}\n"
        "    - {name: numeric, weight: 0.5, kwargs: {tol: 1.0e+9}}\n"
        "rollout: {max_new_tokens: 160}\ntools: {names: [calculator], processes: 2}\n")
    for source in (run / "config.yaml", run / "checkpoint-3"):
        weighted = tmp_path / "weighted.json"
        with contextlib.redirect_stdout(io.StringIO()):
            assert main([*args[:-1], str(weighted), "--rewards-from", str(source)]) == 0  # args[-1]: --out's file
        again = json.loads(weighted.read_text())
        assert [r["answer"] for r in again["answers"]] == [r["answer"] for r in report["answers"]]
        for row, before in zip(again["answers"], report["answers"]):
            assert row["rewards"][f"{tmp_path / 'r.py'}:tool_msgs"] == before["tool_calls"]
            assert row["rewards"]["numeric"] == numeric(row["answer"], row["reference"], tol=1e9)  # the kwargs
            assert row["reward"] == pytest.approx(2.0 * before["tool_calls"] + 0.5 * row["rewards"]["numeric"])
        assert any(row["rewards"]["numeric"] for row in again["answers"])  # any number is near enough
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*args, "--rewards-from", str(run / "config.yaml"), "--tool", "calculator"]) != 0
    assert "leave out --reward and --tool" in err.getvalue()
    (tmp_path / "sft.yaml").write_text("model: {preset: tiny}\n")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        assert main([*args, "--rewards-from", str(tmp_path / "sft.yaml")]) != 0
    assert "an SFT run, which has no rl.rewards" in err.getvalue()


def test_served_model_calls_tools_openai_style(tool_model, tool_data):
    """`vlforge serve` with tools (a real server on loopback, httpx): the reply's call comes back as
    OpenAI's tool_calls; sent back with the tool's result, the conversation is the tokens the model
    generated plus the chat template's tool turn, and the model answers."""
    import base64

    httpx = pytest.importorskip("httpx")
    from test_serve import LiveServer, sse_events

    from vlforge.serve.app import create_app
    from vlforge.serve.config import ServeConfig
    from vlforge.infer.model import InferenceModel

    engine = InferenceModel.load(str(tool_model), device="cpu", dtype=torch.float32)  # as it was trained
    row = json.loads(tool_data["prompts"].read_text().splitlines()[0])
    png = (tool_data["prompts"].parent / row["image"]).read_bytes()
    question = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": row["text"]}]}]
    tools = [t.schema for t in load_tools(["calculator"]).values()]
    ask = {"model": engine.name, "temperature": 0, "max_tokens": 120, "tools": tools}
    cfg = ServeConfig(max_prompt_tokens=2048, max_tokens=256)
    with LiveServer(create_app(engine, cfg)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        first = client.post("/v1/chat/completions", json={**ask, "messages": question}).json()
        choice = first["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "calculator" and call["id"].startswith("call_")
        expression = json.loads(call["function"]["arguments"])["expression"]
        # the prompt is the SFT conversation's (the tools listed by the chat template)
        data = load_dataset(str(tool_data["sft"]), engine.processor, DataConfig(max_length=1024))
        sample = data.samples[0]
        assert first["usage"]["prompt_tokens"] == len(data.encoder.token_ids(
            sample.messages[:1], [(64, 64)], add_generation_prompt=True, tools=sample.tools))
        # streamed: the same call, whole, with its index
        with client.stream("POST", "/v1/chat/completions", json={**ask, "messages": question, "stream": True}) as r:
            events = [e for e in sse_events(r) if e != "[DONE]"]
        streamed = [d["tool_calls"] for e in events for d in [e["choices"][0]["delta"]] if "tool_calls" in d]
        assert [[{k: c[k] for k in ("index", "type", "function")} for c in streamed[0]]] == \
            [[{"index": 0, "type": "function", "function": call["function"]}]]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the result sent back: the history is the generated tokens and the template's tool turn
        result = calculator(expression)
        second = client.post("/v1/chat/completions", json={**ask, "messages": [
            *question, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": result}]}).json()
        # (+ 1: the <|im_end|> that ended the reply, which usage does not count)
        assert second["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] + \
            first["usage"]["completion_tokens"] + 1 + len(data.encoder.tool_turn_ids([result]))
        answer = second["choices"][0]
        assert answer["finish_reason"] == "stop" and answer["message"]["content"].startswith("<answer>")
        assert "tool_calls" not in answer["message"]
        # a result with an image (a tool that zooms or draws; what GRPO's image tools train): the
        # template's tool turn with the image's tokens, at the server's image limits
        import io

        from PIL import Image

        picture = io.BytesIO()
        Image.new("RGB", (40, 24), (250, 20, 20)).save(picture, "PNG")
        shown = client.post("/v1/chat/completions", json={**ask, "messages": [
            *question, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                    + base64.b64encode(picture.getvalue()).decode()}},
                {"type": "text", "text": result}]}]}).json()
        assert shown["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] + \
            first["usage"]["completion_tokens"] + 1 + len(engine.encoder.tool_turn_ids([result], 0, [[(40, 24)]]))
        assert shown["choices"][0]["finish_reason"] in ("stop", "length")
        tool_turn = [*question, {"role": "assistant", "content": None, "tool_calls": [call]}]
        # tool_choice none: no tools listed, the reply is text
        plain = client.post("/v1/chat/completions", json={**ask, "messages": question, "tool_choice": "none"}).json()
        assert "tool_calls" not in plain["choices"][0]["message"]
        assert plain["usage"]["prompt_tokens"] < first["usage"]["prompt_tokens"]
        bad = {"tool_choice required": {"tool_choice": "required"},
               "arguments not JSON": {"messages": [*question, {"role": "assistant", "tool_calls": [
                   {**call, "function": {"name": "calculator", "arguments": "{oops"}}]}]},
               "assistant without content or calls": {"messages": [*question, {"role": "assistant"}]},
               "legacy functions": {"functions": [{"name": "f"}]},
               # OpenAI's rules: a result answers a call of the assistant message before it, by its id,
               # and every call is answered before the conversation goes on
               "result of no call": {"messages": [*question, {"role": "tool", "tool_call_id": "x", "content": "6"}]},
               "result of another id": {"messages": [*question, {"role": "assistant", "content": None, "tool_calls":
                                                                  [call]},
                                                     {"role": "tool", "tool_call_id": "call_other", "content": "6"}]},
               "call without a result": {"messages": [*question, {"role": "assistant", "content": None, "tool_calls":
                                                                   [call]}, {"role": "user", "content": "and?"}]},
               "result named for another function": {"messages": [
                   *question, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "name": "weather", "content": "6"}]}}
        said = {"result of no call": "answers none of no calls", "result of another id": "'call_other'",
                "call without a result": "have no tool messages with their results",
                "result named for another function": "named 'weather', but the call"}
        for name, change in bad.items():
            r = client.post("/v1/chat/completions", json={**ask, "messages": question, **change})
            assert r.status_code == 400 and said.get(name, "") in r.json()["error"]["message"], (name, r.text)
    # a model GRPO trained saw its tools' images at most tools.image_max_pixels: served with that
    # bound (a GRPO checkpoint's own, or --tool-image-max-pixels), a tool message's image gets the tokens
    # the rollout gave it; a user message's image keeps the server's limits
    from vlforge.rollout.multiturn import tool_image_encoder

    big = io.BytesIO()
    Image.new("RGB", (200, 120), (20, 20, 250)).save(big, "PNG")
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(big.getvalue()).decode()}}
    bounded = ServeConfig(max_prompt_tokens=2048, max_tokens=256, tool_image_max_pixels=4096)
    with LiveServer(create_app(engine, bounded)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        again = client.post("/v1/chat/completions", json={**ask, "messages": question}).json()
        resized = client.post("/v1/chat/completions", json={**ask, "messages": [*tool_turn, {
            "role": "tool", "tool_call_id": call["id"], "content": [part, {"type": "text", "text": result}]}]}).json()
    trained = tool_image_encoder(engine.encoder, ToolsConfig(image_max_pixels=4096))
    turn = trained.tool_turn_ids([result], 0, [[(200, 120)]])
    assert again["usage"] == first["usage"]  # the user's image: the server's limits, as before
    assert resized["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] + \
        first["usage"]["completion_tokens"] + 1 + len(turn)
    assert len(turn) < len(engine.encoder.tool_turn_ids([result], 0, [[(200, 120)]]))  # the bound bit


def test_tool_results_with_images_train_as_context(tiny, shapes_dir, tmp_path):
    """A tool that returned an image (a crop, a chart): the tool message's image parts are encoded as
    transformers' processor encodes the conversation (the images in order, the tool's inside its
    <tool_response>), they are context (no label on them), and the row trains."""
    from PIL import Image

    from vlforge.data.encode import IGNORE_INDEX
    from vlforge.train.losses import sft_loss_sum

    model, processor = tiny
    first, crop = shapes_dir / "images" / "000001.png", shapes_dir / "images" / "000002.png"
    call = '<tool_call>\n{"name": "zoom", "arguments": {"box": [0, 0, 32, 32]}}\n</tool_call>'
    row = {"messages": [
        {"role": "user", "content": [{"type": "image", "image": str(first)}, {"type": "text", "text": "Zoom in."}]},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": [{"type": "image", "image": str(crop)}, {"type": "text", "text": "the crop"}]},
        {"role": "assistant", "content": "<answer>a circle</answer>"}]}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    data = load_dataset(str(tmp_path / "d.jsonl"), processor, DataConfig())
    assert data.samples[0].images == [first, crop]
    item = data[0]
    messages = [{**m, "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text" else {})}
                                  for p in m["content"]] if isinstance(m["content"], list) else m["content"]}
                for m in row["messages"]]
    text = processor.apply_chat_template(messages, tokenize=False)
    ref = processor(text=[text], images=[Image.open(first).convert("RGB"), Image.open(crop).convert("RGB")],
                    return_tensors="pt")
    assert item["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert torch.equal(item["pixel_values"], ref["pixel_values"])
    decoded = processor.tokenizer.decode(item["input_ids"])
    assert decoded.index("<tool_response>") < decoded.rindex("<|image_pad|>") < decoded.index("</tool_response>")
    image_positions = item["input_ids"] == data.encoder.image_token_id
    assert (item["labels"][image_positions] == IGNORE_INDEX).all()
    with torch.no_grad():
        loss, n = sft_loss_sum(model, collate([item], data.encoder.pad_id))
    assert n > 0 and torch.isfinite(loss)


# -- tools that return images, and tools that read the prompt's images ----------------------------



def test_tools_read_the_prompts_images_and_return_images(tmp_path):
    """A tool with an `images` parameter gets the prompt's images (not in its schema: the model never
    writes it); what a tool returns becomes text and images; zoom_in crops in Qwen3-VL's 0..1000
    coordinates; worker processes give the threads' results, images included."""
    from PIL import Image

    from vlforge.tools.builtin import ZOOM_MIN_SIDE, zoom_in

    (tmp_path / "t.py").write_text(IMAGE_TOOL + '''

def shapes(images: list) -> list:
    """The sizes of the conversation's images, and a list."""
    return [[im.size for im in images], "sizes", Image.new("L", (40, 40))]


def plain() -> list:
    """A list without images."""
    return [1, "two"]


def painter(images: list, path: str = "") -> list:
    """Draws on the first image, returns an image file (read lazily), one closed first, or a thin image.

    Args:
        path: A file to return, "closed:" and a file, or "thin".
    """
    images[0].paste((0, 0, 0), (0, 0, 50, 50))  # its own copy: no other call sees this
    if path == "thin":
        return Image.new("RGB", (2, 500))
    if path.startswith("closed:"):
        with Image.open(path.removeprefix("closed:")) as im:
            return [im, "from a closed file"]
    return [Image.open(path), "from a file"]
''')
    names = ["shapes", "plain", "painter"]
    tools = load_tools(["zoom_in", *(f"{tmp_path / 't.py'}:{name}" for name in names)])
    zoom = tools["zoom_in"].schema["function"]["parameters"]
    assert set(zoom["properties"]) == {"bbox_2d", "image"} and zoom["required"] == ["bbox_2d"]
    assert tools["shapes"].schema["function"]["parameters"]["properties"] == {}  # undocumented `images`: fine
    assert tools["zoom_in"].takes_images and not tools["plain"].takes_images
    photo = Image.effect_mandelbrot((400, 300), (-2, -1.2, 1, 1.2), 60).convert("RGB")
    other = Image.new("RGB", (30, 20), (9, 9, 9))
    calls = [[ToolCall("zoom_in", {"bbox_2d": [250, 500, 750, 1000]}), ToolCall("shapes", {}),
              ToolCall("plain", {})],
             [ToolCall("zoom_in", {"bbox_2d": [0, 0, 100, 100], "image": 2}),
              ToolCall("zoom_in", {"bbox_2d": [0, 0, 10, 10], "image": 3}),
              ToolCall("zoom_in", {"bbox_2d": [500, 0, 400, 10]}), ToolCall("shapes", {"images": [1]})],
             [ToolCall("zoom_in", {"bbox_2d": [0, 0, 500, 500]})]]
    images = [[photo], [photo, other], []]
    results = run_tool_calls(calls, tools, 5.0, images)
    [crop] = results[0][0].images
    assert results[0][0].ok and crop.size == (200, 150) and crop == photo.crop((100, 150, 300, 300))
    assert results[0][0].text == "image 1, region [250, 500, 750, 1000] (200x150 pixels)"
    assert zoom_in([100, 100, 100.4, 200], images=[photo])[1].startswith("image 1, region [100, 100, 100.4, 200]")
    assert results[0][1].text == "[[400, 300]]\nsizes" and results[0][1].images[0].mode == "RGB"
    assert results[0][2].ok and results[0][2].text == '[1, "two"]' and results[0][2].images == ()
    small = results[1][0].images[0]  # 3x2 pixels of the 30x20 image, enlarged (its shape kept)
    assert results[1][0].ok and small.size == (ZOOM_MIN_SIDE * 3 // 2, ZOOM_MIN_SIDE)
    assert not results[1][1].ok and "from 1 to 2" in results[1][1].text
    assert not results[1][2].ok and "x1 < x2" in results[1][2].text
    assert results[1][3].text == "[[400, 300], [30, 20]]\nsizes"  # the rollout's images, not the model's argument
    assert not results[2][0].ok and "no image" in results[2][0].text
    with pytest.raises(ValueError, match="four numbers"):
        zoom_in([1, 2, 3], images=[photo])
    with pytest.raises(ValueError, match="four numbers"):
        zoom_in([1, 2, float("nan"), 4], images=[photo])
    with pytest.raises(ValueError, match="relative, from 0 to 1000"):  # Qwen2.5-VL's pixels, say
        zoom_in([500, 300, 1500, 600], images=[photo])
    assert zoom_in([0, 0, 500, 500], image=1.0, images=[photo])[0].size == (200, 150)
    # a tool that draws on its images, returns an image over a closed file, or one the processor refuses
    photo.save(tmp_path / "photo.png")
    painted = [[ToolCall("painter", {"path": str(tmp_path / "photo.png")}),
                ToolCall("painter", {"path": f"closed:{tmp_path / 'photo.png'}"}), ToolCall("painter", {"path": "thin"})]]
    before = photo.copy()
    [answers] = run_tool_calls(painted, tools, 5.0, [[photo]])
    from_file, closed, thin = answers
    assert photo == before and from_file.ok and from_file.images[0] == photo  # read before the call returned
    assert not closed.ok and "must load it" in closed.text  # an error the run goes on after
    assert not thin.ok and "2x500 image" in thin.text
    with ToolProcesses(tools, 2) as run:
        assert run(calls, tools, 30.0, images) == results
        assert run(painted, tools, 30.0, [[photo]]) == [answers]


def test_tool_turn_with_images_is_what_the_processor_renders(tiny, shapes_dir):
    """Prompt + call + tool_turn_ids with the returned images + answer: the processor's token ids of
    the whole conversation, and the tool images' patches (Encoder.pixels) its pixel rows."""
    from PIL import Image

    _, processor = tiny
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    enc = data.encoder
    first = Image.open(data.samples[0].images[0]).convert("RGB")
    returned = [Image.new("RGB", (96, 64), (200, 10, 10)), Image.new("RGB", (64, 64), (0, 0, 255))]
    call = CALL % "2+3"
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is 2+3?"}]}
    tool_messages = [{"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "5"}]},
                     {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "also 5"}]}]
    messages = [user, {"role": "assistant", "content": call}, *tool_messages,
                {"role": "assistant", "content": "<answer>5</answer>"}]
    ref = processor(text=[processor.apply_chat_template(messages, tokenize=False)], images=[first, *returned],
                    return_tensors="pt")
    turn = lambda text: enc.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = enc.token_ids([user], [first.size], add_generation_prompt=True)
    context = enc.tool_turn_ids(["5", "also 5"], 0, [[returned[0].size], [returned[1].size]])
    ours = prompt + turn(call) + context + turn("<answer>5</answer>") + enc.tokenizer("\n")["input_ids"]
    assert ours == ref["input_ids"][0].tolist()
    assert context.count(enc.image_token_id) == sum(enc.image_tokens(*im.size) for im in returned)
    # the rollout shows a tool's images at most tools.image_max_pixels (they spend its token budget)
    big = Image.new("RGB", (1000, 800))
    shown = tool_image_encoder(enc, ToolsConfig(image_max_pixels=64 * 64))
    grid = shown.pixels([big])["image_grid_thw"]
    assert int(grid.prod()) * enc.patch**2 <= 64 * 64
    assert shown.image_tokens(*big.size) == int(grid.prod()) // enc.merge**2 < enc.image_tokens(*big.size)
    pixels = enc.pixels(returned)
    first_rows = int(ref["image_grid_thw"][0].prod())
    assert torch.equal(pixels["pixel_values"], ref["pixel_values"][first_rows:])
    assert torch.equal(pixels["image_grid_thw"], ref["image_grid_thw"][1:])


def test_multi_turn_rollout_with_tool_images_is_scored_as_the_engine_saw_it(tool_model, tool_data, tmp_path):
    """The calculator answers with a picture too: each calling sequence's tool turn holds its image's
    tokens, the Rollout keeps the pictures, and the trainer's log-probs of the generated tokens equal
    the engine's (padded, packed, any subset of sequences): the forward sees each picture where the
    rollout showed it. Another picture changes the later turns' log-probs."""
    (tmp_path / "t.py").write_text(IMAGE_TOOL)
    model, enc, _, encoded = _rollout_setup(tool_model, tool_data["prompts"])
    tools = load_tools([f"{tmp_path / 't.py'}:calculator"])
    prompts = collate(encoded, enc.pad_id, left_pad=True)
    cfg = RolloutConfig(group_size=4, max_new_tokens=200, temperature=0.7)
    from PIL import Image

    prompt_images = [[Image.new("RGB", (8, 8))] * (b + 1) for b in range(3)]  # what the tool is given (it counts them)
    patches = []  # the vision tower's patch rows per call
    hook = model.model.visual.register_forward_pre_hook(lambda m, args: patches.append(args[0].shape[0]))
    try:
        out = generate_with_tools(Engine(model), enc, prompts, [1, 1, 1], cfg, tools, seed=11, prompt_images=prompt_images,
                                  settings=ToolsConfig())
    finally:
        hook.remove()
    r = out.rollout
    calling = [n for n in range(12) if out.calls[n]]
    assert len(calling) >= 8 and r.images_per_response == out.calls
    # the second turn's prefill: each prompt's image once for its continuing samples, each one's picture once
    per_image = int(prompts["image_grid_thw"][0].prod())
    assert patches[1] == len({n // 4 for n in calling}) * per_image + r.response_pixel_values.shape[0]
    sizes = r.response_image_grid_thw.prod(-1).tolist()
    assert r.response_pixel_values.shape[0] == sum(sizes) and r.response_pixel_values.dtype == r.pixel_values.dtype
    image = 0
    for n in calling:
        real = r.response_ids[n][r.response_mask[n].bool()]
        tokens = int((real == enc.image_token_id).sum())
        grids = r.response_image_grid_thw[image:image + out.calls[n]]
        assert tokens == int(grids.prod(-1).sum()) // 4 > 0  # merge 2x2
        # prompt b's pictures are 48 + 16 (b + 1) wide: its tool was given that prompt's images
        pictures = [im for m in out.transcripts[n] for im in m.get("images", [])]
        assert [im.size for im in pictures] == [(48 + 16 * (n // 4 + 1), 64)] * out.calls[n]
        assert torch.equal(grids, tool_image_encoder(enc, ToolsConfig()).pixels(pictures)["image_grid_thw"])
        image += out.calls[n]
    gen = r.generated_mask.bool()
    with torch.no_grad():
        for packing in (False, True):
            logp, _ = sequence_logprobs(model, r, cfg.temperature, packing=packing)
            torch.testing.assert_close(logp[gen], r.logprobs[gen], atol=1e-4, rtol=1e-4)
        some = [calling[-1], 0, calling[0], 5]  # a mini-batch: out of order, with and without tool images
        part, _ = sequence_logprobs(model, r, cfg.temperature, seq_index=some, packing=True)
        torch.testing.assert_close(part[gen[some]], r.logprobs[some][gen[some]], atol=1e-4, rtol=1e-4)
        assert r.images_of_seq(calling[0]) == 1 + out.calls[calling[0]]
        # the picture is read: another one changes what follows it
        r.response_pixel_values = torch.randn(r.response_pixel_values.shape, generator=torch.Generator().manual_seed(0))
        changed, _ = sequence_logprobs(model, r, cfg.temperature)
        n = calling[0]
        later = gen[n].clone()
        later[:r.generated_mask[n].tolist().index(0)] = False
        assert not torch.allclose(changed[n][later], logp[n][later], atol=1e-4)


def test_grpo_with_a_tool_that_returns_images(tool_model, tool_data, tmp_path, monkeypatch):
    """The recipe end to end with the picture-returning calculator: its first update's ratio is 1 and
    its KL 0 (the trainer's forward of every sequence, tool pictures included, is the rollout's)."""
    from vlforge.demo import packaged_config
    from vlforge.recipes import grpo as recipe

    rollouts, real_rollout = [], recipe.generate_with_tools
    monkeypatch.setattr(recipe, "generate_with_tools",
                        lambda *a, **k: rollouts.append(real_rollout(*a, **k)) or rollouts[-1])
    (tmp_path / "t.py").write_text(IMAGE_TOOL)
    # a reward that differs within groups (the tiny model rarely answers right), so that the loss is not 0
    (tmp_path / "rewards.py").write_text("def parity(completion, answer, **row):\n    return float(len(completion) % 2)\n")
    recipe.run_grpo(load_config(GRPOConfig, packaged_config("demo-tools-grpo.yaml"), [
        f"model.path={tool_model}", f"data.train={tool_data['prompts']}", "log.progress=false",
        "rollout.group_size=4", "rollout.prompts_per_step=2", "rl.mini_batch_size=8", "rl.dynamic_sampling=false",
        f"tools.names=['{tmp_path / 't.py'}:calculator']", f"train.output_dir={tmp_path / 'run'}",
        "train.max_steps=2", "rl.kl_beta=0.05", f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:parity'}}]"]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # (the shipped config samples at temperature 1: many of the tiny model's calls are malformed, some run;
    # how many is the draw's: 0.5 a response with torch 2.11, more with 2.14)
    assert len(rows) == 2 and rows[0]["tool/calls_mean"] > 0
    assert sum(rollouts[0].rollout.images_per_response) > 0
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and abs(rows[0]["approx_kl"]) < 1e-5
    # each step's loss: the PPO surrogate at ratio 1 of its rewards' advantages (the tool pictures in every
    # forward), plus the KL term
    advantages = [grpo_by_hand([float(len(c) % 2) for c in multi.completions], 4) for multi in rollouts]
    assert any(advantages[0]) or any(advantages[1])
    for row, multi, adv in zip(rows, rollouts, advantages):
        want = surrogate_at_ratio_one(adv, multi.rollout.generated_mask)
        assert row["loss"] == pytest.approx(want + 0.05 * row["kl"], abs=1e-4)


def test_synth_zoom_rows_are_what_the_builtin_zoom_in_returns(tiny, tmp_path):
    """`vlforge data synth zoom`: each SFT row's tool message is zoom_in's own result on the row's
    image (crop pixels and text), the region holds the shape whose colour is the answer, and the rows
    pass `data check` and train only the assistant turns."""
    from PIL import Image

    from vlforge.cli import main
    from vlforge.data.synth import RGB
    from vlforge.tools.builtin import zoom_in

    assert main(["data", "synth", "zoom", "--n", "6", "--out", str(tmp_path)]) == 0
    assert main(["data", "check", str(tmp_path / "zoom_sft.jsonl"), "data.max_length=2048"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "zoom_sft.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (tmp_path / "zoom_prompts.jsonl").read_text().splitlines()]
    for row, prompt in zip(rows, prompts, strict=True):
        user, call, tool, answer = row["messages"]
        [parsed] = parse_tool_calls(call["content"])
        image = Image.open(tmp_path / user["content"][0]["image"]).convert("RGB")
        crop, text = zoom_in(**parsed.arguments, images=[image])
        assert Image.open(tmp_path / tool["content"][0]["image"]).convert("RGB") == crop
        assert tool["content"][1]["text"] == text and parsed.name == "zoom_in"
        colour = answer["content"].removeprefix("<answer>").removesuffix("</answer>")
        assert colour == prompt["answer"] and RGB[colour] in {rgb for _, rgb in crop.getcolors(1 << 16)}
    _, processor = tiny
    data = load_dataset(str(tmp_path / "zoom_sft.jsonl"), processor, DataConfig(max_length=2048))
    item = data[0]
    trained = data.encoder.tokenizer.decode(item["labels"][item["labels"] >= 0])
    assert "zoom_in" in trained and "<answer>" in trained and "region" not in trained
    assert int((item["input_ids"] == data.encoder.image_token_id).sum()) == int(item["image_grid_thw"].prod(-1).sum()) // 4


def test_a_template_that_cannot_show_tool_images_is_refused_before_the_run(tiny):
    """A tool that reads the prompt's images (zoom_in) shows images back: a chat template whose tool
    messages are text only is refused at the start (ConfigError naming the tool), not mid-run."""
    import copy

    from vlforge.data.encode import Encoder, ImageLimits
    from vlforge.rollout.multiturn import check_tool_template

    _, processor = tiny
    text_only = copy.deepcopy(processor)
    # Qwen's template with a tool message's content rendered as text only
    text_only.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
        "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}"
        "{{ p.text }}{% endif %}{% endfor %}{% endif %}\n</tool_response><|im_end|>\n{% else %}<|im_start|>"
        "{{ m.role }}\n{{ m.content if m.content is string else '' }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    limits = ImageLimits(32 * 32, 256 * 256)
    check_tool_template(Encoder(text_only, limits), "tools.names")  # text results: fine
    check_tool_template(Encoder(processor, limits), "tools.names", showing=["zoom_in"])  # the real one shows them
    with pytest.raises(ConfigError, match="tools.names: zoom_in show images, but the chat template produced 0"):
        check_tool_template(Encoder(text_only, limits), "tools.names", showing=["zoom_in"])
