"""generate/: the engine against transformers' generate, the trainer's log-probs, itself alone, and the
sampling distribution."""

import copy

import pytest
import torch

from vlforge.config import DataConfig, RolloutConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.generate.engine import Engine
from vlforge.generate.forward import never_generated, vision_token_ids
from vlforge.generate.prefill import pixel_dtype
from vlforge.generate.requests import GenRequest, Prompt
from vlforge.generate.sampling import _first_above, inverse_cdf, row_key, sample, unit_interval
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import sequence_logprobs

from helpers import compiled_on_cpu


@pytest.fixture
def setup(tiny, shapes_dir):
    model, processor = tiny
    model = copy.deepcopy(model).eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    return model, data.encoder, data.samples


def prompt_of(encoder, sample) -> Prompt:
    x = encode_prompt(encoder, sample)
    return Prompt(x["input_ids"], x.get("pixel_values"), x.get("image_grid_thw"))


def run(engine, encoder, requests, **kwargs):
    kwargs.setdefault("stop_ids", encoder.end_ids)
    return engine.generate(requests, banned_ids=vision_token_ids(encoder), image_token_id=encoder.image_token_id,
                           pad_id=encoder.pad_id, **kwargs)


def test_greedy_equals_transformers_generate(setup):
    model, encoder, samples = setup
    chosen = samples[:4]  # prompt lengths 32, 33, 36, 32: left padding differs per row
    batch = collate([encode_prompt(encoder, s) for s in chosen], encoder.pad_id, left_pad=True)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=encoder.pad_id,
                             eos_token_id=None)
    reference = out[:, batch["input_ids"].shape[1]:]
    # generate bans nothing and never stops here: neither do we
    results = Engine(model).generate([GenRequest(prompt_of(encoder, s), max_new_tokens=12) for s in chosen],
                                     stop_ids=[], banned_ids=[], image_token_id=encoder.image_token_id,
                                     pad_id=encoder.pad_id)
    ours = torch.stack([r.tokens for r in results])
    assert torch.equal(ours, reference)
    assert len(set(map(tuple, ours.tolist()))) > 1  # the rows really differ


