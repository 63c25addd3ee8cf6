import copy

import pytest
import torch

from vlforge.generate.engine import Engine
from vlforge.config import DataConfig, RolloutConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.generate.forward import encode_images, filter_logits, forward_shared, rope_positions
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import sequence_logprobs


@pytest.fixture
def setup(tiny, shapes_dir):
    model, processor = tiny
    model = copy.deepcopy(model).eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    prompts = collate([encode_prompt(data.encoder, data.samples[i]) for i in range(3)], data.encoder.pad_id,
                      left_pad=True)
    return model, data.encoder, prompts


def count_vision_images(model):
    seen = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, kwargs, out: seen.append(
        int(kwargs["grid_thw"].shape[0])), with_kwargs=True)
    return seen, handle


def test_rollout_logprobs_match_trainer_recompute(setup):
    model, encoder, prompts = setup
    cfg = RolloutConfig(group_size=4, max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=50)
    torch.manual_seed(0)
    rollout = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], cfg)
    assert rollout.response_ids.shape[0] == 12
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout, cfg.temperature)
    mask = rollout.response_mask.bool()
    assert mask.sum() > 12
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)


def test_image_encoded_once_per_prompt_in_rollout_and_training(setup):
    model, encoder, prompts = setup
    seen, handle = count_vision_images(model)
    rollout = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], RolloutConfig(group_size=4, max_new_tokens=4))
    assert seen == [3]  # one vision pass over the 3 prompt images, not 12
    logp, _ = sequence_logprobs(model, rollout, 1.0)
    logp.sum().backward()
    assert seen == [3, 3]
    # a mini-batch of prompt 1's sequences encodes prompt 1's image only, with the same log-probs
    part, _ = sequence_logprobs(model, rollout, 1.0, seq_index=[4, 5, 6, 7])
    handle.remove()
    assert seen == [3, 3, 1]
    torch.testing.assert_close(part, logp[4:8].detach(), atol=1e-5, rtol=1e-5)


def test_shared_forward_equals_hf_forward_with_repeated_pixels(setup):
    model, encoder, prompts = setup
    G = 2
    ids = prompts["input_ids"].repeat_interleave(G, 0)
    mask = prompts["attention_mask"].repeat_interleave(G, 0)
    pixels = prompts["pixel_values"].view(3, -1, prompts["pixel_values"].shape[-1]).repeat_interleave(G, 0)
    grid = prompts["image_grid_thw"].repeat_interleave(G, 0)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, pixel_values=pixels.flatten(0, 1), image_grid_thw=grid,
                          mm_token_type_ids=(ids == encoder.image_token_id).long()).logits
        feats = encode_images(model, prompts["pixel_values"], prompts["image_grid_thw"], [1, 1, 1])
        pos = rope_positions(model, ids, mask, encoder.image_token_id, grid)
        hidden = forward_shared(model, ids, mask, pos, feats, [n // G for n in range(6)]).last_hidden_state
        ours = model.lm_head(hidden)
    real = mask.bool()
    torch.testing.assert_close(ours[real], reference[real], atol=1e-5, rtol=1e-5)


def test_vision_tokens_are_never_sampled(setup):
    model, encoder, prompts = setup
    with torch.no_grad():  # make the image placeholder by far the most likely next token
        model.lm_head.weight[encoder.image_token_id] = model.lm_head.weight[encoder.image_token_id] * 0 + 5.0
    rollout = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], RolloutConfig(group_size=4, max_new_tokens=6))
    banned = set(rollout.banned_ids)
    assert encoder.image_token_id in banned
    assert not banned & set(rollout.response_ids[rollout.response_mask.bool()].tolist())


def test_greedy_and_top_k_1_agree_and_stop_at_eos(setup):
    model, encoder, prompts = setup
    greedy = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], RolloutConfig(group_size=2, temperature=0.0,
                                                                               max_new_tokens=5))
    top1 = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], RolloutConfig(group_size=2, top_k=1, max_new_tokens=5))
    assert torch.equal(greedy.response_ids, top1.response_ids)
    for row, m in zip(greedy.response_ids, greedy.response_mask):  # nothing after <|im_end|> is kept
        ends = (row == encoder.im_end_id).nonzero()
        if len(ends):
            assert m[ends[0, 0] + 1:].sum() == 0


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(logits, 0, 0.75).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert filter_logits(logits, 2, 1.0).isfinite().sum() == 2
