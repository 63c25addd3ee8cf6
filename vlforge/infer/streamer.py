"""A batched generation's answers as they stream: each row's text detokenized incrementally
(tokenizers' DecodeStream), stop strings found without rescanning, the text released as it grows
with any tail that may still become a stop string held back, and the Completion each row ends as.
The InferenceModel keeps its rows here, by the engine's request id, as each Engine.step hands over
new tokens, and returns what they release as TextOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from tokenizers.decoders import DecodeStream


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"


@dataclass(frozen=True)
class TextOutput:
    """What one InferenceModel.step() says about one added request (the id InferenceModel.add returned)."""
    id: int
    text: str  # the answer's text released since the last output ("" when a step released none)
    completion: Completion | None = None  # once the request is done


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the start of a stop string (held back while
    streaming: it may yet become a stop string, which the final text leaves out)."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


class _RowText:
    """One answer's text, detokenized incrementally: each token's text comes from tokenizers'
    `DecodeStream`, which decodes only a short window of ids past the last complete character and
    yields nothing while the bytes so far end inside a UTF-8 character (a CJK character or an emoji
    split over byte-level tokens), so a token costs the same at the 4,000th as at the first.
    (transformers' TextIteratorStreamer re-decodes its whole token cache at every token until a
    newline resets it: quadratic in a long line. DecodeStream is the tokenizers library's own
    streaming decode, over the same Rust tokenizer that `decode` runs.)
    Stop strings are searched in the new text plus the tail before it that a stop string could
    start in, so that too is linear in the answer's length."""

    __slots__ = ("stream", "stops", "keep", "parts", "tail", "unsent", "pending")

    def __init__(self, stops: list[str]):
        self.stream = DecodeStream(skip_special_tokens=True)
        self.stops = [s for s in stops if s]
        self.keep = max((len(s) for s in self.stops), default=1) - 1  # a stop string starts in these
        self.parts: list[str] = []  # the text so far but its tail
        self.tail = ""  # the text's last `keep` characters (every character not streamed yet among them)
        self.unsent = 0  # characters at the end of the text not streamed yet (a possible stop string's start)
        self.pending: list[int] = []  # ids whose text the stream holds back (an unfinished character)

    def step(self, backend, tok: int) -> str:
        piece = self.stream.step(backend, tok)
        if piece is None:
            self.pending.append(tok)
            return ""
        self.pending.clear()
        return piece

    def flush(self, backend) -> str:
        """At the end: the text of the ids the stream still holds (an unfinished character's bytes
        decode as U+FFFD, as in a full decode). The stream yielded at a complete character, after
        which UTF-8 decoding starts afresh, so these ids decode alone to the full decode's rest."""
        rest = backend.decode(self.pending, skip_special_tokens=True) if self.pending else ""
        self.pending = []
        return rest

    def add(self, piece: str, final: bool) -> tuple[str, bool]:
        """Append `piece`: (the text to stream now, whether a stop string ended the answer). Unless
        `final`, a tail that may still become a stop string is held back; a stop string found starts
        in held-back text, never in streamed text."""
        window, unsent = self.tail + piece, self.unsent + len(piece)
        hits = [i for s in self.stops if (i := window.find(s)) >= 0]
        if hits:
            cut = min(hits)
            window, unsent, final = window[:cut], unsent - (len(window) - cut), True
        hold = 0 if final else _partial_stop(window, self.stops)
        out = window[len(window) - unsent:len(window) - hold]
        self.unsent = hold
        split = max(0, len(window) - self.keep)
        if split:
            self.parts.append(window[:split])
        self.tail = window[split:]
        return out, bool(hits)

    def text(self) -> str:
        return "".join(self.parts) + self.tail


class BatchStreamer:
    """The per-row bookkeeping of one batched generation: push() with a row's new tokens; rows finish at
    an end token, their own max_new_tokens, a stop string or when cancelled (`done[row]`: the engine can
    stop the row). push and end return the text the row releases (_RowText: incremental), holding back
    a tail that may still become a stop string; `text[row]` is the row's answer once `done[row]`,
    `count[row]` its tokens. Rows are the caller's ids (the engine's request ids), each a key of the
    dicts below until `release`d (a server's engine runs as long as requests keep coming, and keeps
    none of the done).
    """

    def __init__(self, vlm):
        """`vlm`: the InferenceModel (its tokenizer and end ids)."""
        self.vlm = vlm
        self.backend = vlm.tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream steps on
        self.requests: dict[int, object] = {}  # row -> its Request
        self.rows: dict[int, _RowText] = {}
        self.text: dict[int, str] = {}
        self.count: dict[int, int] = {}
        self.done: dict[int, bool] = {}
        self.finish: dict[int, str] = {}

    def add(self, row: int, request) -> None:
        self.requests[row], self.rows[row] = request, _RowText(request.stop)
        self.text[row], self.count[row], self.done[row], self.finish[row] = "", 0, False, "length"

    def release(self, row: int) -> None:
        """The row's answer was delivered: forget it (its request's images, its text, its counts)."""
        for d in (self.requests, self.rows, self.text, self.count, self.done, self.finish):
            del d[row]

    def push(self, row: int, toks) -> str:
        """The row's next tokens: the text they release."""
        out = []
        for tok in toks:
            if self.done[row]:
                break  # the engine's row may run on until the row is stopped
            if self.requests[row].cancelled.is_set():  # nobody waits for this row: its token is dropped
                out.append(self._close(row, "cancelled"))
                break
            if tok in self.vlm.end_ids:
                out.append(self._close(row, "stop"))
                break
            self.count[row] += 1
            piece = self.rows[row].step(self.backend, tok)
            if piece:
                text, stopped = self.rows[row].add(piece, final=False)
                out.append(text)
                if stopped:
                    out.append(self._close(row, "stop"))
                    break
            if self.count[row] >= self.requests[row].max_new_tokens:
                out.append(self._close(row, "length"))
                break
        return "".join(out)

    def _close(self, row: int, finish: str) -> str:
        """The row is done: what the stream still holds and the held-back tail are released."""
        text = self.rows[row]
        out, stopped = text.add(text.flush(self.backend), final=True)
        self.text[row], self.done[row], self.finish[row] = text.text(), True, "stop" if stopped else finish
        return out

    def end(self, row: int, finish: str | None = None) -> str:
        """The generation ended the row: done, as `finish` (default: what it finished as, else "length");
        the text it still releases."""
        return "" if self.done[row] else self._close(row, finish or self.finish[row])
