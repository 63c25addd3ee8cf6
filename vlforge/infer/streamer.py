"""A batched generation's answers as they stream: each row's text detokenized incrementally
(tokenizers' DecodeStream), stop strings found without rescanning, the text sent as it grows with
any tail that may still become a stop string held back, and the Completion each row ends as.
The InferenceModel keeps its rows here as generate/'s engine hands over each sync point's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tokenizers.decoders import DecodeStream


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length" | "cancelled"


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
    """The per-row bookkeeping of one batched generation: push() with a row's tokens of a sync point
    (rows join by add()); rows finish at an end token, their own max_new_tokens, a stop string or when
    cancelled (the engine then frees their slots). Text goes to
    on_text(row, new_text) as it grows (_RowText: incremental), holding back a tail that may still
    become a stop string; `text[row]` is the row's answer once `done[row]`, `count[row]` its tokens.
    Rows are numbered 0, 1, ... as they join; each is a key of the dicts below until `release`d
    (dicts, not lists: a server's continuous generate runs as long as requests keep coming, and
    keeps none of the done).
    """

    def __init__(self, vlm, requests: list, on_text: Callable[[int, str], None] | None):
        """`vlm`: the InferenceModel (its tokenizer and end ids); `requests`: its Requests, the first rows."""
        self.vlm, self.on_text = vlm, on_text
        self.backend = vlm.tokenizer.backend_tokenizer  # the Rust tokenizer DecodeStream steps on
        self.requests: dict[int, object] = {}  # row -> its Request
        self.rows: dict[int, _RowText] = {}
        self.text: dict[int, str] = {}
        self.count: dict[int, int] = {}
        self.done: dict[int, bool] = {}
        self.finish: dict[int, str] = {}
        self.joined = 0  # rows added so far: the next row's number
        for r in requests:
            self.add(r)

    def add(self, request) -> int:
        """A request joining (generate/'s vlm, continuous batching): its row."""
        row, self.joined = self.joined, self.joined + 1
        self.requests[row], self.rows[row] = request, _RowText(request.stop)
        self.text[row], self.count[row], self.done[row], self.finish[row] = "", 0, False, "length"
        return row

    def release(self, row: int) -> None:
        """The row's answer was delivered: forget it (its request's images, its text, its counts)."""
        for d in (self.requests, self.rows, self.text, self.count, self.done, self.finish):
            del d[row]

    def push(self, row: int, toks: list[int]) -> None:
        """The row's next tokens (a sync point's)."""
        for tok in toks:
            if self.done[row]:
                return  # the engine's row may run on to the sync point
            if self.requests[row].cancelled.is_set():  # nobody waits for this row: its token is dropped
                return self._close(row, "cancelled")
            if tok in self.vlm.end_ids:
                return self._close(row, "stop")
            self.count[row] += 1
            piece = self.rows[row].step(self.backend, tok)
            if piece and self._send(row, piece, final=False):
                return self._close(row, "stop")
            if self.count[row] >= self.requests[row].max_new_tokens:
                return self._close(row, "length")

    def _send(self, row: int, piece: str, final: bool) -> bool:
        """Stream what `piece` releases; True if a stop string ended the answer in it."""
        out, stopped = self.rows[row].add(piece, final)
        if out and self.on_text is not None:
            self.on_text(row, out)
        return stopped

    def _close(self, row: int, finish: str) -> None:
        """The row is done: what the stream still holds and the held-back tail go out."""
        text = self.rows[row]
        if self._send(row, text.flush(self.backend), final=True):
            finish = "stop"
        self.text[row], self.done[row], self.finish[row] = text.text(), True, finish

    def end(self, rows=None, finish: str | None = None) -> None:
        """Rows the generation ended (all by default): done, as `finish` (default: "length")."""
        for row in list(self.rows) if rows is None else rows:
            if not self.done[row]:
                self._close(row, finish or self.finish[row])