def test_joining_mid_batch_changes_nothing(setup):
    """6 requests through 2 slots (rows finish at different lengths, waiting ones join the running
    batch) give each request the tokens it gets alone: greedy, and sampled with a seed."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=3)
    for temperature in (0.0, 1.0):
        requests = [GenRequest(prompt_of(encoder, samples[i]), max_new_tokens=4 + 3 * i, temperature=temperature,
                               seed=7, first_row=i) for i in range(6)]
        batched = run(engine, encoder, requests, slots=2)
        assert engine.stats.prefills > 2  # requests really joined later
        for i, r in enumerate(requests):
            [alone] = run(engine, encoder, [r])
            assert torch.equal(batched[i].tokens, alone.tokens), (temperature, i)
            torch.testing.assert_close(batched[i].logprobs, alone.logprobs, atol=1e-5, rtol=1e-5)
        assert [len(r.tokens) for r in batched] != [len(r.tokens) for r in batched[:1]] * 6


def test_shared_prompt_kv_gives_the_tokens_of_a_copy_per_row(setup):
    """GroupCache (each prompt's KV stored once for its n samples, their tokens interleaved after it)
    against SlotCache (a copy per row), fp32: the same tokens and log-probs, sampled with top-k/top-p
    and greedy, for prompts of different lengths whose rows end at different lengths, with groups
    joining as earlier groups finish (5 requests of 3 samples through 6 slots) and moving down
    (compaction); requests of different n fall back to SlotCache."""
    model, encoder, samples = setup
    for temperature, top_p in ((0.0, 1.0), (1.0, 0.9)):
        requests = [GenRequest(prompt_of(encoder, samples[i]), n=3, max_new_tokens=3 + 4 * i, temperature=temperature,
                               top_k=20, top_p=top_p, seed=5, first_row=3 * i) for i in (4, 0, 1, 3, 2)]
        assert len({len(r.prompt.input_ids) for r in requests}) > 1
        results, stats = {}, {}
        for share in (True, False):
            engine = Engine(model, sync_every=2, share_prompt=share)
            results[share] = run(engine, encoder, requests, slots=6, stop_ids=[])  # 2 groups at a time
            joined = engine.stats.prefills
            # then a short group in group 0 and a long one above it: the long one moves down
            results[share] += run(engine, encoder, requests[1:2] + requests[:1], stop_ids=[])
            stats[share] = (engine.plan.group, joined, engine.stats.compactions)
        assert stats[True][0] == 3 and stats[False][0] == 0
        assert stats[True][1] > 1 and stats[True][2] > 0  # groups joined later and moved down
        for a, b in zip(results[True], results[False]):
            assert (a.request, a.sample) == (b.request, b.sample)
            assert torch.equal(a.tokens, b.tokens), (temperature, a.request, a.sample)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
        assert len({len(r.tokens) for r in results[True][:15]}) == len(requests)
    engine = Engine(model)
    run(engine, encoder, [GenRequest(prompt_of(encoder, samples[0]), n=2), GenRequest(prompt_of(encoder, samples[1]))])
    assert engine.plan.group == 0


def test_the_additive_step_mask_attends_as_torch_sdpa_with_the_boolean_mask():
    """The decode step's additive mask (built once a step, in the KV dtype) through the engine's two
    decode attentions against torch's SDPA given the boolean mask with the KV heads repeated (an
    independent reference): the same output; a row that reads nothing (a padding row) gets finite
    output, not NaN; a row sees nothing past its length."""
    import torch.nn.functional as F

    from vlforge.generate.cache import _decode_attention, _decode_attention_grouped, step_mask

    keep = torch.tensor([[True, False, True], [False, False, False]])
    mask = step_mask(keep, torch.bfloat16)
    assert mask.dtype == torch.bfloat16 and mask[0].tolist() == [0, torch.finfo(torch.bfloat16).min, 0]
    q, kv = torch.randn(2, 4, 1, 8), torch.randn(1, 2, 3, 8)  # 2 rows of one group, 4 q heads, 2 kv heads
    mask_P1QL = step_mask(keep[:, None].expand(2, 2, 3).reshape(1, 1, 4, 3), torch.float32)
    out, _ = _decode_attention_grouped(None, q, kv, kv, mask_P1QL, scaling=0.3)
    assert torch.isfinite(out).all()
    want = F.scaled_dot_product_attention(q[:1], kv.repeat_interleave(2, dim=1), kv.repeat_interleave(2, dim=1),
                                          attn_mask=keep[0][None, None, None], scale=0.3)  # row 0 reads 0 and 2
    torch.testing.assert_close(out[0], want[0].transpose(0, 1))

    torch.manual_seed(0)
    S, Hq, Hkv, Lb, D = 5, 8, 2, 256, 16
    q, k, v = torch.randn(S, Hq, 1, D), torch.randn(S, Hkv, Lb, D), torch.randn(S, Hkv, Lb, D)
    lengths = torch.tensor([1, 17, 128, 200, 256])
    keep_S11L = (torch.arange(Lb)[None] < lengths[:, None])[:, None, None, :]
    ours, _ = _decode_attention(None, q, k, v, step_mask(keep_S11L, torch.float32), scaling=0.3)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1),
                                          attn_mask=keep_S11L, scale=0.3)
    assert ours.shape == (S, 1, Hq, D)
    torch.testing.assert_close(ours, want.transpose(1, 2), atol=1e-5, rtol=1e-5)
    k2 = k.clone()
    k2[0, :, 1:] = 100.0  # past row 0's length
    torch.testing.assert_close(_decode_attention(None, q, k2, v, step_mask(keep_S11L, torch.float32), scaling=0.3)[0][0],
                               ours[0])


def test_prefill_pixels_cast_on_the_host_give_the_tokens_of_the_towers_own_cast(setup, monkeypatch):
    """The prefill joins its prompts' pixels in the dtype the patch embedding casts them to (a bf16
    model: bf16 on the host, half the copy): the same tokens and log-probs as fp32 pixels cast by the
    tower itself; joined_to_device is torch.cat then the cast."""
    from vlforge.model.host_inputs import joined_to_device

    model, encoder, samples = setup
    model = copy.deepcopy(model).to(torch.bfloat16)
    requests = [GenRequest(prompt_of(encoder, samples[i]), n=2, max_new_tokens=5, temperature=1.0, seed=2,
                           first_row=2 * i) for i in range(3)]
    engine = Engine(model)
    assert pixel_dtype(engine.core) == torch.bfloat16
    host_cast = run(engine, encoder, requests, stop_ids=[])
    seen = []
    joined = joined_to_device
    monkeypatch.setattr("vlforge.generate.prefill.joined_to_device",
                        lambda parts, device, dtype=None: seen.append(dtype) or joined(parts, device))  # fp32 pixels
    tower_cast = run(Engine(model), encoder, requests, stop_ids=[])
    assert seen == [torch.bfloat16]
    for a, b in zip(host_cast, tower_cast):
        assert torch.equal(a.tokens, b.tokens)
        assert torch.equal(a.logprobs, b.logprobs)
    parts = [torch.randn(3, 4), torch.randn(2, 4)]
    out = joined_to_device(parts, torch.device("cpu"), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.cat(parts).to(torch.bfloat16))


def test_joins_wait_for_a_share_of_the_slots_and_change_no_token(setup):
    """join_share: 24 requests of different lengths through 8 slots join in prefills of at least
    4 (half the slots) while rows run, instead of one prefill per sync point at which a slot freed;
    every request gets the same greedy tokens either way. A lone waiting request is not held, and
    no request is held longer than MAX_JOIN_HOLD sync points while long rows keep the slots."""
    from vlforge.generate.scheduler import MAX_JOIN_HOLD

    model, encoder, samples = setup

    def finish_steps(requests, share):  # each request's step count when its result came back
        engine, at, results = Engine(model, sync_every=1, join_share=share), {}, {}
        open_pull(engine, encoder, slots=8, stop_ids=[])
        ids = [engine.add(r) for r in requests]
        while len(results) < len(ids):
            for o in engine.step():
                if o.finished:
                    at[o.id], results[o.id] = engine.stats.steps, o.results[0]
        return engine, [results[i] for i in ids], [at[i] for i in ids]

    def requests_of(lengths):
        return [GenRequest(prompt_of(encoder, samples[i % len(samples)]), max_new_tokens=n, first_row=i)
                for i, n in enumerate(lengths)]

    mixed = requests_of([1 + i % 7 for i in range(24)])
    every, one_by_one, _ = finish_steps(mixed, 0.0)
    batched, together, _ = finish_steps(mixed, 0.5)
    assert batched.stats.prefills < every.stats.prefills
    assert [r.tokens.tolist() for r in together] == [r.tokens.tolist() for r in one_by_one]
    assert [len(r.tokens) for r in together] == [r.max_new_tokens for r in mixed]
    # 9 requests through 8 slots: the ninth waits alone, so it joins at the first free slot
    lone = requests_of([2] + [30] * 7 + [2])
    assert finish_steps(lone, 0.5)[2][8] == finish_steps(lone, 0.0)[2][8] < 30
    # 5 long rows keep 5 slots; 4 requests wait behind 3 short rows: held, but not until a long row ends
    behind = requests_of([60] * 5 + [2] * 3 + [2] * 4)
    held, unheld = finish_steps(behind, 0.5)[2][8:], finish_steps(behind, 0.0)[2][8:]
    assert max(held) > max(unheld)  # they were held
    assert max(held) <= max(unheld) + MAX_JOIN_HOLD < 60
    with pytest.raises(ValueError, match="join_share"):
        Engine(model, join_share=1.5)


def test_results_stream_and_seeds_reproduce(setup):
    model, encoder, samples = setup
    engine = Engine(model)
    prompt = prompt_of(encoder, samples[0])
    req = GenRequest(prompt, n=4, max_new_tokens=10, temperature=1.0, seed=3)
    first = run(engine, encoder, [req])
    assert [(r.request, r.sample) for r in first] == [(0, s) for s in range(4)]
    open_pull(engine, encoder)
    id, pieces, streamed = engine.add(req), [], None
    while streamed is None:
        for o in engine.step():
            pieces.append(o.new_tokens)
            streamed = o.results if o.finished else None
    assert len([p for p in pieces if any(p)]) > 1  # streamed over several sync points
    assert all(sum((list(p[r.sample]) for p in pieces), []) == r.tokens.tolist() for r in first)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(streamed, first))
    again = run(engine, encoder, [req])
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, again))
    assert len({tuple(r.tokens.tolist()) for r in first}) > 1  # the 4 samples differ
    other = run(engine, encoder, [GenRequest(prompt, n=4, max_new_tokens=10, temperature=1.0, seed=4)])
    assert [r.tokens.tolist() for r in other] != [r.tokens.tolist() for r in first]


def test_rollout_logprobs_with_filters_match_trainer(setup):
    model, encoder, samples = setup
    prompts = collate([encode_prompt(encoder, samples[i]) for i in range(3)], encoder.pad_id, left_pad=True)
    cfg = RolloutConfig(group_size=3, max_new_tokens=10, temperature=0.8, top_k=40, top_p=0.8)
    engine = Engine(model)
    rollout = generate_groups(engine, encoder, prompts, [1, 1, 1], cfg)
    assert engine.plan.group == 3  # GRPO's groups decode on GroupCache (one copy of each prompt's KV)
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, rollout, cfg.temperature)
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)
    banned = set(vision_token_ids(encoder))
    assert not banned & set(rollout.response_ids[mask].tolist())


def test_rollout_through_fewer_slots_samples_the_same_tokens(setup):
    """rollout.max_slots: 4 prompts x 2 samples through 2 decode slots (a prompt's pair joins when
    the previous pair's slots free up) sample exactly what all 8 at once do, one prefill per prompt."""
    from vlforge.config import ConfigError

    model, encoder, samples = setup
    prompts = collate([encode_prompt(encoder, samples[i]) for i in range(4)], encoder.pad_id, left_pad=True)
    cfg = RolloutConfig(group_size=2, max_new_tokens=12, temperature=1.0, top_k=20)
    engine = Engine(model)
    at_once = generate_groups(engine, encoder, prompts, [1] * 4, cfg, seed=11)
    assert engine.stats.prefills == 1
    cfg.max_slots = 2
    queued = generate_groups(engine, encoder, prompts, [1] * 4, cfg, seed=11)
    assert engine.stats.prefills == 4  # one pair at a time
    assert torch.equal(queued.response_ids, at_once.response_ids)
    assert torch.equal(queued.response_mask, at_once.response_mask)
    torch.testing.assert_close(queued.logprobs, at_once.logprobs, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="rollout.max_slots=3 is below rollout.group_size=4"):
        RolloutConfig(group_size=4, max_slots=3)


def test_greedy_rollout_equals_transformers_generate(setup):
    """A greedy rollout's G samples of each prompt are transformers' own greedy generate of it (the
    same left-padded batch, the same never-generated ids), token for token up to its end token."""
    model, encoder, samples = setup
    prompts = collate([encode_prompt(encoder, samples[i]) for i in range(3)], encoder.pad_id, left_pad=True)
    cfg = RolloutConfig(temperature=0.0, max_new_tokens=8)
    ours = generate_groups(Engine(model), encoder, prompts, [1, 1, 1], cfg)
    with torch.no_grad():
        out = model.generate(**prompts, max_new_tokens=8, do_sample=False, pad_token_id=encoder.pad_id,
                             eos_token_id=encoder.end_ids, suppress_tokens=never_generated(encoder, model))
    theirs = out[:, prompts["input_ids"].shape[1]:]
    assert ours.response_ids.shape[0] == 3 * cfg.group_size
    for n in range(ours.response_ids.shape[0]):
        length = int(ours.response_mask[n].sum())
        assert length > 0 and torch.equal(ours.response_ids[n, :length], theirs[n // cfg.group_size, :length]), n


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    assert counts[expected == 0].sum() == 0  # a token the distribution excludes was never drawn
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.9)])
def test_sampling_distribution(top_k, top_p):
    """20,000 draws (one per noise row) from a 6-token distribution: a chi-square statistic far
    below the 0.1% critical value of its degrees of freedom, and banned/filtered tokens
    never drawn. The draws are deterministic (fixed keys): this cannot flake."""
    n, T = 20000, 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    probs = torch.softmax(logits / T, -1)
    if top_k:
        probs[probs.argsort(descending=True)[top_k:]] = 0
    if top_p < 1:
        order = probs.argsort(descending=True)
        drop = probs[order].cumsum(0) - probs[order] > top_p
        probs[order[drop]] = 0
    probs = probs / probs.sum()
    keys = torch.tensor([row_key(11, r) for r in range(n)])
    mode = "filter" if top_k or top_p < 1 else "sample"
    tok, logp = sample(logits.expand(n, -1), torch.full((n,), T), torch.full((n,), top_k), torch.full((n,), top_p),
                       keys, torch.zeros(n, dtype=torch.long), mode)
    dof = int((probs > 0).sum()) - 1
    critical = {4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}[dof]  # chi-square 0.1% points
    assert _chi_square(tok, probs) < critical
    torch.testing.assert_close(logp, torch.log_softmax(logits / T, -1)[tok])
    # the step counter moves the noise too: step 1 draws other tokens than step 0 for the same rows
    tok1, _ = sample(logits.expand(n, -1), torch.full((n,), T), torch.full((n,), top_k), torch.full((n,), top_p),
                     keys, torch.ones(n, dtype=torch.long), mode)
    assert (tok1 != tok).float().mean() > 0.3
    assert _chi_square(tok1, probs) < critical


