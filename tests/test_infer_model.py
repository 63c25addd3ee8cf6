"""infer/serve on generate/'s engine: the same greedy answers as transformers' own generate, and
continuous batching over real loopback HTTP (a short request joins a long one's
batch and answers first, with the tokens it gets alone)."""

import json
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from PIL import Image  # noqa: E402
from test_serve import LiveServer, body, data_url, png_bytes, user  # noqa: E402

from vlforge.serve.app import create_app  # noqa: E402
from vlforge.serve.config import ServeConfig  # noqa: E402
from vlforge.infer.model import InferenceModel, Request  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    return InferenceModel.load("tiny", device="cpu", dtype=torch.float32)


def _msg(text: str, images: int = 0) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}]


def _requests() -> list[Request]:
    red, noise = Image.new("RGB", (64, 48), (200, 30, 30)), Image.effect_noise((40, 56), 60).convert("RGB")
    return [Request(_msg("hi"), max_new_tokens=10),
            Request(_msg("What colour is the shape in the picture?", 1), [red], max_new_tokens=5),
            Request(_msg("Describe both pictures in detail, please.", 2), [noise, red], max_new_tokens=8,
                    min_new_tokens=8),
            Request(_msg("and a longer question with no image at all, to pad the batch", 0), max_new_tokens=9,
                    stop=["zz"])]


def test_greedy_batch_equals_transformers_generate(engine):
    """Requests of different prompt lengths, images and max tokens in one batch: generate/'s engine
    gives the text and finish reason transformers' generate gives each request alone."""
    from helpers import transformers_answers

    ours = engine.generate(_requests())
    assert [(c.text, c.finish_reason) for c in ours] == transformers_answers(engine, _requests())
    assert len({c.completion_tokens for c in ours}) > 1 and ours[2].completion_tokens == 8


def test_sampled_and_greedy_requests_share_one_decode_batch(engine):
    """A greedy request keeps its answer next to sampled ones (one batch, per-row sampling), and a
    seeded sampled request reproduces."""
    greedy = Request(_msg("hi"), max_new_tokens=10, min_new_tokens=10)
    alone = engine.generate([greedy])[0]

    def sampled():
        return Request(_msg("tell me"), max_new_tokens=10, min_new_tokens=10, temperature=1.0, top_p=0.9, seed=7)

    mixed = engine.generate([sampled(), greedy, sampled()])
    assert mixed[1].text == alone.text
    assert mixed[0].text == mixed[2].text == engine.generate([sampled()])[0].text


class Gate:
    """A hook on the model's first decoder layer: once armed, at the third call (the long request's
    prefill and two decode steps ran) it says so (`decoding`) and holds the decode until the server
    has another request waiting, so that request surely arrives while the long one still decodes
    (no timing assumptions). Then, while `slow`, each step takes 10 ms longer: the short answer's
    trip back to its client has a margin of the long one's remaining ~60 steps."""

    def __init__(self, batcher):
        self.batcher, self.armed, self.slow, self.calls, self.held = batcher, False, False, 0, False
        self.decoding = threading.Event()

    def __call__(self, module, args):
        if self.slow:
            time.sleep(0.01)
        if not self.armed:
            return
        self.calls += 1
        if self.calls >= 3:
            self.decoding.set()
            deadline = time.monotonic() + 60
            while self.batcher.waiting == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            self.held, self.armed = self.batcher.waiting > 0, False


@pytest.fixture(scope="module")
def gated_server(engine):
    app = create_app(engine, ServeConfig(max_batch=4, batch_window_s=0.0, max_tokens=64))
    gate = Gate(app.state.vlforge.batcher)
    handle = engine.model.model.language_model.layers[0].register_forward_pre_hook(gate)
    try:
        with LiveServer(app) as s:
            yield s, gate
    finally:
        handle.remove()


def _content(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if isinstance(e, dict) and e["choices"])


