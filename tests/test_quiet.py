"""What a user sees when things are normal: a run contacts no network and prints only vlforge's own
lines and warnings that ask the user to act (no library notices, deprecations or false alarms)."""

import importlib.util
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from vlforge.config import GRPOConfig, OptimConfig, load_config
from vlforge.train.optim import build_scheduler

ROOT = Path(__file__).parents[1]

# A vlforge command in a fresh process, as a user runs it, recording every attempt to reach the network
# (audit events fire before the name lookup or connect: an attempt counts with or without a network).
# Then the lookup bitsandbytes makes at its import on CPUs with AVX512-BF16 (its CPU 4-bit kernel, from
# the Hub through `kernels`) is made again by hand, so the test means the same on any CPU.
CLI = """
import json, sys
attempts = []
sys.addaudithook(lambda event, args: attempts.append(f"{event} {args[0]!r}")
                 if event in ("socket.connect", "socket.getaddrinfo") else None)
from vlforge.cli import main
code = main(sys.argv[2:])
try:
    from kernels import get_kernel
    get_kernel("kernels-community/quantization-bitsandbytes", version=1)
except Exception:
    pass
import huggingface_hub.constants as hub
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "attempts": attempts, "offline": hub.is_offline_mode(),
               "bitsandbytes": "bitsandbytes" in sys.modules}, f)
"""


