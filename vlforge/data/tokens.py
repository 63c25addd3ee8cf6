"""Text as the tokenizer sees it: the most characters one token can stand for (a text's token count
bounded from its length without tokenizing it: serve's prompt limits, data.max_length in data/dataset),
and message text holding a special token's text kept as text while the chat template renders
(markers, data/encode.Encoder.token_ids).
"""

from __future__ import annotations

import json
import re

# How many characters of a text can become one character after Unicode normalization: NFC/NFKC
# compose, and a composed character stands for at most its full decomposition (the longest canonical
# decomposition is 4 code points, compatibility 18: test_serve checks these against unicodedata).
# NFD/NFKD and no normalizer never shorten a text.
_NORMALIZER_SHRINK = {"NFC": 4, "NFKC": 18, "NFD": 1, "NFKD": 1}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of a text that one token can stand for, or None when the tokenizer
    allows no such bound. A prompt of C characters is then at least C / this many tokens.

    Holds for byte-level BPE (Qwen's): every token is a vocabulary entry of at most B bytes (its
    byte-level string has one character per byte) or an added token matched verbatim, and a
    character is at least one byte, so C characters of normalized text need >= C / B tokens; the
    normalizer may first have shrunk the text by its factor above. Anything that could make one
    token swallow a run of any length (an unknown token, whitespace-stripping added tokens, a
    pre-tokenizer that removes text, another normalizer) gives None: then prompts are only counted.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model, pre, norm = spec.get("model") or {}, spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    if model.get("type") != "BPE" or model.get("unk_token") is not None:
        return None
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if not any(p.get("type") == "ByteLevel" for p in steps) or any(
            p.get("type") not in ("ByteLevel", "Split") or p.get("behavior") == "Removed" for p in steps):
        return None
    shrink = 1
    for n in ([] if norm is None else norm.get("normalizers", [norm]) if norm.get("type") == "Sequence" else [norm]):
        if n.get("type") not in _NORMALIZER_SHRINK:
            return None
        shrink *= _NORMALIZER_SHRINK[n["type"]]
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    longest = max([len(t) for t in model.get("vocab", {})] + [len(a["content"].encode()) for a in added], default=0)
    return longest * shrink or None


TEXT_MARK = re.compile("\x00vlforge-text-(\\d+)\x00")  # stands in for a message's text while the template renders


def mark_texts(message: dict, holds_special, escaped: list[str]) -> dict:
    """`message` with each of its texts for which `holds_special` is true replaced by a marker
    (appended to `escaped`, the marker naming its index); other texts and parts as they are."""
    def mark(text: str) -> str:
        if not holds_special(text):
            return text
        escaped.append(text)
        return f"\x00vlforge-text-{len(escaped) - 1}\x00"

    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": mark(content)}
    if isinstance(content, list):
        return {**message, "content": [{**part, "text": mark(part["text"])}
                                       if isinstance(part, dict) and isinstance(part.get("text"), str) else part
                                       for part in content]}
    return message
