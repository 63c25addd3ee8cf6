"""MoE router replay on CPU with tiny-moe: the rollout's recorded experts, the flip metric, replay in
the trainer's forward and backward, and the config refusals (train/moe.py, generate/routes.py)."""

import contextlib
import copy
from collections import Counter

import pytest
import torch

from vlforge.config import ConfigError, DataConfig, ModelConfig, RolloutConfig, load_config, GRPOConfig
from vlforge.data.dataset import load_dataset
from vlforge.data.encode import collate, encode_prompt
from vlforge.train.moe import Routing, capture, follow, replayed
from vlforge.generate.routes import NO_ROUTE, router_modules
from vlforge.model.load import load_model
from vlforge.generate.engine import Engine
from vlforge.rollout.groups import generate_groups
from vlforge.rollout.logprobs import route_rows, sequence_logprobs


@pytest.fixture(scope="module")
def prompts(tiny_moe, shapes_dir):
    data = load_dataset(str(shapes_dir / "train.jsonl"), tiny_moe[1], DataConfig())
    batch = collate([encode_prompt(data.encoder, data.samples[i]) for i in range(3)], data.encoder.pad_id,
                    left_pad=True)
    return data.encoder, batch


def _rollout(model, prompts, dtype=torch.float32, **kwargs):
    encoder, batch = prompts
    cfg = RolloutConfig(group_size=4, max_new_tokens=8, temperature=1.0, **{"router_replay": "record", **kwargs})
    torch.manual_seed(0)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        return generate_groups(Engine(model), encoder, batch, [1, 1, 1], cfg)


def _perturbed(model, scale: float = 0.1):
    """A copy whose routers moved a little (noise of `scale` x their weights' std): some tokens now
    pick other experts, as a trained policy's would."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, router in router_modules(other):
            router.weight.add_(torch.randn(router.weight.shape, generator=gen) * scale * float(router.weight.std()))
    return other


def _own_routes(model, rollout, dtype=torch.float32):
    """The routers' own top-k experts [L, N * (P + R), k] in the trainer's forward, and its log-probs."""
    routing = Routing.of(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
            capture(routing, None) as routed:
        logp, _ = sequence_logprobs(model, rollout, 1.0)
    routing.remove()
    return torch.stack([routed.logits[i].float().topk(routed.top_k, -1).indices for i in sorted(routed.logits)]), logp


def _checkpointing(model) -> None:
    if hasattr(model, "activation_checkpointing_enable"):  # the name in transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class _ExpertSpy:
    """The expert ids every MoE layer's experts were called with (what the model actually computed)."""

    def __init__(self, model):
        self.seen: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, layer in enumerate(model.model.language_model.layers):
            self.handles.append(layer.mlp.experts.register_forward_pre_hook(
                lambda mod, args, i=i: self.seen.__setitem__(i, args[1].detach().clone())))

    def remove(self):
        for h in self.handles:
            h.remove()


def _stopping(model, prompts):
    """The prompts with a stop token that ends some responses early: one the rollout samples before the
    end of some responses but not all (random weights rarely sample a real end token)."""
    encoder, batch = prompts
    rows = [set(r[:-1].tolist()) for r in _rollout(model, prompts).response_ids]
    counts = Counter(t for r in rows for t in r)
    stop = next(t for t, c in counts.most_common() if c < len(rows))
    stopping = copy.copy(encoder)
    stopping.end_ids = [stop]
    return stopping, batch


