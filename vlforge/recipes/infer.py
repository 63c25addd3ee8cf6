"""Inference recipes on a loaded InferenceModel: one answer, an interactive chat, a JSONL eval.

    vlforge infer merged/ --image cat.png --prompt "What animal is this?" [--quant nf4] [--task classify]
    vlforge chat merged/ [--quant nf4]                 # /image PATH attaches an image, /reset, /quit
    vlforge eval merged/ --data val.jsonl [--quant nf4] [--out answers.json] [--reward SPEC] [--tool SPEC]
    vlforge eval merged/ --data geometry3k/test.parquet --column prompt=problem
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
from PIL import Image

from vlforge.config import DataConfig, RolloutConfig, ToolsConfig
from vlforge.data.inline import DataError
from vlforge.data.video import Video, read_video_header
from vlforge.data.sources import iter_samples
from vlforge.train.stop import sigint_sets
from vlforge.rl.rewards import CombinedReward, exact_match
from vlforge.tools.registry import Tool
from vlforge.rollout.multiturn import answer_with_tools, tool_runner
from vlforge.infer.model import MAX_NEW_TOKENS, InferenceModel, Request


def user_message(prompt: str, n_images: int, n_videos: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
            + [{"type": "text", "text": prompt}]}


def answer(vlm: InferenceModel, prompt: str, image_paths: list[str], *, max_new_tokens: int | None = None,
           task: str = "qa", temperature: float = 0.0, on_text: Callable[[str], None] | None = None,
           video_paths: list[str] = ()) -> str:
    # refused over the pixel limit from the header (DataError); decoded reduced when the processor would shrink it
    images = [vlm.encoder.decode_image(p) for p in image_paths]
    videos = [read_video_header(Path(p), p) for p in video_paths]  # files (PyAV), sampled as the model's processor does
    request = Request([user_message(prompt, len(images), len(videos))], images, videos=videos,
                      max_new_tokens=max_new_tokens or MAX_NEW_TOKENS[task], temperature=temperature)
    stream = None if on_text is None else (lambda _row, text: on_text(text))
    return vlm.generate([request], on_text=stream)[0].text


CHAT_COMMANDS = ("/image PATH attaches an image, /video PATH a video file (both sent with your next message), "
                 "/reset clears the conversation, /quit (or /exit) ends the chat")


def chat(vlm: InferenceModel, read: Callable[[str], str] = input, write: Callable[[str], None] = print,
         stream: Callable[[str], None] | None = None, max_new_tokens: int = MAX_NEW_TOKENS["describe"]) -> None:
    """A REPL keeping the conversation; images (videos) attached with /image (/video) are sent with
    the next message.

    `stream` receives the reply's text as it is generated (then `write` gets a newline);
    without it `write` gets the whole reply. Ctrl-C while a reply is generated stops that reply (the
    conversation goes on); at the prompt, or twice, it raises KeyboardInterrupt (the CLI: one line).
    """
    history: list[dict] = []
    images: list[Image.Image] = []
    videos: list[Video] = []
    frames: list = []  # each video's frames, decoded when attached (not again every turn)
    pending_images: list[Image.Image] = []
    pending_videos: list[Video] = []
    pending_frames: list = []
    write(f"vlforge chat: type a message; commands: {CHAT_COMMANDS}")
    while True:
        try:
            line = read("> ").strip()
        except EOFError:
            return
        if line in ("/quit", "/exit"):
            return
        if line == "/reset":
            history, images, videos, frames, pending_images, pending_videos, pending_frames = [], [], [], [], [], [], []
            write("(conversation cleared)")
            continue
        if line.startswith(("/image ", "/video ")):
            kind, path = line[1:6], line[7:].strip()
            try:
                if kind == "image":
                    pending_images.append(vlm.encoder.decode_image(path))
                else:
                    video = read_video_header(Path(path), path)
                    pending_frames.append(vlm.encoder.decode_video(video, path))
                    pending_videos.append(video)
                write(f"(attached {path})")
            except DataError as e:  # a bad file ends nothing: say why and keep the conversation
                write(f"cannot open {path}: {e}")
            continue
        if line.startswith("/") and not line.startswith("//"):  # a mistyped command is never sent as a message
            word = line.split()[0]
            write(f"{word} needs a file: {word} PATH" if word in ("/image", "/video") else
                  f"unknown command {word}; commands: {CHAT_COMMANDS}. A message that starts with / is typed as //...")
            continue
        line = line[1:] if line.startswith("//") else line  # "//etc/hosts?" sends "/etc/hosts?"
        if not line:
            continue
        history.append(user_message(line, len(pending_images), len(pending_videos)))
        images, videos, frames = images + pending_images, videos + pending_videos, frames + pending_frames
        pending_images, pending_videos, pending_frames = [], [], []
        on_text = None if stream is None else (lambda _row, text: stream(text))
        request = Request(list(history), list(images), videos=list(videos), video_frames=list(frames),
                          max_new_tokens=max_new_tokens)
        with sigint_sets(request.cancelled):  # Ctrl-C ends this reply at its next token; a second one, the chat
            reply = vlm.generate([request], on_text=on_text)[0]
        write("" if stream else reply.text)
        if reply.finish_reason == "cancelled":
            write("(reply stopped by Ctrl-C; what it said stays in the conversation)")
        history.append({"role": "assistant", "content": [{"type": "text", "text": reply.text}]})


def evaluate_dataset(vlm: InferenceModel, path: str | Path, *, batch_size: int = 16,
                     max_new_tokens: int = MAX_NEW_TOKENS["classify"], max_samples: int | None = None,
                     rewards: CombinedReward | None = None, tools: dict[str, Tool] | None = None,
                     tool_settings: ToolsConfig = ToolsConfig(), data: DataConfig | None = None) -> dict:
    """Batched greedy answers on a dataset's prompts (any format training reads: data/sources.py;
    `data`: its data.format and data.columns); exact-match accuracy overall and by task, and
    with `rewards` (rl/rewards.py, as GRPO's rl.rewards) each answer's scores and their means.
    With `tools` (tools/registry.load_tools) each prompt is answered as a conversation with them, as GRPO's
    rollouts and evaluation do (rollout/multiturn.py; `max_new_tokens` the whole response's budget):
    the answer is the last assistant turn, and rewards also get the transcript and call counts;
    `tool_settings` gives the rollout.tool_* keys (turns, result tokens and image pixels, timeout,
    processes)."""
    samples = list(itertools.islice(iter_samples(path, data or DataConfig()), max_samples))
    rows, hits, by_task = [], 0, defaultdict(lambda: [0, 0])
    cfg = RolloutConfig(temperature=0.0, max_new_tokens=max_new_tokens, compile=False)
    with tool_runner(tools or {}, tool_settings) as run_calls:
        for s in range(0, len(samples), batch_size):
            chunk = samples[s:s + batch_size]
            if tools:
                texts, fields, used = _tool_answers(vlm, chunk, tools, cfg, run_calls, tool_settings)
            else:
                requests = [Request([_placeholders(m) for m in x.prompt_messages], vlm.encoder.decode_images(x),
                                    videos=x.videos, max_new_tokens=max_new_tokens) for x in chunk]
                texts, fields, used = [o.text for o in vlm.generate(requests)], [x.fields for x in chunk], None
            rows += _scored_rows(chunk, texts, fields, used, rewards)
    for row in rows:
        hits += row["correct"]
        by_task[row["task"]][0] += row["correct"]
        by_task[row["task"]][1] += 1
    n = len(rows)
    report = {"n": n, "accuracy": hits / max(n, 1), "by_task": {k: a / b for k, (a, b) in sorted(by_task.items())},
              "model": vlm.name, "quant": vlm.quant_report}
    if tools:
        report["tool_calls_mean"] = sum(r["tool_calls"] for r in rows) / max(n, 1)
    if rewards is not None:
        report["reward_mean"] = sum(r["reward"] for r in rows) / max(n, 1)
        report["rewards"] = {k: sum(r["rewards"][k] for r in rows) / max(n, 1) for k in rewards.keys}
    return {**report, "answers": rows}


def _tool_answers(vlm: InferenceModel, chunk: list, tools: dict[str, Tool], cfg: RolloutConfig, run_calls,
                  settings: ToolsConfig):
    """(the last assistant turns, the rows' fields with GRPO's tool fields, each answer's tool use) of a
    chunk answered greedily as conversations with the tools, on the model."""
    with vlm.lock, torch.no_grad(), \
            torch.autocast(vlm.device.type, dtype=torch.bfloat16, enabled=vlm.device.type == "cuda"):
        multi = answer_with_tools(vlm.model, vlm.encoder, chunk, cfg, tools, vlm.device, run_calls,
                                  settings=settings)
    used = [{"tool_calls": k, "failed_tool_calls": f, "turns": t}
            for k, f, t in zip(multi.calls, multi.failed_calls, multi.turns)]
    return multi.completions, multi.reward_fields([x.fields for x in chunk]), used


def _scored_rows(chunk: list, texts: list[str], fields: list[dict], used: list[dict] | None,
                 rewards: CombinedReward | None) -> list[dict]:
    # scored as GRPO scores a rollout: the answer's text, the reference, the row's other fields
    scored = rewards(texts, [x.answer for x in chunk], fields, prompts=[x.prompt_messages for x in chunk]) \
        if rewards is not None else None
    rows = []
    for i, (x, text) in enumerate(zip(chunk, texts)):
        task = x.fields.get("task", "all")
        row = {"source": x.source, "task": task, "answer": text.strip(), "reference": x.answer,
               "correct": exact_match(text, x.answer) == 1.0}
        if used is not None:
            row.update(used[i])
        if scored is not None:
            row["reward"] = scored.total[i]
            row["rewards"] = {k: v[i] for k, v in scored.per_fn.items()}
        rows.append(row)
    return rows


def _placeholders(message: dict) -> dict:
    """A dataset message (image and video parts carry their files) as the engine wants it (images and
    videos passed separately)."""
    content = message["content"]
    if isinstance(content, str):
        return message
    parts = [{"type": p["type"]} if p.get("type") in ("image", "video") else p for p in content]
    return {**message, "content": parts}
