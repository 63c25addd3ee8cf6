"""Persistent compile caches under VLFORGE_CACHE (train/runtime.use_compile_caches): a second process
compiling the same graph loads it from there (torch's FX-graph cache), the commands that compile set
it at start and say where, and `vlforge doctor` shows it with its size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A process as a vlforge command starts one: vlforge's imports (which import torch._dynamo), then the
# caches set (unless VLFORGE_TEST_NO_CACHES), then a real torch.compile (Inductor, C++ on the CPU)
SCRIPT = """
import json, os, torch
import vlforge.cli
from vlforge.train.runtime import use_compile_caches
if not os.environ.get("VLFORGE_TEST_NO_CACHES"):
    use_compile_caches()
from torch._dynamo.utils import counters

@torch.compile
def f(x):
    return torch.nn.functional.gelu(x @ x.T).sum(-1) * 3 + 1

f(torch.randn(16, 16))
print(json.dumps({"hit": counters["inductor"]["fxgraph_cache_hit"], "miss": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _compile_in_a_process(cache: Path, *, feature: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(VLFORGE_CACHE=str(cache), PYTHONPATH=str(ROOT))
    if not feature:
        env["VLFORGE_TEST_NO_CACHES"] = "1"
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_its_compiled_graph_from_vlforge_cache(tmp_path):
    cache = tmp_path / "cache"
    first = _compile_in_a_process(cache)
    assert (first["hit"], first["miss"]) == (0, 1)  # a fresh directory: compiled, not found elsewhere
    assert list((cache / "inductor").rglob("*")), "nothing written under VLFORGE_CACHE"
    second = _compile_in_a_process(cache)
    assert second["hit"] >= 1 and second["miss"] == 0
    off = tmp_path / "off"
    _compile_in_a_process(off, feature=False)  # torch's own default directory instead
    assert not off.exists() or not any(off.rglob("*"))


def test_the_commands_that_compile_set_the_caches_and_say_where(tmp_path, monkeypatch, capsys):
    from vlforge.cli import main

    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(var, "")  # restored after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("VLFORGE_CACHE", str(tmp_path / "c"))
    # a command that stops before running anything (here: the config is refused) sets them all the same
    assert main(["sft", "configs/demo-sft.yaml", "train.batch_size=0"]) == 2
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "c" / "triton")
    out = capsys.readouterr()
    assert f"compile caches: {tmp_path / 'c'} (VLFORGE_CACHE" in out.out and "compile caches" not in out.err
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's own wins
    assert main(["sft", "configs/demo-sft.yaml", "--print-config"]) == 0
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert "compile caches" not in capsys.readouterr().out  # --print-config prints the config alone


def test_doctor_shows_the_cache_and_its_size(tmp_path):
    from vlforge.doctor.environment import cache_checks

    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor" / "graph").write_bytes(b"x" * 2_500_000)
    [check] = cache_checks({"VLFORGE_CACHE": str(tmp_path)})
    assert check.detail == f"{tmp_path} (2.5 MB)" and check.values["bytes"] == 2_500_000
    assert "delete the directory" in check.advice