def test_short_request_joins_a_running_batch_and_answers_first(gated_server):
    server, gate = gated_server
    long_body = body(user("Tell me a long story about a red square.", data_url(png_bytes())), max_tokens=64,
                     min_tokens=64)
    short_body = body(user("hi"), max_tokens=2)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        alone_long = c.post("/v1/chat/completions", json=long_body).json()["choices"][0]["message"]["content"]
        alone_short = c.post("/v1/chat/completions", json=short_body).json()["choices"][0]["message"]["content"]
        before = c.get("/health").json()
        order, short = [], {}

        def send_short():
            assert gate.decoding.wait(60)  # the long answer is decoding: the short one arrives now
            with httpx.Client(base_url=server.url, timeout=120) as other:
                short["r"] = other.post("/v1/chat/completions", json=short_body).json()
            order.append("short")

        events, thread = [], threading.Thread(target=send_short)
        gate.armed = gate.slow = True
        thread.start()
        with c.stream("POST", "/v1/chat/completions", json={**long_body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        order.append("long")
        gate.slow = False
        thread.join(60)
        after = c.get("/health").json()
    assert gate.held  # the long answer was still decoding when the short request arrived
    assert order == ["short", "long"]  # the short request did not wait for the long one's batch
    assert short["r"]["choices"][0]["message"]["content"] == alone_short  # the same greedy tokens as alone
    assert short["r"]["usage"]["completion_tokens"] == 2
    assert _content(events) == alone_long  # streamed text == the final text alone
    assert after["max_batch_seen"] >= 2 and after["batches"] - before["batches"] == 2  # joined, not queued
    assert after["running"] == 0 and after["queue"] == 0


def test_seed_reproduces_a_sampled_answer_over_http(engine):
    with LiveServer(create_app(engine, ServeConfig(batch_window_s=0.0))) as s, \
            httpx.Client(base_url=s.url, timeout=120) as c:
        def ask(seed):
            payload = body(user("Tell me anything."), max_tokens=12, min_tokens=12, temperature=1.0, seed=seed)
            r = c.post("/v1/chat/completions", json=payload)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        first = ask(1234)
        assert ask(1234) == first
        assert len({first, ask(1), ask(2), ask(3)}) > 1  # other seeds draw other answers


def test_lora_checkpoint_and_nf4_model_answer_as_transformers_generate(shapes_dir, tmp_path):
    """generate/'s engine runs transformers' layers, so a LoRA checkpoint (peft's injected layers)
    and an NF4 language model (bitsandbytes' linears) answer as transformers generate does."""
    from helpers import tiny_sft_config, transformers_answers

    from vlforge.config import QuantConfig
    from vlforge.recipes.sft import run_sft

    run_sft(tiny_sft_config(shapes_dir, tmp_path / "run", "tiers.method=lora", "tiers.language.lr=0.02",
                            "train.max_steps=1", "data.val=null"))
    asks = [Request(_msg("what colour?"), max_new_tokens=6), Request(_msg("hi"), max_new_tokens=4)]
    for source, quant, dtype in ((tmp_path / "run" / "checkpoint-1", None, torch.float32),
                                 ("tiny", QuantConfig.from_flag("nf4"), torch.bfloat16)):
        e = InferenceModel.load(str(source), quant=quant, device="cpu", dtype=dtype)
        assert (e.quant_report is not None) == (quant is not None)
        assert e.gen_engine().use_graphs is None  # NF4 (REPLAYABLE_QUANT) decodes under CUDA graphs on a GPU
        ours = [e.generate([a])[0].text for a in asks]
        assert ours == [text for text, _ in transformers_answers(e, asks)], source


def test_which_quantized_weights_decode_under_cuda_graphs():
    from vlforge.infer.model import unreplayable_quant

    assert unreplayable_quant(None) == [] == unreplayable_quant({"linears": {"language:nf4": 4, "experts:nf4": 2,
                                                                             "vision:none": 3}})
    assert unreplayable_quant({"linears": {"language:int8": 4, "projector:fp8": 2, "vision:none": 3}}) == [
        "fp8", "int8"]


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["nf4", "int8", "fp8"])
def test_serve_captures_cuda_graphs_only_for_quantized_weights_verified_to_replay(method):
    """Serve's own engine on a quantized language model (a batch of four with images): a method
    verified to replay from CUDA graphs (infer/model.REPLAYABLE_QUANT: nf4) captures its decode
    steps, the others (int8, fp8) decode eagerly; every request is answered within its limits.

    The tokens are not compared with an eager run's: quantized decoding of the random tiny model is
    not run-to-run deterministic on a GPU (two eager runs of one engine setting gave different greedy
    texts, nf4 and int8, fp32 and bf16: H100, 2026-12-07), so such an equality was a coin toss (the
    xfail(strict=False) this replaces passed either way). Forcing graphs on int8 fails the capture."""
    from vlforge.config import QuantConfig
    from vlforge.infer.model import REPLAYABLE_QUANT

    e = InferenceModel.load("tiny", quant=QuantConfig(language=method), device="cuda", dtype=torch.bfloat16)
    requests = _requests()
    done = e.generate(requests)
    assert bool(e.gen_engine().runner.graphs) == (method in REPLAYABLE_QUANT), e.gen_engine().runner.graphs
    for r, c in zip(requests, done):
        assert r.min_new_tokens <= c.completion_tokens <= r.max_new_tokens and c.finish_reason in ("stop", "length")
        assert c.prompt_tokens == e.prompt_tokens(r)


def drive(vlm, first, on_done, more=None, slots=4, on_error=None):
    """The server's loop over the pull API (serve/batcher.py's shape, without HTTP): add `first`, then
    step; after each step, whatever `more()` returns is added (a request that cannot be prepared goes
    to `on_error`); `on_done(request, completion)` as each finishes. Returns when nothing runs."""
    vlm.open(slots)
    live = {}

    def add(requests):
        for r in requests:
            try:
                live[vlm.add(r)] = r
            except Exception as e:
                if on_error is None:
                    raise
                on_error(r, e)

    add(first)
    while live:
        for o in vlm.step():
            if o.completion is not None:
                on_done(live.pop(o.id), o.completion)
        add(more() if more is not None else [])


def test_a_request_too_long_for_the_running_cache_does_not_hold_up_short_ones():
    """A 300-token request joining a call sized for 20 waits for the next call, but the short one
    queued behind it passes it and finishes while the first request still decodes."""
    from vlforge.infer.model import InferenceModel, Request

    engine = InferenceModel.load("tiny", device="cpu")
    msgs = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    late = [Request(msgs("second one, long"), max_new_tokens=300, min_new_tokens=300),
            Request(msgs("third short"), max_new_tokens=3)]
    calls, order = {"n": 0}, []

    def more():
        calls["n"] += 1
        return late if calls["n"] == 2 else []

    drive(engine, [Request(msgs("hi"), max_new_tokens=40, min_new_tokens=40)],
                               lambda r, c: order.append((r.messages[0]["content"], c.completion_tokens)),
                               more=more, slots=4)
    assert order == [("third short", 3), ("hi", 40), ("second one, long", 300)]


def test_a_joining_request_that_cannot_be_prepared_fails_alone():
    from vlforge.infer.model import InferenceModel, Request

    engine = InferenceModel.load("tiny", device="cpu")
    msgs = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    bad = Request([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}], max_new_tokens=3)
    calls, done, errors = {"n": 0}, [], []

    def more():
        calls["n"] += 1
        return [bad] if calls["n"] == 1 else []  # an image placeholder without its image

    drive(engine, [Request(msgs("hi"), max_new_tokens=12, min_new_tokens=12)],
                               lambda r, c: done.append(c.completion_tokens), more=more, slots=4,
                               on_error=lambda r, e: errors.append(r))
    assert done == [12] and errors == [bad]