def test_recorded_routes_are_the_full_forwards_routes_exactly_in_fp32(tiny_moe, prompts):
    """Every prompt token and every generated token the rollout ran (all but each response's last)
    has its experts recorded, equal (ids and order) to the trainer's full-sequence forward's."""
    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, _stopping(model, prompts))
    L, N, T, k = rollout.routes.shape
    P, R = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    assert (L, N, T, k) == (2, 12, P + R, 2) and rollout.routes.dtype == torch.int16
    # recorded exactly where the rollout ran the token: the prompt, and the response but its last token
    last_NR = torch.zeros_like(rollout.response_mask)
    last_NR[torch.arange(N), rollout.response_mask.sum(1) - 1] = 1
    ran_NT = torch.cat([rollout.prompt_mask[rollout.prompt_of_seq], rollout.response_mask - last_NR], dim=1).bool()
    assert torch.equal(rollout.routes[..., 0] != NO_ROUTE, ran_NT[None].expand(L, -1, -1))
    assert len(set(rollout.response_mask.sum(1).tolist())) > 1  # responses of different lengths
    own, logp = _own_routes(model, rollout)
    recorded = route_rows(rollout, list(range(N)))
    valid = ran_NT.reshape(-1)
    assert torch.equal(recorded[:, valid].long(), own[:, valid])
    mask = rollout.response_mask.bool()
    torch.testing.assert_close(logp[mask], rollout.logprobs[mask], atol=1e-5, rtol=1e-5)


def test_replay_of_the_routers_own_choice_changes_nothing(tiny_moe, prompts):
    """Replayed weights are the router's own output where the ids are its own (its renormalised top-k,
    bit for bit): replaying an unchanged model's routes gives exactly the log-probs of not replaying."""
    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, prompts)
    routing = Routing.of(model)
    rows = route_rows(rollout, list(range(12)))
    with torch.no_grad():
        plain, _ = sequence_logprobs(model, rollout, 1.0)
        with follow(routing, rows, replay=True), capture(routing, None) as routed:
            replay, _ = sequence_logprobs(model, rollout, 1.0)
    assert torch.equal(plain, replay)
    assert routed.flips[1] > 400 and routed.flips[0] == 0  # every recorded (token, layer) pair, none flipped
    # the formula itself, against the router's forward on random states
    router = router_modules(model)[0][1]
    x = torch.randn(50, router.hidden_dim)
    logits, weights, ids = router(x)
    ours = replayed(logits, ids, ids, torch.ones(50, dtype=torch.bool))
    assert torch.equal(ours[0], weights) and torch.equal(ours[1], ids)
    routing.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_makes_the_trainer_run_the_recorded_experts(tiny_moe, prompts, dtype):
    """The policy's routers moved between rollout and training: without replay some (token, layer)
    pairs flip and the log-probs are of other experts; with replay the experts run are exactly the
    recorded ones (the router's own where none was recorded), and the flips are still counted."""
    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, prompts, dtype)
    trainer = _perturbed(model).eval()
    routing = Routing.of(trainer)
    N = rollout.response_ids.shape[0]
    rows = route_rows(rollout, list(range(N)))
    valid = rows[0, :, 0] != NO_ROUTE
    own, _ = _own_routes(trainer, rollout, dtype)
    results = {}
    for replay in (False, True):
        spy = _ExpertSpy(trainer)
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32), \
                follow(routing, rows, replay), capture(routing, None) as routed:
            logp, _ = sequence_logprobs(trainer, rollout, 1.0)
        spy.remove()
        results[replay] = (logp, routed.flips, spy.seen)
    flips, pairs = results[False][1].tolist()
    assert 0 < flips < 0.5 * pairs
    # replayed, they are still counted (a layer's own choice then follows the replayed layers below it)
    assert results[True][1][1] == pairs and results[True][1][0] > 0
    assert pairs == 2 * int(valid.sum())  # (token, layer) pairs: 2 layers
    mask = rollout.response_mask.bool()
    for layer in range(2):
        assert torch.equal(results[False][2][layer], own[layer])  # no replay: the router's own
        expected = torch.where(valid[:, None], rows[layer].long(), own[layer])
        assert torch.equal(results[True][2][layer], expected)  # replay: the recorded ones
    assert not torch.equal(results[False][0][mask], results[True][0][mask])
    routing.remove()