def test_two_level_inverse_cdf_draws_the_full_vocabulary_inverse_cdf():
    """The block-then-token inverse CDF picks the token a float64 cumulative sum over the whole
    vocabulary picks at the same u (but where u sits within rounding of a boundary), never a
    token of zero probability: rows with -inf runs, a row whose mass is in one entry of the last
    block, a row with one finite entry in the first."""
    torch.manual_seed(0)
    S, V = 4000, 1024  # 8 blocks of 128
    x = torch.randn(S, V) * 3
    x[::3, 100:700] = float("-inf")
    x[1, :] = float("-inf")
    x[1, V - 1] = 0.0
    x[2, 1:] = float("-inf")
    u = torch.rand(S) * (1 - 2**-24)
    tok, lse = inverse_cdf(x, u)
    assert torch.isfinite(x.gather(1, tok[:, None])).all()
    assert tok[1] == V - 1 and tok[2] == 0
    cdf = torch.softmax(x.double(), -1).cumsum(-1)
    want = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True)[:, 0]
    assert (tok == want).float().mean() > 0.999
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))
    # u at 1 (the top of its range) and entries whose probability underflows fp32: never one of them
    sharp = torch.randn(3, V) / 0.01
    tok, _ = inverse_cdf(sharp, torch.ones(3))
    assert (torch.softmax(sharp, -1).gather(1, tok[:, None]) > 0).all()
    # the largest hash maps below 1 (24 bits of it rounded to exactly 1.0 in fp32)
    assert unit_interval(torch.tensor([2**32 - 1]))[0] < 1
    # a target at the total (fp32 rounding of a sum can put it there) takes the last possible entry
    cdf = torch.tensor([[0.2, 0.5, 0.5], [0.2, 0.5, 0.9]])
    possible = torch.tensor([[True, True, False], [True, True, True]])
    assert _first_above(cdf, torch.tensor([0.5, 0.3]), possible).tolist() == [1, 1]