def _prefilled(monkeypatch, engine) -> list:
    """Records the max_new_tokens of every request generate/'s engine prefills (a spy on the real _prefill)."""
    gen, seen = engine.gen_engine(), []
    real = gen._prefill
    monkeypatch.setattr(gen, "_prefill", lambda admitted, *a: seen.extend(r.max_new_tokens for _, r, _ in admitted)
                        or real(admitted, *a))
    return seen


def test_a_request_cancelled_while_queued_in_a_feed_is_never_prefilled(monkeypatch):
    """A request finished before a call takes it, and one finished while it waits in the feed
    (passed over: too long for the running cache), leave with empty results, never prefilled."""
    from vlforge.generate.requests import GenRequest

    engine = InferenceModel.load("tiny", device="cpu")
    prefilled = _prefilled(monkeypatch, engine)
    prompt = engine.prepare(Request(_msg("hi")))
    gen = engine.gen_engine()
    gen.open(stop_ids=engine.end_ids, banned_ids=engine.banned_ids(), image_token_id=engine.encoder.image_token_id,
             pad_id=engine.encoder.pad_id)
    gone = gen.add(GenRequest(prompt, max_new_tokens=7))
    kept = gen.add(GenRequest(prompt, max_new_tokens=5, min_new_tokens=5))
    gen.cancel(gone)  # the client left before the first step
    out = {}
    while len(out) < 2:
        out.update({o.id: o.results for o in gen.step() if o.finished})
    assert {id: len(r.tokens) for id, [r] in out.items()} == {gone: 0, kept: 5}
    assert prefilled == [5]

    prefilled.clear()
    msgs = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    late = Request(msgs("second one, long"), max_new_tokens=300, min_new_tokens=300)  # waits: the cache is for 40
    calls, done = {"n": 0}, []

    def more():
        calls["n"] += 1
        if calls["n"] == 3:  # it has waited in the feed for a sync point: now its client leaves
            late.cancelled.set()
        return [late] if calls["n"] == 2 else []

    drive(engine, [Request(msgs("hi"), max_new_tokens=40, min_new_tokens=40)],
                               lambda r, c: done.append((r.messages[0]["content"], c.completion_tokens,
                                                         c.finish_reason)), more=more, slots=4)
    assert done == [("second one, long", 0, "cancelled"), ("hi", 40, "length")]
    assert prefilled == [40]  # the long one was never prefilled