def test_flip_rate_is_logged_once_per_step_and_not_for_recomputation(tiny_moe, prompts):
    """moe/route_flip = flipped pairs / recorded pairs of the forwards inside `capture`; a backward's
    recomputation (gradient checkpointing) replays but is not counted again."""
    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, prompts)
    trainer = _perturbed(model)
    _checkpointing(trainer)
    trainer.train()
    routing = Routing.of(trainer)
    rows = route_rows(rollout, list(range(12)))
    with follow(routing, rows, replay=True):
        with capture(routing, None) as routed:
            logp, _ = sequence_logprobs(trainer, rollout, 1.0)
        logp.sum().backward()
    flips, pairs = routed.flips.tolist()
    assert pairs == 2 * int((rows[0, :, 0] != NO_ROUTE).sum())  # the forward's pairs, once
    row = routing.step_metrics()
    assert row["moe/route_flip"] == pytest.approx(flips / pairs) and 0 < row["moe/route_flip"] < 0.5
    assert routing.step_metrics() == {}  # reset: the next step counts its own
    with capture(routing, None):  # a forward without the rollout's routes logs no flip rate
        with torch.no_grad():
            sequence_logprobs(trainer, rollout, 1.0)
    assert "moe/route_flip" not in routing.step_metrics()
    routing.remove()


