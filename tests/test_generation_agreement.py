"""A run's evaluation answers are the answers its model gives in `vlforge infer`/`eval`/`serve`.

Until one generation engine serves both, training-time eval (train/evaluate.py) and the
inference engine (infer/model.py) are two paths; they must stop at the same tokens and give the
same greedy text for the same input.
"""

import copy
from collections import Counter

import torch

from vlforge.generate.engine import Engine
from vlforge.generate.requests import GenRequest, Prompt
from vlforge.config import DataConfig, PrecisionConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.train.evaluate import _generate_answers_hf, generate_answers
from vlforge.train.precision import PrecisionPolicy
from vlforge.recipes.infer import evaluate_dataset
from vlforge.infer.model import InferenceModel


FP32 = PrecisionPolicy(PrecisionConfig(mode="fp32"), "cpu")


def _greedy_tokens(model, encoder, samples, **kwargs) -> torch.Tensor:
    batch = collate([encode_prompt(encoder, s) for s in samples], encoder.pad_id, left_pad=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=encoder.pad_id, **kwargs)
    return out[:, batch["input_ids"].shape[1]:]


def _eval_answers_equal_served(model, processor, encoder, samples, shapes_dir) -> list[str]:
    """Training-time eval's greedy answers, checked equal to `vlforge eval`'s through the serve engine."""
    answers = generate_answers(model, encoder, samples, batch_size=4, max_new_tokens=8, policy=FP32,
                               device=torch.device("cpu"))
    engine = InferenceModel(model, processor, torch.device("cpu"), "tiny")
    served = [row["answer"] for row in evaluate_dataset(engine, shapes_dir / "val.jsonl", batch_size=3,
                                                      max_new_tokens=8)["answers"]]
    assert served == answers
    return answers


def test_eval_and_inference_stop_alike_and_answer_alike(tiny, shapes_dir):
    model, processor = copy.deepcopy(tiny[0]).eval(), tiny[1]
    val = load_dataset(str(shapes_dir / "val.jsonl"), processor, DataConfig())
    encoder, samples = val.encoder, val.samples
    assert set(encoder.end_ids) == {encoder.im_end_id, encoder.pad_id}

    # Make the second end token matter: whatever the random tiny model says most often, it now says
    # as <|endoftext|> (the lm_head rows of the two tokens swapped), mid-answer.
    counts = Counter(_greedy_tokens(model, encoder, samples, eos_token_id=None).flatten().tolist())
    frequent = next(t for t, _ in counts.most_common() if t not in encoder.end_ids)
    with torch.no_grad():
        w = model.lm_head.weight
        w[[frequent, encoder.pad_id]] = w[[encoder.pad_id, frequent]].clone()

    answers = _eval_answers_equal_served(model, processor, encoder, samples, shapes_dir)

    # ... and the stop at <|endoftext|> was exercised: stopping at <|im_end|> alone reads on past it
    tokens = _greedy_tokens(model, encoder, samples, eos_token_id=encoder.im_end_id)
    read_on = [t.strip() for t in encoder.tokenizer.batch_decode(tokens, skip_special_tokens=True)]
    assert read_on != answers