@pytest.mark.parametrize("share_prompt", [False, True])
def test_one_compile_serves_every_slot_bucket(setup, monkeypatch, share_prompt):
    """The compiled decode step compiles once for every bucket: a first step over all slots, then
    smaller buckets, then a call of one row (run at 2 slots); the KV buffers reallocated longer and
    the longest bucket as long as the buffers. The traced code's guards decide recompiles whatever
    the backend, so the test compiles with backend="aot_eager" and runs the steps without CUDA
    graphs on the CPU; only the sampling mode (a Python string) compiles `_pick` again. With
    share_prompt (GroupCache: 2 samples a request) the same holds over group buckets 4 and 2
    (8 and 4 slots); the one-row request then takes the SlotCache step, compiled once more."""
    from torch._dynamo.utils import counters

    model, encoder, samples = setup
    buckets = set()
    engine = compiled_on_cpu(Engine(model, compile=True, share_prompt=share_prompt), monkeypatch, buckets)
    requests = [GenRequest(prompt_of(encoder, samples[i]), n=2, max_new_tokens=5 + 10 * i, temperature=1.0, seed=1,
                           first_row=2 * i) for i in range(3)]
    graphs = counters["stats"]["unique_graphs"]
    compiled = run(engine, encoder, requests, stop_ids=[])  # every row to its max_new_tokens
    # slots 8 (the buffers' size), then fewer; GroupCache: 4 groups, then 2 (a compiled step's least)
    assert buckets == ({8, 4} if share_prompt else {8, 4, 2})
    assert engine.plan.group == (2 if share_prompt else 0) and engine.stats.compactions > 0
    run(engine, encoder, requests[:1], stop_ids=[])
    long = GenRequest(prompt_of(encoder, samples[1]), n=2, max_new_tokens=120, temperature=1.0, seed=2)
    run(engine, encoder, [long], stop_ids=[])  # its rows cross from the 128- into the 256-token length bucket
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the layers once, _pick once
    run(engine, encoder, [GenRequest(prompt_of(encoder, samples[0]), max_new_tokens=4)])  # one row, greedy
    assert 1 not in buckets
    assert counters["stats"]["unique_graphs"] - graphs == (4 if share_prompt else 3)
    eager = run(Engine(model, share_prompt=False), encoder, requests, stop_ids=[])
    for a, b in zip(compiled, eager):
        assert torch.equal(a.tokens, b.tokens)