def test_the_full_fine_tuning_reference_copy_replays_the_rollouts_experts(tiny_moe, prompts):
    """GRPO's frozen reference (full fine-tuning) is a deepcopy of the policy made after its hooks:
    reference_logprobs with replay runs it on the recorded experts too."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from vlforge.rollout.minibatch import Batch, reference_logprobs

    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, prompts)
    policy = copy.deepcopy(model)
    t = SimpleNamespace(policy=SimpleNamespace(autocast=nullcontext), routing=Routing.of(policy))
    ref = _perturbed(policy).eval()  # its routers would choose otherwise
    batch = Batch(rollout, list(range(4, 12)), torch.zeros(12), None)
    rows = route_rows(rollout, batch.seqs)
    valid = rows[0, :, 0] != NO_ROUTE
    for replay in (False, True):
        spy = _ExpertSpy(ref)
        reference_logprobs(t, ref, batch, 1.0, replay=replay)
        spy.remove()
        same = [torch.equal(spy.seen[i][valid], rows[i][valid].long()) for i in range(2)]
        assert all(same) == replay
    t.routing.remove()


def test_gradient_reaches_a_trained_router_and_checkpointing_replays_too(tiny_moe, prompts):
    """With replay the router still gets its gradient (through its probabilities of the replayed
    experts), and gradient checkpointing's recomputation in backward takes the same experts: the
    gradients equal those without checkpointing."""
    model = copy.deepcopy(tiny_moe[0]).eval()
    rollout = _rollout(model, prompts)
    rows = route_rows(rollout, list(range(12)))
    grads = []
    for checkpointing in (False, True):
        trainer = _perturbed(model)
        if checkpointing:
            _checkpointing(trainer)
        trainer.train()
        routing = Routing.of(trainer)
        with follow(routing, rows, replay=True):
            logp, _ = sequence_logprobs(trainer, rollout, 1.0)
            (logp * rollout.response_mask).sum().backward()
        routing.remove()
        grads.append({n: p.grad.clone() for n, p in trainer.named_parameters() if p.grad is not None})
    router_grads = [n for n in grads[0] if n.endswith("mlp.gate.weight")]
    assert len(router_grads) == 2 and all(grads[0][n].abs().sum() > 0 for n in router_grads)
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7, msg=n)


def test_replay_on_a_dense_model_or_the_hf_loop_is_a_config_error(tiny, shapes_dir, tmp_path):
    from test_grpo import grpo_config
    from vlforge.generate.engine import Engine
    from vlforge.generate.requests import GenRequest, Prompt
    from vlforge.recipes.grpo import run_grpo

    with pytest.raises(ConfigError, match="rollout.router_replay=True: the model \\(tiny\\) is dense"):
        run_grpo(grpo_config(shapes_dir, tmp_path / "run", tmp_path, "rollout.router_replay=true"))
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="tools.names with rollout.router_replay=record"):
        load_config(GRPOConfig, None, ["rollout.router_replay=record", "tools.names=[calculator]"])
    with pytest.raises(ConfigError, match="router_replay"):
        load_config(GRPOConfig, None, ["rollout.router_replay=always"])
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        Engine(tiny[0]).generate([GenRequest(Prompt(torch.tensor([1, 2, 3])))], stop_ids=[], banned_ids=[],
                                 image_token_id=0, pad_id=0, record_routes=True)


@pytest.mark.parametrize("replay,packing", [("record", "true"), ("true", "true"), ("true", "false")])
def test_grpo_step_with_router_replay_logs_the_flip_rate(shapes_dir, tmp_path, replay, packing):
    """The recipe end to end: routes recorded, followed in the update (and, replayed, in the LoRA
    reference's forward), moe/route_flip in metrics.jsonl; before the first update the ratio is 1.
    Padded and packed update rows (rl.packing): the routes follow the row's token order (a
    misaligned route would flip and move the ratio)."""
    import json

    from test_grpo import grpo_config
    from vlforge.recipes.grpo import run_grpo

    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "model.preset=tiny-moe", "tiers.method=lora",
                      "tiers.language.experts=true", "rl.kl_beta=0.1", f"rollout.router_replay={replay}",
                      "rl.mini_batch_size=8", f"rl.packing={packing}")
    run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] > 0
    assert row["moe/route_flip"] == 0.0  # fp32, one mini-batch before any update: the trainer's own experts
    assert row["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and row["kl"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_grpo_update_replays_the_rollouts_experts_where_the_router_would_choose_others(shapes_dir, tmp_path,
                                                                                      monkeypatch, packing):
    """The recipe with rollout.router_replay=true and a trained router: after the first mini-batch's
    optimizer step the trainer's routers pick other experts for some recorded tokens (own != recorded),
    and every forward that follows the rollout's routes (the update's, checkpointing's recomputation)
    hands the experts exactly the recorded ids there. Seen by two hooks that only record, one before
    the replay hook (the router's own choice) and one after it (what the experts get)."""
    import json

    from test_grpo import grpo_config
    from vlforge.recipes import grpo as recipe

    forwards = []  # (own, used, recorded, valid) per router call inside `follow`
    follow = recipe.follow

    @contextlib.contextmanager
    def spy(routing, routes, replay):
        handles = []
        if routing is not None and routes is not None:
            for layer, router in routing.routers:
                recorded = routes[routing.layers.index(layer)]
                seen = {}
                handles.append(router.register_forward_hook(
                    lambda m, a, out, seen=seen: seen.__setitem__("own", out[2].clone()), prepend=True))
                handles.append(router.register_forward_hook(
                    lambda m, a, out, seen=seen, recorded=recorded: forwards.append(
                        (seen["own"], out[2].clone(), recorded.long(), recorded[:, 0] != NO_ROUTE))))
        try:
            with follow(routing, routes, replay):
                yield
        finally:
            for h in handles:
                h.remove()

    monkeypatch.setattr(recipe, "follow", spy)
    cfg = grpo_config(shapes_dir, tmp_path / "run", tmp_path, "model.preset=tiny-moe", "tiers.method=lora",
                      "tiers.language.router=true", "tiers.language.lr=0.02", "rollout.router_replay=true",
                      "rl.mini_batch_size=2", f"rl.packing={packing}", "train.seed=1")
    recipe.run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["moe/route_flip"] > 0  # counted against the routers' own choice
    assert forwards
    flipped = 0
    for own, used, recorded, valid in forwards:
        assert torch.equal(used[valid], recorded[valid])  # the rollout's experts ran
        assert torch.equal(used[~valid], own[~valid])  # the router's own where nothing was recorded
        flipped += int((own[valid].sort(-1).values != recorded[valid].sort(-1).values).any(-1).sum())
    assert flipped > 0  # and there the router chose otherwise: replay changed what ran


def _engine_routes(model, prompts, **engine_kwargs):
    from vlforge.generate.engine import Engine
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, prompts_of_batch

    encoder, batch = prompts
    requests = [GenRequest(p, n=2, max_new_tokens=6 + 3 * b, temperature=1.0, seed=3, first_row=2 * b)
                for b, p in enumerate(prompts_of_batch(batch, [1, 1, 1]))]
    engine = Engine(model, **engine_kwargs)
    results = engine.generate(requests, stop_ids=encoder.end_ids, banned_ids=vision_token_ids(encoder),
                              image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, slots=4,
                              record_routes=True)
    assert all(r.routes.shape[1] == len(requests[r.request].prompt.input_ids) + len(r.tokens) - 1 for r in results)
    return engine, results


def test_a_decode_step_that_did_not_record_is_an_error_not_stale_routes(tiny_moe, prompts, monkeypatch):
    """Code compiled before the router hooks existed would never call them (torch.compile does not
    guard on hooks): the engine then says so instead of handing back routes it never wrote."""
    from contextlib import nullcontext

    from vlforge.generate.routes import recorder_of

    model = copy.deepcopy(tiny_moe[0]).eval()
    monkeypatch.setattr(recorder_of(model), "write_to", lambda *args: nullcontext())
    with pytest.raises(RuntimeError, match="did not record its routes.*rollout.compile=false"):
        _engine_routes(model, prompts, use_graphs=False)


@pytest.mark.slow
def test_compiled_decode_step_traces_the_recording_hooks(tiny_moe, prompts, monkeypatch):
    """torch.compile of the decode step (fullgraph: the hooks trace, no graph break) records the
    routes the eager step records (aot_eager: the same tracing as inductor, no code generation)."""
    from vlforge.generate import decode as decode_module

    model = copy.deepcopy(tiny_moe[0]).eval()
    model.set_experts_implementation("batched_mm")  # the eager experts' loop over hit experts does not trace whole
    _, eager = _engine_routes(model, prompts, use_graphs=False)
    compiled = torch.compile(decode_module.decode_hidden, backend="aot_eager", dynamic=True, fullgraph=True)
    monkeypatch.setattr(decode_module, "decode_hidden", compiled)
    _, traced = _engine_routes(model, prompts, use_graphs=False)
    for a, b in zip(eager, traced):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routes, b.routes)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_engine_compiled_recording_step_compiles_once(tiny_moe, prompts, monkeypatch, share_prompt):
    """The engine's own compiled step (static shapes but the marked sizes) while recording routes:
    one compile across slot buckets 4 and 2 (GroupCache: group buckets 4 and 2 = slots 8 and 4) and a
    longer KV buffer, the hooks' row and routes tensors marked dynamic too (unmarked, each bucket
    compiled the language model again)."""
    from torch._dynamo.utils import counters

    from helpers import compiled_on_cpu
    from vlforge.generate.engine import Engine
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, prompts_of_batch

    model = copy.deepcopy(tiny_moe[0]).eval()
    model.set_experts_implementation("batched_mm")  # the eager experts' loop over hit experts does not trace whole
    encoder, batch = prompts
    engine = compiled_on_cpu(Engine(model, compile=True, share_prompt=share_prompt), monkeypatch, buckets := set())
    graphs = counters["stats"]["unique_graphs"]
    for new_tokens in (6, 200):  # the second call reallocates the KV buffers (and routes) longer
        requests = [GenRequest(p, n=2, max_new_tokens=new_tokens + 3 * b, temperature=1.0, seed=3, first_row=2 * b)
                    for b, p in enumerate(prompts_of_batch(batch, [1, 1, 1]))]
        engine.generate(requests, stop_ids=[], banned_ids=vision_token_ids(encoder),
                        image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, slots=8 if share_prompt else 4,
                        record_routes=True)
        assert engine.plan.group == (2 if share_prompt else 0)
    assert ({8, 4} if share_prompt else {4, 2}) <= buckets
    assert counters["stats"]["unique_graphs"] - graphs == 2  # the layers once, _pick once


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graph_decode_records_the_eager_routes(tiny_moe, prompts, compiled):
    """The decode step captured as a CUDA graph (and compiled) writes each step's experts at the
    rows' own positions: the routes equal the eager step's (fp32: batched_mm experts, capturable in
    any dtype; grouped_mm is in bf16 only, below), across sync points and joins."""
    model = load_model(ModelConfig(preset="tiny-moe", experts_implementation="batched_mm"), device="cuda")[0].eval()
    encoder, batch = prompts
    on_gpu = (encoder, {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})
    graphs, with_graphs = _engine_routes(model, on_gpu, use_graphs=True, compile=compiled)
    assert graphs.runner.graphs and graphs.stats.capture_s > 0
    _, eager = _engine_routes(model, on_gpu, use_graphs=False)
    for a, b in zip(with_graphs, eager):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routes, b.routes)


