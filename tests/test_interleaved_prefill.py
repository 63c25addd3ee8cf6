"""Interleaved prefill (Engine.step_prefill_tokens): a burst of requests joining a running batch is
prefilled over several steps, a decode step of the running rows after each, with the tokens of one
big prefill."""

import copy

import pytest

from vlforge.config import DataConfig
from vlforge.data.dataset import load_dataset
from vlforge.generate.engine import Engine
from vlforge.generate.requests import GenRequest

from test_generate import open_pull, prompt_of


@pytest.fixture
def setup(tiny, shapes_dir):
    model, processor = tiny
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    return copy.deepcopy(model).eval(), data.encoder, data.samples


def burst(model, encoder, samples, step_prefill_tokens: int):
    """8 rows decode; 6 requests arrive at once. Per step() after the burst: (prefills, requests whose
    first token it reported, decode steps), and every result's tokens by request."""
    engine = Engine(model, sync_every=1, join_share=0.0, step_prefill_tokens=step_prefill_tokens)
    open_pull(engine, encoder, slots=16, stop_ids=[])
    running = [engine.add(GenRequest(prompt_of(encoder, samples[i % 4]), max_new_tokens=30)) for i in range(8)]
    engine.step()
    late = [engine.add(GenRequest(prompt_of(encoder, samples[4 + i]), max_new_tokens=6, temperature=1.0, seed=i))
            for i in range(6)]
    per_step, started, results = [], set(), {}
    while len(results) < len(running) + len(late):
        prefills, steps = engine.stats.prefills, engine.stats.steps
        outs = engine.step()
        new = {o.id for o in outs if o.id in late and o.new_tokens[0] and o.id not in started}
        started |= new
        per_step.append((engine.stats.prefills - prefills, len(new), engine.stats.steps - steps))
        results.update((o.id, o.results[0].tokens.tolist()) for o in outs if o.finished)
    return per_step, [results[i] for i in running + late], [len(prompt_of(encoder, samples[4 + i]).input_ids)
                                                            for i in range(6)]


def test_a_burst_of_joins_is_prefilled_over_several_steps_with_the_same_tokens(setup):
    model, encoder, samples = setup
    whole, whole_tokens, lengths = burst(model, encoder, samples, 10**6)
    budget = min(lengths)  # one prompt a step (the first fits or is taken alone), never two
    spread, spread_tokens, _ = burst(model, encoder, samples, budget)
    assert whole[0] == (1, 6, 1)  # without a budget: all six in one prefill
    assert [s for s in spread[:6]] == [(1, 1, 1)] * 6  # one prompt a step, each step decoding the running rows
    assert spread_tokens == whole_tokens
    assert max(lengths) > budget  # so prompts longer than the budget joined too (alone, whole)
    pair, pair_tokens, _ = burst(model, encoder, samples, 2 * max(lengths))
    assert [s[1] for s in pair[:3]] == [2, 2, 2] and pair_tokens == whole_tokens


def test_the_servers_engine_interleaves_and_a_batch_callers_does_not(tiny):
    """A server's engine (the InferenceModel's) prefills STEP_PREFILL_TOKENS a step while rows decode; a
    batch caller's (GRPO's, eval's: Engine's default) one prefill as large as max_prefill_tokens allows."""
    import torch

    from vlforge.infer.model import STEP_PREFILL_TOKENS, InferenceModel

    model, processor = tiny
    served = InferenceModel(copy.deepcopy(model), processor, torch.device("cpu"), "tiny").gen_engine()
    assert served.step_prefill_tokens == STEP_PREFILL_TOKENS < served.max_prefill_tokens
    batch = Engine(model)
    assert batch.step_prefill_tokens == batch.max_prefill_tokens

