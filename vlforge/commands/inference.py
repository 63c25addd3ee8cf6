"""`vlforge infer`, `chat`, `eval` and `serve`: a model loaded for answering (infer/model.py), on
the command line, over a dataset, or behind an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from pathlib import Path

from vlforge.commands.base import Command, at_least, non_negative_float
from vlforge.config import ConfigError, GRPOConfig
from vlforge.train.stop import signal_name


def load_model(args, slots=1, compile_by_default: bool = False):
    """The loaded InferenceModel; with --compile (or, `compile_by_default`, without --no-compile: serve)
    its decode step is compiled and warmed now, at `slots` decode slots (the batch its command
    generates: serve's --max-batch, eval's --batch-size; a function of the loaded model: settled from
    its memory). What was chosen, and why, goes to stderr."""
    from vlforge.config import QuantConfig
    from vlforge.infer.model import InferenceModel

    quant = None if args.quant is None else QuantConfig.from_flag(args.quant)  # None: a QLoRA checkpoint's own
    if args.min_pixels is not None and args.max_pixels is not None and args.min_pixels > args.max_pixels:
        raise ConfigError(f"--min-pixels {args.min_pixels} is above --max-pixels {args.max_pixels}")  # before loading
    asked = args.compile  # True (--compile), False (--no-compile) or None (the command's default)
    want = asked if asked is not None else compile_by_default
    vlm = InferenceModel.load(args.source, quant=quant, device=args.device, min_pixels=args.min_pixels,
                              max_pixels=args.max_pixels, compile=want)
    if vlm.quant_report:
        from vlforge.model.quant import format_report

        print(format_report(vlm.quant_report), file=sys.stderr)
    slots = slots(vlm) if callable(slots) else slots
    if want:
        if problem := vlm.compile_problem():
            vlm.compile = False
            print(f"--compile: not applied ({problem}); decoding eager" if asked else
                  f"decode step: eager ({problem})", file=sys.stderr)
        else:
            print("--compile: compiling the decode step (a minute or two; once per process) ...", file=sys.stderr,
                  flush=True)
            seconds = vlm.warm_up(slots)
            if failure := vlm.gen_engine().compile_failure:  # decode.compiled_once warned and runs eager
                print(f"--compile: the decode step did not compile ({failure}); decoding eager", file=sys.stderr)
            else:
                print(f"--compile: decode step compiled and warmed in {seconds:.0f} s", file=sys.stderr)
    return vlm


def serve_batch(cfg, vlm):
    """`cfg` with --max-batch settled for the loaded `vlm`: auto from the GPU's free memory after the
    weights (serve.config.auto_max_batch), said on stderr; a number as given."""
    if cfg.max_batch != "auto":
        return cfg
    import torch

    from vlforge.model.tiers import unwrap
    from vlforge.serve.config import auto_max_batch

    free = torch.cuda.mem_get_info(vlm.device)[0] if vlm.device.type == "cuda" else None
    # the KV cache in bf16, the dtype a CUDA decode computes in (infer/model.py's autocast)
    n, why = auto_max_batch(unwrap(vlm.model).config.text_config, free, cfg, dtype_bytes=2)
    print(why, file=sys.stderr)
    return dataclasses.replace(cfg, max_batch=n)


def model_source_arguments(p: argparse.ArgumentParser, compiles_by_default: bool = False) -> None:
    p.add_argument("source", help="model directory (export output, full checkpoint, released weights), "
                                  "a LoRA checkpoint-STEP directory, or the preset 'tiny'")
    p.add_argument("--quant", choices=["none", "nf4", "int8", "fp8"],
                   help="quantize the language model at load (vision tower and projector stay bf16); default "
                        "none, except a QLoRA checkpoint, which loads on its run's quantized base")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    # serve compiles by default: under load the compiled step served 1.33x the requests/s of the eager
    # one at 32 clients (H200, docs/benchmarks.md, Serving); a one-off infer does not repay the compile
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile generate/'s decode step (CUDA, unquantized; 1.9x faster decode steps for 64 "
                        "rows of the 2B on an H200) and warm it up at start-up, which takes a minute or two; "
                        + ("default on where it applies (--no-compile: eager)" if compiles_by_default else
                           "default off: worth it for chat and long evals"))
    p.add_argument("--min-pixels", type=at_least(1), help="images smaller than this (width x height) are "
                                                           "upscaled; default: the model's preprocessor config")
    p.add_argument("--max-pixels", type=at_least(1), help="images larger than this are downscaled; default: the "
                                                           "model's preprocessor config")


def _infer_arguments(p: argparse.ArgumentParser) -> None:
    model_source_arguments(p)
    p.add_argument("--image", action="append", help="image file (repeat for several)")
    p.add_argument("--video", action="append", help="video file (PyAV: the `video` extra; repeat for several)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--task", choices=["classify", "qa", "describe"], default="qa",
                   help="sets the default --max-new-tokens: 16 / 64 / 512")
    p.add_argument("--max-new-tokens", type=at_least(1))
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")


def cmd_infer(args) -> int:
    from vlforge.recipes.infer import answer

    vlm = load_model(args)
    text = answer(vlm, args.prompt, args.image or [], max_new_tokens=args.max_new_tokens, task=args.task,
                  temperature=args.temperature, on_text=lambda text: print(text, end="", flush=True),
                  video_paths=args.video or [])
    print()
    if not text.strip():  # an empty line alone looks like a broken command
        print("(the model produced no text before its end-of-turn token; a barely trained checkpoint often "
              "does this)", file=sys.stderr)
    return 0


def _chat_arguments(p: argparse.ArgumentParser) -> None:
    model_source_arguments(p)
    p.add_argument("--max-new-tokens", type=at_least(1), default=512)


def cmd_chat(args) -> int:
    from vlforge.recipes.infer import chat

    chat(load_model(args), stream=lambda text: print(text, end="", flush=True), max_new_tokens=args.max_new_tokens)
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    model_source_arguments(p)
    p.add_argument("--data", required=True, help="a dataset with reference answers, in any format training reads "
                   "(JSONL, ShareGPT/LLaVA, OpenAI messages, parquet, a datasets folder: docs/data-formats.md)")
    p.add_argument("--column", action="append", default=[], metavar="FIELD=NAME",
                   help="the dataset's column for FIELD (prompt, answer, images, ...), as data.columns; repeatable")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--max-new-tokens", type=at_least(1),
                   help="default 16; with --rewards-from, the run's (rollout.max_new_tokens with tools, "
                        "else eval.max_new_tokens)")
    p.add_argument("--max-samples", type=at_least(1), help="only the first N rows")
    p.add_argument("--out", help="write the report with every answer to this JSON file")
    p.add_argument("--reward", action="append", default=[], metavar="SPEC",
                   help="also score each answer with this reward function, as GRPO's rl.rewards (a builtin: "
                        "exact_match, choice, numeric, format; or path/to/file.py:function); repeatable: "
                        "the report gives each one's mean")
    p.add_argument("--tool", action="append", default=[], metavar="SPEC",
                   help="answer each prompt as a conversation with this tool, as GRPO's tools.names (a builtin: "
                        "calculator; or path/to/file.py:function); repeatable; --max-new-tokens is then the whole "
                        "response's budget, the answer its last assistant turn")
    p.add_argument("--tool-turns", type=at_least(1),
                   help="assistant turns whose calls run, at most (default 4; with --rewards-from, the run's)")
    p.add_argument("--tool-processes", type=at_least(0),
                   help="0 (default): tool calls on threads; N: in up to N worker processes (tools.processes; "
                        "with --rewards-from, the run's unless given)")
    p.add_argument("--rewards-from", metavar="RUN",
                   help="score with a GRPO run's rl.rewards (names, weights, kwargs) and answer with its "
                        "tools.names and tool settings, as its own evaluation does: the run's config YAML or "
                        "one of its checkpoints")


def _grpo_run(source: str):
    """The GRPO run config `--rewards-from` names: a run's config YAML, or one of its checkpoints."""
    from vlforge.config import load_recipe_config
    from vlforge.model.export import run_config

    path = Path(source)
    if not path.exists():
        raise ConfigError(f"--rewards-from {source}: no such file or directory (a GRPO config YAML or checkpoint)")
    run = run_config(path) if path.is_dir() else load_recipe_config(path)
    if not isinstance(run, GRPOConfig):
        raise ConfigError(f"--rewards-from {source}: an SFT run, which has no rl.rewards; name a GRPO run's config "
                          "or checkpoint, or give --reward specs")
    return run