def test_an_answered_request_is_not_kept_while_the_call_goes_on(monkeypatch):
    """A continuous call runs as long as requests keep coming (a busy server): once a request is
    answered, neither its Request (images) nor the engine's GenRequest (pixel values) stays alive."""
    import gc
    import weakref


    engine = InferenceModel.load("tiny", device="cpu")
    fed = []

    gen = engine.gen_engine()
    add = gen.add
    monkeypatch.setattr(gen, "add", lambda request: fed.append(weakref.ref(request)) or add(request))
    red = Image.new("RGB", (64, 48), (200, 30, 30))
    short = [Request(_msg("What colour?", 1), [red], max_new_tokens=2)]
    asked = weakref.ref(short[0])
    alive, done = [], []

    def more():  # at each sync point, after the short one is answered: is anything of it still held?
        if done == ["short"]:
            gc.collect()
            alive.append((asked() is not None, fed[1]() is not None))
        return [short.pop()] if short else []

    drive(engine, [Request(_msg("hi"), max_new_tokens=24, min_new_tokens=24)],
                               lambda r, c: done.append("short" if r.images else "long"), more=more, slots=4)
    assert done == ["short", "long"] and alive and not any(a or b for a, b in alive), alive


def test_a_long_feed_keeps_nothing_of_the_answered_requests(engine, monkeypatch):
    """A busy server's continuous call never ends while requests keep coming: after N answered
    requests, neither generate/'s engine (its GenResults: tokens, log-probs) nor the serve engine's
    per-row bookkeeping holds more than the rows still running."""
    import gc
    import weakref

    import vlforge.generate.scheduler as gen_scheduler

    results, streamers = [], []

    class TrackedResult(gen_scheduler.GenResult):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            results.append(weakref.ref(self))

    monkeypatch.setattr(gen_scheduler, "GenResult", TrackedResult)
    streamers.append(engine._streamer)
    total, slots = 24, 4
    sent, done, held = [0], [], []

    def more():  # one arrival per sync point, up to `total`; meanwhile: what is still held?
        if done and len(done) % 6 == 0:
            gc.collect()
            held.append((len(done), sum(r() is not None for r in results),
                         max(len(getattr(s, name)) for s in streamers for name in ("rows", "text", "count", "done"))))
        if sent[0] == total:
            return []
        sent[0] += 1
        return [Request(_msg(f"question {sent[0]}"), max_new_tokens=3, min_new_tokens=3)]

    drive(engine, [Request(_msg("first"), max_new_tokens=3, min_new_tokens=3)],
                               lambda r, c: done.append(c.completion_tokens), more=more, slots=slots)
    assert done == [3] * (total + 1)
    assert held and max(n for n, _, _ in held) >= total // 2, held
    assert all(alive <= slots and rows <= slots for _, alive, rows in held), held  # not growing with the answers