def test_a_decode_step_that_does_not_compile_as_one_graph_runs_eager_with_a_warning(setup, monkeypatch):
    """A hook dynamo cannot trace on the model (here a graph break on the input embeddings) makes
    the compiled step fail under fullgraph: the engine says so once and decodes eager, the same
    tokens as an uncompiled engine, instead of ending the run."""
    model, encoder, samples = setup
    model = copy.deepcopy(model)
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: torch._dynamo.graph_break())
    engine = compiled_on_cpu(Engine(model, compile=True), monkeypatch)
    requests = [GenRequest(prompt_of(encoder, samples[i]), n=2, max_new_tokens=6, temperature=1.0, seed=3)
                for i in range(2)]
    with pytest.warns(RuntimeWarning, match="did not compile as one graph") as caught:
        compiled = run(engine, encoder, requests, stop_ids=[])
        run(engine, encoder, requests, stop_ids=[])
    assert sum("decode_hidden" in str(w.message) for w in caught) == 1  # said once, not every step
    # 2 samples a request: GroupCache's step (decode_hidden_grouped)
    assert engine.runner.compiled.decode_hidden_grouped.compile_failure
    assert engine.compile_failure == engine.runner.compiled.decode_hidden_grouped.compile_failure[0]
    eager = run(Engine(model), encoder, requests, stop_ids=[])
    for a, b in zip(compiled, eager):
        assert torch.equal(a.tokens, b.tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_decode_equals_eager(setup, compiled):
    model, encoder, samples = setup
    model = model.cuda()
    requests = [GenRequest(prompt_of(encoder, samples[i]), max_new_tokens=6 + 5 * i, temperature=t, seed=1,
                           first_row=i) for i in range(5) for t in (0.0, 1.0)]
    graphs = Engine(model, use_graphs=True, compile=compiled)
    with_graphs = run(graphs, encoder, requests, slots=4)
    assert graphs.runner.graphs and graphs.stats.capture_s > 0
    if compiled:  # a 1-row step would compile the layers again (size-1 specialization): never below 2 slots
        assert min(key[0] for key in graphs.stats.graphs) == 2
    eager = run(Engine(model, use_graphs=False), encoder, requests, slots=4)
    for a, b in zip(with_graphs, eager):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_grouped_decode_equals_eager_copies(setup, compiled):
    """GroupCache steps captured as CUDA graphs (and compiled) give the tokens of eager SlotCache
    steps: 5 requests of 3 samples through 2 groups at a time (joins, compaction)."""
    model, encoder, samples = setup
    model = model.cuda()
    requests = [GenRequest(prompt_of(encoder, samples[i]), n=3, max_new_tokens=6 + 5 * i, temperature=t, seed=1,
                           first_row=3 * i) for i, t in zip(range(5), (0.0, 1.0, 1.0, 0.0, 1.0))]
    graphs = Engine(model, use_graphs=True, compile=compiled)
    with_graphs = run(graphs, encoder, requests, slots=6, stop_ids=[])
    assert graphs.plan.group == 3 and graphs.runner.graphs and graphs.stats.prefills > 1
    eager = run(Engine(model, use_graphs=False, share_prompt=False), encoder, requests, slots=6, stop_ids=[])
    for a, b in zip(with_graphs, eager):
        assert torch.equal(a.tokens, b.tokens)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=1e-4)