def run_cli(tmp_path: Path, *args: str) -> tuple[dict, str]:
    """(what the process recorded, its stderr) for `vlforge ARGS` with the Hub's offline switches unset,
    as in a user's shell (conftest sets HF_HUB_OFFLINE for the test process itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    done = subprocess.run([sys.executable, "-c", CLI, str(report), *args], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert report.exists(), done.stderr
    return json.loads(report.read_text()), done.stderr


@pytest.fixture(scope="module")
def lora_run(shapes_dir, tmp_path_factory):
    """A one-step LoRA SFT run of the tiny model (peft imports bitsandbytes), then its export merged."""
    tmp = tmp_path_factory.mktemp("quiet")
    (tmp / "lora.yaml").write_text("model: {preset: tiny}\ntiers: {method: lora}\nprecision: {mode: fp32}\n")
    sft = run_cli(tmp, "sft", str(tmp / "lora.yaml"), f"data.train={shapes_dir / 'train.jsonl'}", "data.val=null",
                  "train.device=cpu", "train.max_steps=1", "train.batch_size=4", f"train.output_dir={tmp / 'run'}",
                  "log.progress=false")
    export = run_cli(tmp, "export", str(tmp / "run" / "checkpoint-1"), "--out", str(tmp / "merged"), "--merge",
                     "--device", "cpu")
    return {"sft": sft, "export": export}


@pytest.mark.parametrize("command", ["sft", "export"])
def test_a_model_load_with_bitsandbytes_installed_contacts_no_network(lora_run, command):
    if importlib.util.find_spec("bitsandbytes") is None:  # the `quant` extra (in `test`) brings it
        pytest.skip("bitsandbytes is not installed: the import that asked the Hub does not happen")
    report, stderr = lora_run[command]
    assert report["code"] == 0, stderr
    assert report["bitsandbytes"], "bitsandbytes was not imported: the test would prove nothing"
    assert report["offline"]  # the Hub client is offline for the rest of the process: nothing asks it
    assert report["attempts"] == []


@pytest.mark.parametrize("command", ["sft", "export"])
def test_a_normal_lora_run_and_export_print_nothing_on_stderr(lora_run, command):
    """No bitsandbytes hub-kernel notice, no transformers FutureWarning (peft's is_gradient_checkpointing):
    a normal run's stderr holds only what asks the user to act, and this one has nothing to ask."""
    report, stderr = lora_run[command]
    assert report["code"] == 0, stderr
    for library_line in ("gemm_4bit_forward", "kernels-community", "trust_remote_code", "FutureWarning",
                         "is_gradient_checkpointing"):
        assert library_line not in stderr, stderr
    assert stderr == "", stderr


def test_the_users_own_hub_setting_is_kept(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE set by the user (here 0: they allow the network) is theirs: vlforge sets it only when unset."""
    code = ("import os, huggingface_hub.constants as hub; from vlforge.model.quiet import offline_and_quiet; "
            "offline_and_quiet(); print(os.environ['HF_HUB_OFFLINE'], hub.is_offline_mode())")
    for given, expected in (("0", "0 False"), (None, "1 True")):
        env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
        env.update({"PYTHONPATH": str(ROOT)}, **({"HF_HUB_OFFLINE": given} if given is not None else {}))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == expected, done.stderr


# ---------------------------------------------------------------------------------- the schedule


FLAT_REWARD = "def flat(completion, answer, **row):\n    return 1.0\n"


def test_a_grpo_step_that_trains_no_group_gives_no_scheduler_warning(shapes_dir, tmp_path):
    """Every group's rewards tie (a flat reward) and dynamic sampling drops such groups: the step trains
    none and makes no optimizer update, the schedule still advances (it counts batches), and torch's
    "lr_scheduler.step() before optimizer.step()" would be a false alarm."""
    from vlforge.recipes.grpo import run_grpo

    (tmp_path / "rewards.py").write_text(FLAT_REWARD)
    cfg = load_config(GRPOConfig, None, [
        "model.preset=tiny", f"data.train={shapes_dir / 'train.jsonl'}", "data.val=null", "precision.mode=fp32",
        "train.device=cpu", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1", "log.progress=false",
        "rollout.group_size=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=3", "rl.mini_batch_size=4",
        f"rl.rewards=[{{name: '{tmp_path / 'rewards.py'}:flat'}}]", "rl.dynamic_sampling=true",
        "rl.max_sampling_tries=1", "optim.schedule=constant"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_grpo(cfg)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["groups_trained"] == 0  # the case itself: no optimizer step this step
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]


def test_a_warmup_longer_than_the_run_is_warned_about(capsys):
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())
    build_scheduler(optimizer, OptimConfig(warmup_steps=50), total_steps=3)
    err = capsys.readouterr().err
    assert err.startswith("warning: optim.warmup_steps=50 is more than this run's 3 steps") and "6%" in err, err
    for warmup in (0, 3):  # a warmup that fits says nothing
        build_scheduler(optimizer, OptimConfig(warmup_steps=warmup), total_steps=3)
        assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------- serve


class BurstEngine:
    """Stands in for InferenceModel's pull API: the first step streams "Hel", the next waits for
    `burst`, then hands over 50 pieces at once and the answer."""

    name = "burst"

    def __init__(self):
        self.burst, self.emitted = threading.Event(), threading.Event()
        self.steps: dict[int, int] = {}  # id -> steps taken

    def min_prompt_tokens(self, messages):
        return 0

    def prompt_tokens(self, request):
        return 3

    def open(self, slots):
        pass

    def prepare(self, request):
        return None

    def add(self, request, prompt=None):
        self.steps[len(self.steps)] = 0
        return len(self.steps) - 1

    def cancel(self, id):
        pass

    def step(self):
        from vlforge.infer.model import Completion
        from vlforge.infer.streamer import TextOutput

        out = []
        for id, n in [(id, n) for id, n in self.steps.items() if n < 2]:
            self.steps[id] = n + 1
            if n == 0:
                out.append(TextOutput(id, "Hel"))
                continue
            assert self.burst.wait(30)
            out += [TextOutput(id, "lo") for _ in range(49)]
            out.append(TextOutput(id, "lo", Completion("Hel" + "lo" * 50, 3, 51, "stop")))
            self.emitted.set()
        return out


def test_a_client_leaving_mid_stream_leaves_no_asyncio_send_noise_in_the_log(caplog):
    """The client resets its connection while 50 pieces of text are queued for it (the event loop held
    meanwhile, as a busy loop falls behind a fast decode): the stream writes once more and the
    disconnect cancels it; asyncio's "socket.send() raised exception." (logged from the 5th write to a
    lost connection within one turn of the loop) is never logged."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from test_serve import LiveServer

    from vlforge.serve.app import create_app

    engine = BurstEngine()
    caplog.set_level(logging.WARNING, logger="asyncio")
    with LiveServer(create_app(engine)) as live:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
                           "stream": True}).encode()
        client = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])), timeout=30)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b'"Hel"' not in seen:
            seen += client.recv(65536)
        loop = live.server.servers[0].get_loop()
        held = threading.Event()
        loop.call_soon_threadsafe(lambda: (held.set(), engine.emitted.wait(30)))  # the loop busy until the burst
        assert held.wait(10)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # linger 0: a reset, as from a client that was killed or timed out
        engine.burst.set()  # the 50 pieces queue up while the loop is held; then it runs again
        with httpx.Client(base_url=live.url, timeout=30) as c:  # answered after the loop has run the stream
            deadline = time.monotonic() + 30
            while (health := c.get("/health").json())["running"] or health["requests"] < 1:
                assert time.monotonic() < deadline, health
                time.sleep(0.05)
    noise = [r.getMessage() for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
    assert noise == []