def cmd_eval(args) -> int:
    from vlforge.config import ToolsConfig
    from vlforge.train.metrics import check_writable, write_json_atomic
    from vlforge.config import DataConfig
    from vlforge.data.sources import check_readable
    from vlforge.recipes.infer import evaluate_dataset
    from vlforge.rl.rewards import RewardSpec

    if args.out:
        check_writable(args.out, "--out")  # before the model loads and every answer is computed
    columns = dict(c.partition("=")[::2] for c in args.column)
    if bad := [c for c in args.column if "=" not in c or not all(c.partition("=")[::2])]:
        raise ConfigError(f"--column {bad[0]}: give FIELD=NAME, e.g. --column prompt=problem")
    check_readable(args.data, cfg=DataConfig(columns=columns))  # any format training reads; before the model loads
    rewards = tools = None
    reward_specs, tool_specs, flag = args.reward, args.tool, "--reward"
    settings = ToolsConfig()  # the tools section: its defaults, or the run's; the flags given override
    max_new_tokens = args.max_new_tokens or 16
    if args.rewards_from:  # the GRPO run's rewards and tools, as its own evaluation scores and answers
        if args.reward or args.tool:
            raise ConfigError("--rewards-from takes the run's rl.rewards and tools.names: leave out --reward and "
                              "--tool (or use those alone)")
        run = _grpo_run(args.rewards_from)
        reward_specs = [RewardSpec(r.name, r.weight, dict(r.kwargs)) for r in run.rl.rewards]
        tool_specs, flag, settings = run.tools.names, f"--rewards-from {args.rewards_from}", run.tools
        # GRPO's evaluation: rollout.max_new_tokens for a conversation with tools, eval.max_new_tokens otherwise
        max_new_tokens = args.max_new_tokens or (run.rollout.max_new_tokens if tool_specs else run.eval.max_new_tokens)
    given = {"turns": args.tool_turns, "processes": args.tool_processes}
    settings = dataclasses.replace(settings, **{k: v for k, v in given.items() if v is not None})
    if tool_specs:  # loaded before the model, as GRPO's tools.names
        from vlforge.tools.registry import load_tools

        try:
            tools = load_tools(tool_specs)
        except ValueError as e:
            raise ConfigError(f"{'--tool' if args.tool else flag}: {e}") from e
    if reward_specs:  # loaded before the model: a typo fails at once
        from vlforge.rl.rewards import build_rewards
        from vlforge.infer.model import InferenceModel
        from vlforge.rl.judge import ModelJudge

        try:  # a judge reward (rl/judge.py) as GRPO builds it; its model loads at first use, on --device
            rewards = build_rewards(reward_specs,
                                    factories={"judge": functools.partial(ModelJudge.from_kwargs, load=InferenceModel.load)})
        except (ValueError, FileNotFoundError, AttributeError, TypeError, ImportError) as e:
            raise ConfigError(f"{flag}: {e}") from e
        for fn in rewards.fns:
            if isinstance(fn, ModelJudge) and fn.device == "auto":
                fn.device = args.device
    vlm = load_model(args, slots=args.batch_size)
    if tools:
        from vlforge.rollout.multiturn import check_tool_template

        check_tool_template(vlm.encoder, "--tool" if args.tool else flag)  # the chat template renders a tool turn
    report = evaluate_dataset(vlm, args.data, batch_size=args.batch_size, max_new_tokens=max_new_tokens,
                              max_samples=args.max_samples, rewards=rewards, tools=tools, tool_settings=settings,
                              data=DataConfig(columns=columns))
    if args.out:
        write_json_atomic(report, args.out)
    tasks = " ".join(f"{k} {v:.3f}" for k, v in report["by_task"].items())
    scores = "".join(f"; {k} {v:.3f}" for k, v in report.get("rewards", {}).items())
    if "tool_calls_mean" in report:
        scores += f"; {report['tool_calls_mean']:.2f} tool calls an answer"
    print(f"accuracy {report['accuracy']:.3f} (n={report['n']}; {tasks}){scores}"
          + (f"; answers in {args.out}" if args.out else ""))
    return 0


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    model_source_arguments(p, compiles_by_default=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    from vlforge.serve.config import ServeConfig, int_or_auto  # no fastapi: the flags and defaults are the config's

    for f in ServeConfig.flags():
        unit, meta = f.metadata.get("unit", 1), f.metadata
        if meta.get("auto"):  # `auto` or a number (--max-batch)
            p.add_argument(meta["flag"], dest=f.name, type=int_or_auto, default=meta["cli_default"],
                           metavar="N|auto", help=f"{meta['help']} (default {meta['cli_default']})")
        elif f.default is None:  # an optional setting: a string, or an int (its annotation is a string: __future__)
            p.add_argument(meta["flag"], dest=f.name, metavar=meta.get("metavar"), help=meta["help"],
                           type=int if str(f.type).startswith("int") else None)
        else:
            default = f.default / unit if unit != 1 else f.default
            p.add_argument(meta["flag"], dest=f.name, type=float if unit != 1 or f.type == "float" else int,
                           default=default,
                           metavar=meta["flag"].lstrip("-").upper().replace("-", "_"),
                           help=f"{meta['help']} (default {default:g})" if unit != 1 else
                           f"{meta['help']} (default {default})")


def cmd_serve(args) -> int:
    try:
        from vlforge.serve.app import create_app, require_uvicorn, serve  # fastapi, prometheus_client
        from vlforge.serve.config import ServeConfig
    except ImportError as e:
        raise ConfigError(f"vlforge serve needs fastapi, uvicorn and prometheus_client ({e.name} is missing): "
                          "pip install 'vlforge[serve]'") from None
    require_uvicorn()  # app.py imports it only where the server runs: say it is missing before the model loads
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: must be 0..65535")
    cfg = ServeConfig.from_flags(vars(args), environ=os.environ)  # checked before the model loads
    settled = []  # --max-batch auto: from the memory left once the weights are on the device

    def slots(vlm) -> int:
        settled.append(serve_batch(cfg, vlm))
        return settled[0].max_batch

    app = create_app(load_model(args, slots=slots, compile_by_default=True), settled[0])
    name = app.state.vlforge.model_name
    if args.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        print(f"warning: listening on {args.host} without authentication; anyone who can reach the port can use "
              "the model (set VLFORGE_API_KEY, or put a proxy with auth in front)", file=sys.stderr)
    print(f"serving {name!r} on http://{args.host}:{args.port}/v1 (POST /v1/chat/completions, GET /v1/models, "
          f"GET /health, GET /metrics); local image files: {cfg.allow_files or 'not allowed'}; API key: "
          f"{'required' if cfg.api_key else 'none'}", flush=True)
    stopped = serve(app, host=args.host, port=args.port)  # uvicorn, draining on shutdown
    if stopped is None:
        return 0
    print(f"vlforge serve: stopped by {signal_name(stopped)} (accepted requests were given up to --drain-timeout "
          "to finish)", file=sys.stderr)
    return 128 + stopped


COMMANDS = [
    Command("infer", "answer one prompt (with images or videos) from a model", _infer_arguments, cmd_infer,
            compiles=True, answers=True),
    Command("chat", "interactive chat with a model (/image PATH, /video PATH, /reset, /quit)", _chat_arguments,
            cmd_chat, compiles=True, answers=True),
    Command("eval", "batched greedy answers + exact-match accuracy on a dataset", _eval_arguments, cmd_eval,
            compiles=True),
    Command("serve", "OpenAI-compatible HTTP server (chat completions, streaming, batching)", _serve_arguments,
            cmd_serve, compiles=True),
]