@pytest.mark.gpu
def test_grouped_mm_experts_capture_in_bf16_and_decode_eagerly_in_fp32(prompts):
    """grouped_mm experts: captured as CUDA graphs in bf16 (its kernel's dtype); in fp32 torch's
    fallback reads the group offsets on the host, so the engine decodes eagerly instead of failing."""
    model = load_model(ModelConfig(preset="tiny-moe"), device="cuda")[0].eval()  # auto: grouped_mm on CUDA
    encoder, batch = prompts
    on_gpu = (encoder, {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})
    fp32, results = _engine_routes(model, on_gpu)
    assert not fp32.runner.graphs and len(results) == 6
    bf16, results = _engine_routes(model.to(torch.bfloat16), on_gpu)
    assert bf16.runner.graphs and bf16.stats.capture_s > 0 and len(results) == 6


@pytest.mark.gpu
def test_moe_with_the_eager_expert_loop_decodes_without_cuda_graphs(tiny_moe, prompts):
    """transformers' reference loop over experts syncs with the host every layer, which a CUDA graph
    cannot capture: the engine runs such a model's decode steps eagerly instead of failing."""
    model = copy.deepcopy(tiny_moe[0]).eval().cuda()  # loaded on the CPU: experts_implementation eager
    encoder, batch = prompts
    on_gpu = (encoder, {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()})
    engine, results = _engine_routes(model, on_gpu)
    assert not engine.runner.graphs and len(results) == 6