def test_requests_added_while_a_batch_runs_join_it_and_cancel_frees_the_slot(setup):
    """Requests added while one decodes join its batch and get the tokens they get alone; a cancelled
    one leaves at the next step with a prefix of its tokens; min_new_tokens holds the stop ids back;
    a greedy row keeps its tokens when a sampled request joins; a request too long for the running
    batch waits for the next one while a later short one passes it."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=2)
    reqs = [GenRequest(prompt_of(encoder, samples[0]), max_new_tokens=24, min_new_tokens=24),
            GenRequest(prompt_of(encoder, samples[1]), max_new_tokens=3),
            GenRequest(prompt_of(encoder, samples[2]), max_new_tokens=10, temperature=1.0, seed=5),
            GenRequest(prompt_of(encoder, samples[3]), max_new_tokens=24, min_new_tokens=24),
            GenRequest(prompt_of(encoder, samples[4]), max_new_tokens=300),  # longer than the running batch's KV
            GenRequest(prompt_of(encoder, samples[5]), max_new_tokens=4)]
    alone = [run(engine, encoder, [r], stop_ids=[] if i == 4 else encoder.end_ids)[0].tokens
             for i, r in enumerate(reqs)]
    assert len(alone[0]) == 24  # min_new_tokens: no stop before 24
    open_pull(engine, encoder, slots=4)
    ids, done, order, batches = [engine.add(reqs[0])], {}, [], set()
    for step in range(400):
        if step == 2:
            ids += [engine.add(r) for r in reqs[1:]]
        if step == 6:
            engine.cancel(ids[3])
        batches.add(id(engine._batch))
        for o in engine.step():
            if o.finished:
                done[o.id] = o.results[0]
                order.append(o.id)
        if len(done) == len(ids) == len(reqs):
            break
    for i in (0, 1, 2, 5):
        assert torch.equal(done[ids[i]].tokens, alone[i]), i
    assert 0 < len(done[ids[3]].tokens) < 24 and torch.equal(done[ids[3]].tokens, alone[3][:len(done[ids[3]].tokens)])
    assert order.index(ids[1]) < order.index(ids[0])  # the short request, added late, finished first
    assert order.index(ids[5]) < order.index(ids[0]) < order.index(ids[4])  # 5 passed 4, which waited for a batch
    assert done[ids[4]].tokens.tolist() == alone[4][:len(done[ids[4]].tokens)].tolist()


def test_a_request_that_does_not_fit_is_passed_only_max_passed_times():
    """take_fitting: later requests that fit join past one that does not, until it has been passed
    MAX_PASSED times; then nothing joins (the batch drains for it)."""
    from collections import deque

    from vlforge.generate.batch import MAX_PASSED, take_fitting

    waiting, passed = deque([(0, 500), (1, 5), (2, 6)]), {}
    fits = lambda r: r < 100  # noqa: E731
    assert take_fitting(waiting, fits, passed) == [(1, 5), (2, 6)] and list(waiting) == [(0, 500)]
    for k in range(MAX_PASSED):
        waiting.append((10 + k, 7))
        assert take_fitting(waiting, fits, passed) == [(10 + k, 7)]
    waiting.append((99, 8))
    assert take_fitting(waiting, fits, passed) == [] and list(waiting) == [(0, 500), (99, 8)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compaction_moves_the_tail_into_a_smaller_bucket_without_changing_tokens(setup, device):
    """8 rows in 8 slots, the longest in the last slot: once the 7 short ones finish, compaction
    moves it to slot 0 (bucket 8 -> 1). Every row's tokens, log-probs and streamed pieces are the
    ones it gets without compaction, greedy and sampled (on CUDA: through the captured graphs, whose
    buffers the move writes in place)."""
    model, encoder, samples = setup
    model = model.to(device)
    for temperature in (0.0, 1.0):
        requests = [GenRequest(prompt_of(encoder, samples[i % 4]), max_new_tokens=3 if i < 7 else 20,
                               temperature=temperature, seed=5, first_row=i) for i in range(8)]
        outs = {}
        for compact in (False, True):
            engine = Engine(model, sync_every=2, compact=compact)
            open_pull(engine, encoder, stop_ids=[])
            results = pull_all(engine, requests)  # checks each row's streamed tokens against its result
            outs[compact] = (results, copy.copy(engine.stats))
        (plain, plain_stats), (moved, moved_stats) = outs[False], outs[True]
        assert plain_stats.compactions == 0 and moved_stats.compactions == 1
        assert moved_stats.row_steps < plain_stats.row_steps / 2  # the tail ran 1 row a step, not 8
        for a, b in zip(plain, moved):
            assert torch.equal(a.tokens, b.tokens), temperature
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=1e-6)
        assert [len(r.tokens) for r in moved] == [3] * 7 + [20]


@pytest.mark.gpu
def test_greedy_equals_transformers_generate_on_a_saved_2b_architecture(shapes_dir, tmp_path):
    """The 2B architecture (random weights, fp32, TF32 off), saved as an HF directory and loaded back
    as users load theirs: the engine's greedy tokens (CUDA graphs) equal transformers' generate's."""
    from vlforge.config import ModelConfig
    from vlforge.model.load import load_model

    cuda = torch.device("cuda")
    model, processor = load_model(ModelConfig(preset="qwen3vl-2b"), dtype=torch.float32, device=cuda)
    model.save_pretrained(tmp_path / "2b")
    processor.save_pretrained(tmp_path / "2b")
    del model
    torch.cuda.empty_cache()
    model, processor = load_model(ModelConfig(path=str(tmp_path / "2b")), dtype=torch.float32, device=cuda)
    model.eval()
    data = load_dataset(str(shapes_dir / "train.jsonl"), processor, DataConfig())
    encoder, chosen = data.encoder, data.samples[:4]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        batch = collate([encode_prompt(encoder, s) for s in chosen], encoder.pad_id, left_pad=True)
        batch = {k: v.to(cuda) for k, v in batch.items()}
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=16, do_sample=False, pad_token_id=encoder.pad_id,
                                 eos_token_id=None)
        reference = out[:, batch["input_ids"].shape[1]:].cpu()
        engine = Engine(model, use_graphs=True)
        results = engine.generate([GenRequest(prompt_of(encoder, s), max_new_tokens=16) for s in chosen],
                                  stop_ids=[], banned_ids=[], image_token_id=encoder.image_token_id,
                                  pad_id=encoder.pad_id)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert engine.runner.graphs  # the CUDA-graph decode, as GRPO and serve run it
    assert torch.equal(torch.stack([r.tokens for r in results]), reference)