def test_eval_serve_and_rollouts_never_generate_the_same_tokens(tiny, shapes_dir, tmp_path):
    """The vision placeholder made by far the likeliest token, and the next likeliest put in the
    model's generation_config.suppress_tokens: eval, serve and GRPO rollouts ban both (one list,
    generate.forward.never_generated) and still answer alike."""
    from vlforge.config import RolloutConfig
    from vlforge.generate.forward import never_generated
    from vlforge.rollout.groups import generate_groups

    model, processor = copy.deepcopy(tiny[0]).eval(), tiny[1]
    val = load_dataset(str(shapes_dir / "val.jsonl"), processor, DataConfig())
    encoder, samples = val.encoder, val.samples
    with torch.no_grad():
        w = model.lm_head.weight
        w[encoder.image_token_id] = w[encoder.image_token_id] * 0 + 5.0
    unbanned = _greedy_tokens(model, encoder, samples, eos_token_id=None)
    assert (unbanned == encoder.image_token_id).any(dim=1).all()  # not vacuous: every answer would say it
    counts = Counter(_greedy_tokens(model, encoder, samples, eos_token_id=None,
                                    suppress_tokens=[encoder.image_token_id]).flatten().tolist())
    runner_up = next(t for t, _ in counts.most_common() if t not in encoder.end_ids)
    model.generation_config.suppress_tokens = [runner_up]
    banned = {encoder.image_token_id, runner_up}
    assert banned <= set(never_generated(encoder, model))

    answers = _eval_answers_equal_served(model, processor, encoder, samples, shapes_dir)
    # the sharded eval's path (transformers' generate, synced across ranks: one gloo process here) bans alike
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        synced = _generate_answers_hf(model, encoder, samples, batch_size=4, max_new_tokens=8, policy=FP32,
                                      device=torch.device("cpu"), synced=True)
    finally:
        dist.destroy_process_group()
    assert synced == answers
    tok = encoder.tokenizer
    for answer in answers:
        assert not banned & set(tok(answer, add_special_tokens=False)["input_ids"])
    prompts = collate([encode_prompt(encoder, s) for s in samples], encoder.pad_id, left_pad=True)
    rollout = generate_groups(Engine(model), encoder, prompts, [1] * len(samples),
                              RolloutConfig(group_size=2, temperature=0.0, max_new_tokens=8))
    assert banned <= set(rollout.banned_ids)
    assert not banned & set(rollout.response_ids[rollout.response_mask.bool()].tolist())


def test_ids_past_the_tokenizer_are_never_generated(tiny, shapes_dir):
    """The tiny preset's lm_head has rows past its tokenizer (640 for 591 tokens, as Qwen3-VL's 151,936
    for 151,669): made the likeliest, such an id would fill every answer and stream no text. Every
    generation path bans them (never_generated) and the answers carry text."""
    from vlforge.generate.forward import never_generated, vision_token_ids

    model, processor = copy.deepcopy(tiny[0]).eval(), tiny[1]
    val = load_dataset(str(shapes_dir / "val.jsonl"), processor, DataConfig())
    encoder, samples = val.encoder, val.samples
    vocab, rows = len(encoder.tokenizer), model.lm_head.out_features
    assert rows > vocab
    padded = rows - 1
    with torch.no_grad():
        w = model.lm_head.weight
        w[padded] = w[padded] * 0 + 5.0
    assert (_greedy_tokens(model, encoder, samples, eos_token_id=None) == padded).any(dim=1).all()  # not vacuous
    assert set(range(vocab, rows)) <= set(never_generated(encoder, model))
    assert not set(range(vocab, rows)) & set(vision_token_ids(encoder))  # banned for being padding alone
    answers = _eval_answers_equal_served(model, processor, encoder, samples, shapes_dir)
    assert all(answers)  # text, not padding ids
    results = Engine(model).generate(
        [GenRequest(Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw")), max_new_tokens=8)
         for x in (encode_prompt(encoder, s) for s in samples)],
        stop_ids=[], banned_ids=never_generated(encoder, model), image_token_id=encoder.image_token_id,
        pad_id=encoder.pad_id)
    assert all(int(r.tokens.max()) < vocab for r in results)


def test_a_later_batch_bans_its_own_ids_and_stops_at_its_own(tiny, shapes_dir):
    """The runner keeps its banned and stop masks between batches while the ids are unchanged; a batch
    with other ids gets masks of its own (never the previous batch's)."""
    model, processor = copy.deepcopy(tiny[0]).eval(), tiny[1]
    data = load_dataset(str(shapes_dir / "val.jsonl"), processor, DataConfig())
    encoder, x = data.encoder, encode_prompt(data.encoder, data.samples[0])
    engine = Engine(model)
    request = GenRequest(Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw")), max_new_tokens=8)

    def tokens(banned, stop):
        out = engine.generate([request], stop_ids=stop, banned_ids=banned, image_token_id=encoder.image_token_id,
                              pad_id=encoder.pad_id)
        return out[0].tokens.tolist()

    free = tokens([], [])
    assert tokens([], []) == free  # unchanged ids: the kept masks give the same tokens
    banned = tokens([free[0]], [])
    assert banned[0] != free[0] and free[0] not in banned  # the new ban took effect
    assert tokens([], []) == free  # and left with its batch
    stopped = tokens([], [free[2]])
    assert stopped == free[:3]  # a new stop id ends the answer at it