def test_compile_warms_every_sampling_mode_so_requests_compile_nothing(monkeypatch):
    """--compile: warm_up compiles the decode step once and each sampling mode's pick once, at the
    server's slot count, so that the requests after it (greedy, sampled, top-p, of other lengths)
    trace nothing more; their answers are the uncompiled engine's. Compiled here with the aot_eager
    backend, steps run one by one (tests/helpers.compiled_on_cpu): dynamo's guards decide recompiles
    whatever the backend."""
    from helpers import compiled_on_cpu
    from torch._dynamo.utils import counters

    warm = InferenceModel.load("tiny", device="cpu", dtype=torch.float32, compile=True)
    assert "only on CUDA" in warm.compile_problem() and warm.warm_up(slots=4) is None  # on the CPU: nothing to do
    compiled_on_cpu(warm.gen_engine(), monkeypatch)
    monkeypatch.setattr(warm, "compile_problem", lambda: None)
    graphs = counters["stats"]["unique_graphs"]
    assert warm.warm_up(slots=4) > 0
    assert counters["stats"]["unique_graphs"] - graphs == 4  # the layers once, _pick per mode (3)
    assert warm.gen_engine().runner.cache.slots == 4

    def requests():
        return [Request(_msg("hi"), max_new_tokens=12, min_new_tokens=12),
                Request(_msg("a sampled answer, please"), max_new_tokens=7, temperature=1.0, seed=5),
                Request(_msg("and a filtered one"), max_new_tokens=9, temperature=0.8, top_p=0.9, seed=6),
                # past the warm-up's 128-token length bucket: a longer span of the cache, no new compile
                Request(_msg("a much longer prompt than the warm-up's " * 20), max_new_tokens=5, temperature=1.0,
                        seed=7)]

    graphs = counters["stats"]["unique_graphs"]
    ours = warm.generate(requests())
    assert counters["stats"]["unique_graphs"] == graphs  # nothing traced after the warm-up
    plain = InferenceModel.load("tiny", device="cpu", dtype=torch.float32).generate(requests())
    assert [(c.text, c.completion_tokens) for c in ours] == [(c.text, c.completion_tokens) for c in plain]
    assert ours[0].completion_tokens == 12 and ours[3].prompt_tokens > 128


def test_compile_flag_says_why_it_does_not_apply_on_the_cpu(capsys):
    from vlforge.cli import main

    assert main(["infer", "tiny", "--device", "cpu", "--prompt", "hi", "--max-new-tokens", "2", "--compile"]) == 0
    assert "--compile: not applied (the decode step is compiled only on CUDA" in capsys.readouterr().err


def test_serve_compiles_by_default_where_it_applies_and_says_what_it_chose(capsys, monkeypatch):
    """serve's load: no flag means compile where it applies (here the CPU: eager, and why); --no-compile
    means eager and nothing said; infer, chat and eval compile only when asked. Where it applies (the
    check answered for a GPU here), the default compiles and warms the decode step at serve's batch."""
    import argparse

    from vlforge.commands.inference import load_model

    def args(flag):
        return argparse.Namespace(source="tiny", quant=None, device="cpu", min_pixels=None, max_pixels=None,
                                  compile=flag)

    vlm = load_model(args(None), slots=4, compile_by_default=True)
    assert not vlm.compile and "decode step: eager (the decode step is compiled only on CUDA" in capsys.readouterr().err
    vlm = load_model(args(False), slots=4, compile_by_default=True)
    assert not vlm.compile and "compile" not in capsys.readouterr().err
    assert not load_model(args(None), slots=4).compile  # infer / chat / eval
    warmed = []
    monkeypatch.setattr(InferenceModel, "compile_problem", lambda self: None)
    monkeypatch.setattr(InferenceModel, "warm_up", lambda self, slots: warmed.append(slots) or 1.0)
    vlm = load_model(args(None), slots=4, compile_by_default=True)
    assert vlm.compile and warmed == [4] and "decode step compiled and warmed" in capsys.readouterr().err