def test_compaction_with_requests_joining_and_cancelling_moved_rows(setup):
    """The long request's pair is moved from slots 2-3 to 0-1 when the short pair ends; a request added
    after that joins the freed slots and gets its tokens alone; cancelling the moved request ends its
    rows at the next step with a prefix of its tokens alone."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=2)
    short, long, late = (GenRequest(prompt_of(encoder, samples[i]), n=2, max_new_tokens=m, temperature=1.0, seed=9)
                         for i, m in ((0, 3), (1, 30), (2, 6)))
    alone = {name: run(engine, encoder, [r], stop_ids=[]) for name, r in
             (("short", short), ("long", long), ("late", late))}
    open_pull(engine, encoder, slots=4, stop_ids=[])
    ids = {"short": engine.add(short), "long": engine.add(long)}
    by, compactions = {}, []
    for step in range(100):
        if step == 6:
            ids["late"] = engine.add(late)
        if step == 14:
            engine.cancel(ids["long"])
        for o in engine.step():
            by.update({(o.id, r.sample): r for r in o.results})
        compactions.append(engine.stats.compactions)
        if len(by) == 6:
            break
    assert compactions[5] >= 1  # moved before the late request was added
    for name in ("short", "late"):
        for s in range(2):
            assert torch.equal(by[ids[name], s].tokens, alone[name][s].tokens), name
    for s in range(2):
        cut = by[ids["long"], s].tokens
        assert 0 < len(cut) < 30 and torch.equal(cut, alone["long"][s].tokens[:len(cut)])


def open_pull(engine, encoder, **kwargs):
    kwargs.setdefault("stop_ids", encoder.end_ids)
    engine.open(banned_ids=vision_token_ids(encoder), image_token_id=encoder.image_token_id, pad_id=encoder.pad_id,
                **kwargs)


def pull_all(engine, requests, max_steps=200) -> list:
    """add every request, step until all finished: their results in request order (each's samples in turn),
    checking that each row's streamed tokens joined are its result's tokens."""
    ids = [engine.add(r) for r in requests]
    streamed, results = {i: [[] for _ in range(r.n)] for i, r in zip(ids, requests)}, {}
    for _ in range(max_steps):
        for out in engine.step():
            for s, new in enumerate(out.new_tokens):
                streamed[out.id][s] += new
            if out.finished:
                results[out.id] = out.results
        if len(results) == len(ids):
            break
    for i in ids:
        assert [r.tokens.tolist() for r in results[i]] == streamed[i]
    return [res for i in ids for res in results[i]]


def test_add_step_gives_the_tokens_and_logprobs_of_generate(setup):
    """The pull API (add, step until done) against generate on the same requests: greedy and seeded
    sampling, with top-k/top-p, several samples a request, and more samples than slots (joins)."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=3)
    for temperature, top_k in ((0.0, 0), (1.0, 0), (1.0, 5)):
        requests = [GenRequest(prompt_of(encoder, samples[i]), n=1 + i % 3, max_new_tokens=4 + 3 * i,
                               temperature=temperature, top_k=top_k, seed=7, first_row=10 * i) for i in range(5)]
        reference = run(engine, encoder, requests, slots=4)
        open_pull(engine, encoder, slots=4)
        pulled = pull_all(engine, requests)
        assert engine.stats.prefills > 1  # requests joined the running batch
        base = pulled[0].request  # ids count on across the engine's requests
        assert [(r.request - base, r.sample) for r in pulled] == [(r.request, r.sample) for r in reference]
        for a, b in zip(pulled, reference):
            assert torch.equal(a.tokens, b.tokens), (temperature, top_k, a.request, a.sample)
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=1e-5)
            assert a.stopped == b.stopped


