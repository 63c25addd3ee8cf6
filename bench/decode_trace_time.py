"""How long torch.compile's tracing of the engine's decode step takes (dynamo + AOT autograd, the
aot_eager backend: no inductor, so it runs on a CPU), for a real-size architecture.

    python bench/decode_trace_time.py --preset qwen3vl-2b --setup bench   # bf16 weights
    python bench/decode_trace_time.py --preset qwen3vl-2b --setup grpo    # fp32 masters, bf16 autocast,
                                                                          # gradient checkpointing on
The time printed is the first generate call (4 rows, 3 new tokens), almost all of it the traces of
the decode step and the sampler; on a GPU inductor's code generation comes on top.
"""

import argparse
import json
import time

import torch

from vlforge.config import ModelConfig
from vlforge.generate.engine import Engine
from vlforge.generate.requests import GenRequest, Prompt
from vlforge.model.load import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3vl-2b")
    ap.add_argument("--setup", choices=["bench", "grpo"], default="bench")
    args = ap.parse_args()
    from torch._dynamo.utils import counters

    grpo = args.setup == "grpo"
    dtype = torch.float32 if grpo else torch.bfloat16
    model, _ = load_model(ModelConfig(preset=args.preset), dtype=dtype, device="cpu")
    if grpo:  # what GRPO's full fine-tuning hands the engine (recipes/grpo.py, train/trainable.py)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model.eval()
    compile_ = torch.compile
    torch.compile = lambda fn, **kw: compile_(fn, **{**kw, "backend": "aot_eager"})
    engine = Engine(model, compile=True)
    engine.graphs_on = lambda device: True  # the compiled path, steps run one by one (no CUDA graphs)
    engine.runner.run_steps = lambda plan, S, Lb, mode, steps, stats: [engine.runner.step(plan, S, Lb, mode)
                                                                        for _ in range(steps)]
    request = GenRequest(Prompt(torch.randint(0, 100, (40,))), n=4, max_new_tokens=3, temperature=1.0, seed=1)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=grpo):
        engine.generate([request], stop_ids=[], banned_ids=[], image_token_id=model.config.image_token_id, pad_id=0)
    seconds = round(time.perf_counter() - start, 1)
    print(json.dumps({"preset": args.preset, "setup": args.setup, "first_generate_s": seconds,
                      "frames": dict(counters["frames"]), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
