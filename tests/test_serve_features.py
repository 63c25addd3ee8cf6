"""`vlforge serve`'s per-request image resolution, API key, /metrics and shared vision features,
run for real (uvicorn on loopback around the tiny random-weight model, httpx as the client)."""

import logging
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from PIL import Image  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_serve import ScriptedEngine, LiveServer, assert_error, body, data_url, png_bytes, user  # noqa: E402

from vlforge.config import ConfigError  # noqa: E402
from vlforge.data.encode import ImageLimits  # noqa: E402
from vlforge.serve.app import create_app  # noqa: E402
from vlforge.serve.config import API_KEY_ENV, ServeConfig  # noqa: E402
from vlforge.infer.model import InferenceModel, Request  # noqa: E402

KEY = "vlf-test-0123456789abcdef"


@pytest.fixture(scope="module")
def engine():
    return InferenceModel.load("tiny", device="cpu")


def post_together(url: str, payloads: list[dict], headers=None) -> list[dict]:
    """POST every payload at once from its own thread and client; the JSON answers in order."""
    out, errors = [None] * len(payloads), []
    barrier = threading.Barrier(len(payloads))

    def worker(i):
        try:
            with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
                barrier.wait()
                r = c.post("/v1/chat/completions", json=payloads[i])
                assert r.status_code == 200, r.text
                out[i] = r.json()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def scrape(client) -> dict:
    """/metrics as {(sample name, frozenset of labels): value}."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


# ---------------------------------------------------------------------------------- per-request image resolution


@pytest.fixture(scope="module")
def batching_server(engine):
    """A gather window long enough that requests sent together share one batch."""
    app = create_app(engine, ServeConfig(max_batch=8, batch_window_s=0.5, max_tokens=64))
    with LiveServer(app) as s, httpx.Client(base_url=s.url, timeout=120) as c:
        yield s, c


def _image_prompt(url: str, **kw) -> dict:
    return body(user("What colour is the shape?", url), max_tokens=5, min_tokens=5, **kw)


def test_per_request_pixels_set_that_requests_tokens_and_batch_with_others(batching_server, engine):
    server, client = batching_server
    lo, hi = engine.encoder.limits.min_pixels, engine.encoder.limits.max_pixels
    raw = png_bytes((160, 120), color=(20, 160, 90))
    url = data_url(raw)
    image = Image.open(__import__("io").BytesIO(raw)).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]}]
    variants = [{}, {"max_pixels": 64 * 48}, {"min_pixels": 320 * 240}, {"min_pixels": lo, "max_pixels": 96 * 72}]
    expected = [engine.prompt_tokens(Request(messages, [image], image_limits=ImageLimits(
        v.get("min_pixels", lo), v.get("max_pixels", hi), engine.encoder.limits.max_image_pixels))) for v in variants]
    assert len(set(expected)) == len(variants)  # each resolution is a different number of image tokens
    alone = [client.post("/v1/chat/completions", json=_image_prompt(url, **v)).json() for v in variants]
    assert [a["usage"]["prompt_tokens"] for a in alone] == expected
    before = client.get("/health").json()
    together = post_together(server.url, [_image_prompt(url, **v) for v in variants])
    after = client.get("/health").json()
    assert after["batches"] - before["batches"] < len(variants)  # mixed resolutions shared a batch
    for a, t in zip(alone, together):  # each request got its own resolution in the batch too
        assert t["usage"] == a["usage"]
        assert t["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]


def test_prompts_are_prepared_off_the_thread_that_steps_the_engine(batching_server, engine, monkeypatch):
    """The chat template, tokenizer and image processor run in the request's worker thread; the batcher
    thread (the one feeding the GPU) only adds the prepared prompt."""
    server, client = batching_server
    threads, added = [], []
    prepare, add = engine.prepare, engine.add

    def recording_prepare(r):
        threads.append(threading.current_thread().name)
        return prepare(r)

    def recording_add(r, prompt=None):
        added.append(prompt)
        return add(r, prompt)

    monkeypatch.setattr(engine, "prepare", recording_prepare)
    monkeypatch.setattr(engine, "add", recording_add)
    r = client.post("/v1/chat/completions", json=_image_prompt(data_url(png_bytes((96, 64)))))
    assert r.status_code == 200, r.text
    assert len(threads) == 1 and threads[0] != "vlforge-batcher"
    assert len(added) == 1 and added[0] is not None and added[0].pixel_values is not None
    assert r.json()["usage"]["prompt_tokens"] == len(added[0].input_ids)


def test_per_request_pixels_refused_outside_the_servers_bounds(batching_server, engine):
    _, client = batching_server
    lo, hi = engine.encoder.limits.min_pixels, engine.encoder.limits.max_pixels
    url = data_url(png_bytes())
    cases = {
        "zero": ({"max_pixels": 0}, "max_pixels"),
        "not a number": ({"min_pixels": "many"}, "min_pixels"),
        "above the server's max": ({"max_pixels": hi + 1}, "max_pixels"),
        "below the server's min": ({"min_pixels": lo - 1}, "min_pixels"),
        "min above max": ({"min_pixels": 4 * lo, "max_pixels": 2 * lo}, "min_pixels"),
        "max below the server's min": ({"max_pixels": lo - 1}, "max_pixels"),
    }
    for name, (fields, param) in cases.items():
        err = assert_error(client.post("/v1/chat/completions", json=_image_prompt(url, **fields)), 400)
        assert err["param"] == param and param in err["message"], (name, err)
    assert client.post("/v1/chat/completions", json=_image_prompt(url, max_pixels=hi)).status_code == 200


# ---------------------------------------------------------------------------------- a repeated image, encoded once


def _vision_rows(engine):
    """Patch rows the vision tower computes (a hook inside it, after any sharing hook)."""
    seen = []
    handle = engine.model.model.visual.patch_embed.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape[0]))
    return seen, handle


def test_repeated_images_in_a_batch_are_encoded_once(engine):
    red, green = Image.new("RGB", (64, 48), (200, 30, 30)), Image.new("RGB", (40, 40), (0, 90, 30))

    def prompt(n):
        return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": "Colour?"}]}]

    def requests():  # red four times: twice alone, once twice in one request, once at another resolution
        small = ImageLimits(1024, 32 * 32 * 2, engine.encoder.limits.max_image_pixels)
        return [Request(prompt(1), [red], max_new_tokens=6, min_new_tokens=6),
                Request(prompt(3), [green, red.copy(), red], max_new_tokens=6, min_new_tokens=6),
                Request(prompt(1), [red], max_new_tokens=6, min_new_tokens=6, image_limits=small),
                Request(prompt(1), [green], max_new_tokens=6, min_new_tokens=6)]

    patches = [engine.encoder_for(r).pixels([im])["pixel_values"].shape[0] for r in requests() for im in r.images]
    seen, handle = _vision_rows(engine)
    try:
        before = engine.images_shared
        shared = engine.generate(requests())
        assert engine.images_shared - before == 3  # red twice more at full size, green once more
        distinct = patches[0] + patches[1] + patches[4]  # red, green, the small red
        assert seen == [distinct] and distinct < sum(patches)
        seen.clear()
        engine.share_images = False
        plain = engine.generate(requests())
        assert seen == [sum(patches)]
    finally:
        engine.share_images = True
        handle.remove()
    assert [c.text for c in shared] == [c.text for c in plain]  # the same features, so the same greedy tokens
    assert [c.prompt_tokens for c in shared] == [c.prompt_tokens for c in plain]


def test_images_of_distinct_grids_are_never_read_back(engine, monkeypatch):
    """Only images of equal grids can be equal: a call whose images all differ in grid is left alone
    without the patches' device-to-host copy and hash (the copy would wait for every queued decode
    step); one with two images of one grid is still checked, and shares an identical pair."""
    import vlforge.infer.shared_images as shared_images

    hashed = []
    real = shared_images.patch_keys
    monkeypatch.setattr(shared_images, "patch_keys",
                        lambda hidden, grid: hashed.append(len(grid)) or real(hidden, grid))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    sizes = [(64, 48), (40, 40), (32, 64)]
    before = engine.images_shared
    engine.generate([Request(prompt, [Image.new("RGB", size, (200, 30, 30))], max_new_tokens=2) for size in sizes])
    assert hashed == [] and engine.images_shared == before
    same = Image.new("RGB", (40, 40), (0, 90, 30))
    engine.generate([Request(prompt, [im], max_new_tokens=2) for im in (same, same.copy(), Image.new("RGB", (64, 48)))])
    assert hashed == [3] and engine.images_shared == before + 1


def test_repeated_image_over_http_counted_in_metrics(batching_server, engine):
    server, client = batching_server
    url = data_url(png_bytes((64, 64), color=(90, 90, 200)))
    before = scrape(client)
    seen, handle = _vision_rows(engine)
    try:
        post_together(server.url, [_image_prompt(url) for _ in range(3)])
    finally:
        handle.remove()
    after = scrape(client)
    one = engine.encoder.pixels([Image.new("RGB", (64, 64))])["pixel_values"].shape[0]
    assert seen == [one]  # three requests in one batch, one vision pass over one image
    assert value(after, "vlforge_images_shared_total") - value(before, "vlforge_images_shared_total") == 2


# ---------------------------------------------------------------------------------- the API key


@pytest.fixture(scope="module")
def keyed_server(engine):
    app = create_app(engine, ServeConfig(api_key=KEY, max_tokens=64))
    with LiveServer(app) as s:
        yield s


def test_api_key_required_on_every_route_but_health(keyed_server, monkeypatch, caplog):
    import vlforge.serve.app as app_module

    compared = []
    real = app_module.hmac.compare_digest
    monkeypatch.setattr(app_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    caplog.set_level(logging.DEBUG)
    with httpx.Client(base_url=keyed_server.url, timeout=120) as c:
        assert c.get("/health").json()["status"] == "ok"  # probes need no key
        wrong = "vlf-test-0123456789abcdeX"
        for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}, {"Authorization": "Bearer"}):
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/tiny"),
                                 ("GET", "/metrics"), ("GET", "/nowhere")):
                r = c.request(method, path, json=body(max_tokens=2) if method == "POST" else None, headers=headers)
                err = assert_error(r, 401)
                assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer", (path, headers)
                assert KEY not in r.text and wrong not in r.text
        assert compared  # the key was compared (in constant time), not matched with ==
        auth = {"Authorization": f"Bearer {KEY}"}
        r = c.post("/v1/chat/completions", json=body(max_tokens=2), headers=auth)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200  # scheme: any case
        metrics = scrape(httpx.Client(base_url=keyed_server.url, headers=auth))
        assert_error(c.get("/nowhere", headers=auth), 404)  # with the key, routing as usual
    assert value(metrics, "vlforge_http_requests_total", route="/v1/chat/completions", status="401") == 5
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert KEY not in logged and KEY not in repr(ServeConfig(api_key=KEY))


def test_api_key_guards_websockets_and_lets_lifespan_pass():
    """A websocket needs the key as HTTP does (refused before its handshake: the 401 itself where
    the server supports ASGI's denial response, else a close, which the server answers 403); the
    lifespan (startup/shutdown) still reaches the app; an unknown scope type is refused. The
    server has no websocket route: one is added here, as an embedding program might."""
    import asyncio

    from fastapi import WebSocket
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from vlforge.serve.app import RequireKey

    app = create_app(ScriptedEngine(), ServeConfig(api_key=KEY))

    @app.websocket("/v1/realtime")
    async def realtime(ws: WebSocket):
        await ws.accept()
        await ws.send_text("in")
        await ws.close()

    auth = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:  # Starlette's in-process ASGI client: real app, real middleware
        assert app.state.vlforge.batcher._thread.is_alive()  # started by the lifespan, through RequireKey
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            with pytest.raises(WebSocketDenialResponse) as denied, \
                    client.websocket_connect("/v1/realtime", headers=headers):
                pass
            assert denied.value.status_code == 401 and denied.value.json()["error"]["code"] == "invalid_api_key"
        with client.websocket_connect("/v1/realtime", headers=auth) as ws:
            assert ws.receive_text() == "in"
    assert not app.state.vlforge.batcher._thread.is_alive()  # the lifespan's shutdown stopped it

    sent = []

    async def connect_without_denial_responses(scope):
        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            sent.append(message)

        await RequireKey(app, KEY)(scope, receive, send)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [], "query_string": b"", "extensions": {}}
    asyncio.run(connect_without_denial_responses(scope))
    assert sent == [{"type": "websocket.close", "code": 1008}]  # closed before accept: never reached the route
    with pytest.raises(RuntimeError, match="'webtransport'"):
        asyncio.run(connect_without_denial_responses({"type": "webtransport", "path": "/", "headers": []}))


def test_api_key_from_flag_or_environment(monkeypatch, capsys):
    from vlforge.cli import main

    seen = {}
    monkeypatch.setattr("vlforge.serve.app.serve", lambda app, **kw: seen.update(app=app))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert main(["serve", "tiny", "--device", "cpu"]) == 0
    assert seen["app"].state.vlforge.cfg.api_key == "from-env"
    assert main(["serve", "tiny", "--device", "cpu", "--api-key", "from-flag"]) == 0  # the flag wins
    assert seen["app"].state.vlforge.cfg.api_key == "from-flag"
    out = capsys.readouterr()
    assert "API key: required" in out.out and "from-flag" not in out.out + out.err and "from-env" not in out.out
    monkeypatch.delenv(API_KEY_ENV)
    assert main(["serve", "tiny", "--device", "cpu"]) == 0
    assert seen["app"].state.vlforge.cfg.api_key is None
    monkeypatch.setenv(API_KEY_ENV, "")
    assert main(["serve", "tiny", "--device", "cpu"]) == 2  # set but empty: refused, not an open server
    assert f"error: {API_KEY_ENV}:" in capsys.readouterr().err
    for bad in ("", "has space", "caf\u00e9"):
        with pytest.raises(ConfigError, match="--api-key"):
            ServeConfig(api_key=bad)


# ---------------------------------------------------------------------------------- /metrics


def test_metrics_count_requests_tokens_batches_and_latency(batching_server):
    _, client = batching_server
    before = scrape(client)
    plain = client.post("/v1/chat/completions", json=body(max_tokens=4, min_tokens=4)).json()
    with client.stream("POST", "/v1/chat/completions", json=body(max_tokens=3, min_tokens=3, stream=True,
                                                                  stream_options={"include_usage": True})) as r:
        streamed = [line for line in r.iter_lines() if '"usage"' in line]
    assert_error(client.post("/v1/chat/completions", json=body(max_tokens=0)), 400)
    assert_error(client.get("/no/such/route"), 404)
    after = scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    import json
    usage = [plain["usage"], json.loads(streamed[0][len("data: "):])["usage"]]
    assert delta("vlforge_http_requests_total", route="/v1/chat/completions", status="200") == 2
    assert delta("vlforge_http_requests_total", route="/v1/chat/completions", status="400") == 1
    assert delta("vlforge_http_requests_total", route="other", status="404") == 1
    assert delta("vlforge_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert delta("vlforge_completion_tokens_total") == sum(u["completion_tokens"] for u in usage) == 7
    assert delta("vlforge_generations_total", finish_reason="length") == 2
    assert delta("vlforge_batch_size_count") == 2 and delta("vlforge_batch_size_sum") == 2  # one request each
    assert delta("vlforge_request_latency_seconds_count") == 2
    assert delta("vlforge_time_to_first_token_seconds_count") == 2
    assert 0 < delta("vlforge_time_to_first_token_seconds_sum") <= delta("vlforge_request_latency_seconds_sum")
    assert value(after, "vlforge_queue_length") == 0 and value(after, "vlforge_running_requests") == 0


def test_metrics_queue_and_running_while_a_batch_runs():
    engine = ScriptedEngine()
    with LiveServer(create_app(engine, ServeConfig(max_batch=1, batch_window_s=0.0))) as s, \
            httpx.Client(base_url=s.url, timeout=60) as c:
        engine.release.clear()
        payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        threads = [threading.Thread(target=lambda: httpx.post(f"{s.url}/v1/chat/completions", json=payload,
                                                              timeout=60)) for _ in range(2)]
        try:
            threads[0].start()
            assert engine.in_generate.wait(10)
            threads[1].start()
            deadline = time.monotonic() + 10
            while value(m := scrape(c), "vlforge_queue_length") < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert value(m, "vlforge_queue_length") == 1 and value(m, "vlforge_running_requests") == 1
        finally:
            engine.release.set()
            for t in threads:
                t.join(30)
        m = scrape(c)
        assert value(m, "vlforge_queue_length") == 0 and value(m, "vlforge_batch_size_count") == 2
        assert value(m, "vlforge_completion_tokens_total") == 4  # the scripted engine's 2 tokens, twice
