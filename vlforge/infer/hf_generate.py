"""engine=hf: transformers' own `generate`, kept beside generate/'s engine for comparison
(`vlforge serve --engine hf`, bench/): requests batched by their sampling settings, one batch after
another, each row stopped by the streamer (RowsDone) at its own end token, length or stop string.
The functions take the serve engine (infer/model.InferenceModel) and its Requests.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from vlforge.infer.shared_images import image_key, share_repeated_images
from vlforge.infer.streamer import BatchStreamer, Completion


class RowsDone(StoppingCriteria):
    """Per-row stop for generate(): a row is finished once the streamer says so."""

    def __init__(self, streamer: BatchStreamer):
        self.streamer = streamer

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.tensor(list(self.streamer.done.values()), device=input_ids.device)


@torch.no_grad()
def generate_hf(engine, requests: list, on_text: Callable[[int, str], None] | None = None) -> list[Completion]:
    """engine=hf: transformers generate, one batch per sampling setting."""
    results: list[Completion | None] = [None] * len(requests)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault((r.temperature, r.top_p), []).append(i)
    for (temperature, top_p), index in groups.items():
        callback = None if on_text is None else (lambda row, text, index=index: on_text(index[row], text))
        for i, c in zip(index, _generate_batch(engine, [requests[i] for i in index], temperature, top_p, callback)):
            results[i] = c
    return results  # type: ignore[return-value]


def _generate_batch(engine, requests: list, temperature: float, top_p: float, on_text) -> list[Completion]:
    """One batch of requests of the same sampling settings through the model's own generate."""
    inputs = engine.batch_inputs(requests)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    if min_new := min(r.min_new_tokens for r in requests):
        sampling["min_new_tokens"] = min_new
    # the tokens generate/'s engine never generates either (vision special tokens: issue 11)
    sampling["suppress_tokens"] = engine.banned_ids()
    streamer = BatchStreamer(engine, requests, on_text)
    # one key an image of the batch (a request with a video has more images than r.images: not shared)
    keys = ([image_key(im, engine.encoder_for(r).limits) for r in requests for im in r.images]
            if engine.share_images and not any(r.videos for r in requests) else [])
    with engine.lock, torch.autocast(engine.device.type, dtype=torch.bfloat16, enabled=engine.device.type == "cuda"), \
            share_repeated_images(engine.model, keys, inputs.get("image_grid_thw")) as shared:
        engine.images_shared += shared
        engine.model.generate(**inputs, max_new_tokens=max(r.max_new_tokens for r in requests),
                              pad_token_id=engine.encoder.pad_id, eos_token_id=engine.end_ids, streamer=streamer,
                              stopping_criteria=StoppingCriteriaList([RowsDone(streamer)]), **sampling)
    return [Completion(text, int(n_prompt), count, finish) for text, n_prompt, count, finish
            in zip(streamer.text.values(), inputs["attention_mask"].sum(1).tolist(), streamer.count.values(),
                   streamer.finish.values())]