def test_compaction_moves_recorded_routes_with_their_rows(tiny_moe, prompts):
    """Rows moved into lower slots (Scheduler._compact: the long request's pair in slots 2-3 moves to
    0-1 once the short one's pair is done) keep their recorded experts: the same routes, tokens and
    log-probs as without compaction."""
    from vlforge.generate.engine import Engine
    from vlforge.generate.forward import vision_token_ids
    from vlforge.generate.requests import GenRequest, prompts_of_batch

    model = copy.deepcopy(tiny_moe[0]).eval()
    encoder, batch = prompts
    short, long = prompts_of_batch(batch, [1, 1, 1])[:2]
    requests = [GenRequest(short, n=2, max_new_tokens=3, temperature=1.0, seed=3),
                GenRequest(long, n=2, max_new_tokens=14, temperature=1.0, seed=3, first_row=2)]
    outs = {}
    for compact in (False, True):
        engine = Engine(model, sync_every=2, compact=compact)
        results = engine.generate(requests, stop_ids=[], banned_ids=vision_token_ids(encoder),
                                  image_token_id=encoder.image_token_id, pad_id=encoder.pad_id, record_routes=True)
        outs[compact] = (results, engine.stats.compactions)
    (plain, none), (moved, some) = outs[False], outs[True]
    assert none == 0 and some == 1
    for a, b in zip(plain, moved):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.routes, b.routes)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-6, rtol=1e-6)
    assert [len(r.tokens) for r in moved] == [3, 3, 14, 14]