def test_a_grpo_checkpoint_serves_tool_images_at_its_rollout_limit(tmp_path):
    """InferenceModel.load takes a GRPO checkpoint's tools.image_max_pixels from its run's
    config.yaml (a tool message's images are then resized as the rollout resized them); a GRPO run
    without tools, an SFT run's checkpoint, a preset or a directory without a run has none."""
    from vlforge.config import GRPOConfig, SFTConfig, dump_config, load_config
    from vlforge.infer.model import trained_tool_image_limit

    for kind, cls, extra in (("grpo", GRPOConfig, ["tools.names=[zoom_in]", "tools.image_max_pixels=8192"]),
                             ("plain", GRPOConfig, ["tools.image_max_pixels=8192"]), ("sft", SFTConfig, [])):
        (tmp_path / kind / "checkpoint-1").mkdir(parents=True)
        cfg = load_config(cls, None, ["model.preset=tiny", f"train.output_dir={tmp_path / kind}", *extra])
        (tmp_path / kind / "config.yaml").write_text(dump_config(cfg))
    assert trained_tool_image_limit(tmp_path / "grpo" / "checkpoint-1") == 8192
    assert trained_tool_image_limit(tmp_path / "plain" / "checkpoint-1") is None  # no tools: no tool images
    assert trained_tool_image_limit(tmp_path / "sft" / "checkpoint-1") is None
    assert trained_tool_image_limit(tmp_path / "elsewhere") is None


# ops whose result the host must read from the device (on a GPU each waits for the queued decode steps)
_HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.masked_scatter.default", "aten.masked_scatter_.default"}


def test_a_join_prefills_its_image_prompt_without_reading_the_device(engine, monkeypatch):
    """A request joining running rows: its prefill's language-model forward (image features placed,
    deepstack features added, attention masked) runs no op that reads a device value on the host
    (an .item(), a boolean-mask index): the places and the padding come from the host copies. Two
    prompts of different lengths joining together (a padded batch) too; the answers equal each alone."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from vlforge.generate import runner

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            bool_index = str(func) in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default") \
                and any(t is not None and t.dtype == torch.bool for t in args[1])
            if str(func) in _HOST_READS or bool_index:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    reads, forwards = HostReads(), []
    forward_shared = runner.forward_shared

    def recorded(*args, **kwargs):
        forwards.append(kwargs.get("placeholders") is not None)
        with reads:
            return forward_shared(*args, **kwargs)

    red, noise = Image.new("RGB", (64, 48), (200, 30, 30)), Image.effect_noise((40, 56), 60).convert("RGB")
    joining = [Request(_msg("What colour is the shape?", 1), [red], max_new_tokens=4),
               Request(_msg("Describe the picture in detail, please, and at length.", 1), [noise], max_new_tokens=4)]
    alone = [engine.generate([r])[0].text for r in joining]
    engine.open(4)
    running = engine.add(Request(_msg("hi"), max_new_tokens=12, min_new_tokens=12))
    engine.step()
    monkeypatch.setattr(runner, "forward_shared", recorded)
    ids = {engine.add(r): i for i, r in enumerate(joining)}
    answers = {}
    while len(answers) < len(joining) + 1:
        for o in engine.step():
            if o.completion is not None:
                answers[o.id] = o.completion.text
    assert forwards == [True] and reads.seen == []  # one prefill for both, on host facts only
    assert [answers[id] for id in ids] == alone and running in answers