def test_a_request_added_while_others_decode_decodes_at_the_next_step(setup):
    """Admission at the next step, not the next sync point: a request added while 8 others decode,
    between two sync points (sync_every=8, 3 steps into the window), with slots free, is prefilled and
    decoding within ONE step() (one decode step), which reports its first tokens; the 8 keep decoding
    in the same batch (no drain). Its tokens are the ones it gets alone."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=8)
    late_request = GenRequest(prompt_of(encoder, samples[5]), max_new_tokens=8, temperature=1.0, seed=3)
    [alone] = run(engine, encoder, [late_request], stop_ids=[])
    open_pull(engine, encoder, slots=16, stop_ids=[])
    running = [engine.add(GenRequest(prompt_of(encoder, samples[i % 4]), max_new_tokens=40)) for i in range(8)]
    engine.step()  # admits the 8 (a step that admits is a sync point: their first tokens)
    for _ in range(3):
        assert engine.step() == []  # between sync points: nothing read back, nothing reported
    steps, batch = engine.stats.steps, engine._batch
    late = engine.add(late_request)
    calls, streamed = 0, []
    while not streamed:
        outputs = {o.id: o for o in engine.step()}
        calls += 1
        streamed = list(outputs[late].new_tokens[0]) if late in outputs else []
    assert calls == 1 and engine.stats.steps - steps == 1  # one step() call, one decode step
    assert engine._batch is batch and not any(o.finished for i, o in outputs.items() if i in running)
    assert streamed == alone.tokens[:2].tolist()  # the prefill's token and the step's
    done = []
    while not done:
        done = [o for o in engine.step() if o.id == late and o.finished]
    assert done[0].results[0].tokens.tolist() == alone.tokens.tolist()


def test_cancel_frees_the_slots_at_the_next_step(setup):
    """cancel(id) of a running request: at the next step its rows leave (result: the tokens streamed so
    far, stopped=False), a waiting request takes its slot in
    that step; cancel of a request still waiting: empty results, never prefilled."""
    model, encoder, samples = setup
    engine = Engine(model, sync_every=2)
    open_pull(engine, encoder, slots=2, stop_ids=[])
    a, b, c, d = (engine.add(GenRequest(prompt_of(encoder, samples[i]), max_new_tokens=20)) for i in range(4))
    first = {o.id: o for o in engine.step()}
    assert set(first) == {a, b} and engine.stats.prefills == 1  # c, d wait: no slot free
    slot_of_a = [slot for slot, (t, _) in engine._batch.sched.occupant.items() if t == a]
    engine.cancel(a)
    engine.cancel(d)
    second = {o.id: o for o in engine.step()}
    assert second[a].cancelled and second[a].finished and not second[a].new_tokens[0]
    [res] = second[a].results
    assert res.tokens.tolist() == list(first[a].new_tokens[0]) and not res.stopped and len(res.tokens) == 2
    assert second[d].cancelled and [len(r.tokens) for r in second[d].results] == [0]
    assert second[c].new_tokens[0] and not second[c].finished  # took a's slot in this same step
    assert [slot for slot, (t, _) in engine._batch.sched.occupant.items() if t == c] == slot_of_a
    assert not second[b].finished and engine.stats.prefills == 2
    engine.cancel(b)
    engine.cancel(c)
    assert all(o.cancelled for o in engine.step()) and engine._batch is None


def test_a_sampling_mode_whose_pick_does_not_compile_runs_eager_alone(monkeypatch):
    """pick compiles one graph a sampling mode: one mode failing (here top-k/top-p filtering, made to
    break the graph) runs that mode eager, the same tokens, while greedy and plain sampling stay compiled."""
    from vlforge.generate import decode, sampling

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"}))
    torch._dynamo.reset()
    drop_mask = sampling.drop_mask

    def breaking_drop_mask(*args):
        torch._dynamo.graph_break()
        return drop_mask(*args)

    monkeypatch.setattr(sampling, "drop_mask", breaking_drop_mask)
    step = decode.CompiledStep()
    S, V = 4, 640
    gen = torch.Generator().manual_seed(0)
    args = (torch.randn(S, V, generator=gen), torch.zeros(V, dtype=torch.bool), torch.zeros(V, dtype=torch.bool),
            torch.zeros(S, dtype=torch.bool), torch.ones(S), torch.full((S,), 20), torch.full((S,), 0.8),
            torch.arange(S), torch.zeros(S, dtype=torch.long))
    with pytest.warns(RuntimeWarning, match="pick, filter"):
        for mode in ("greedy", "filter", "sample", "filter"):
            tok, logp = step.pick(*args, mode)
            eager_tok, eager_logp = decode.pick(*args, mode)
            assert torch.equal(tok, eager_tok) and torch.allclose(logp, eager_logp)
    assert step.pick.eager == {"filter"} and len(step.pick.compile_failure) == 1
    assert step.failure.startswith("filter: ")
