"""Preparing inputs: a request's texts as the token sequences the batcher runs (tokenised, truncated or
chunked into overlapping windows, each window with its weight in the document's mean), and the character
bounds of token ranges. Pure functions over the tokenizer: no queue, no model."""

from __future__ import annotations

from .errors import InvalidInput

Windows = list[tuple[list[int], int]]  # per text: (ids with specials, weight)


def chunk_windows(n_tokens: int, window: int, overlap: int) -> list[tuple[int, int, int]]:
    """Split ``n_tokens`` content tokens into ``(start, stop, weight)`` windows of at most ``window``
    tokens, neighbours sharing ``overlap``. ``weight`` counts the tokens a window adds that no
    earlier window had, so the weights sum to ``n_tokens`` (overlap counted once)."""
    if not 0 <= overlap < window:
        raise ValueError(f"chunk overlap {overlap} must be in [0, window {window})")
    if n_tokens == 0:  # a text the tokenizer drops whole ("\x07"): its specials alone, weight 1, not 0/0
        return [(0, 0, 1)]
    windows, start, covered = [], 0, 0
    while True:
        stop = min(start + window, n_tokens)
        windows.append((start, stop, stop - covered))
        covered = stop
        if stop >= n_tokens:
            return windows
        start = stop - overlap


def split_texts(tok, texts: list[str], side: str, long_input: str, *, max_length: int, window: int,
                overlap: int, offsets: bool = False, chunk_hint: bool = False,
                ) -> tuple[list[Windows], list[list[tuple[int, int]]] | None]:
    """Per text, its windows: one unless ``long_input`` is 'chunk'; and with ``offsets`` (not chunked)
    each text's character offsets per token, from the same tokenisation. ``chunk_hint``: the route
    takes long_input 'chunk', so the over-length error may suggest it."""
    if long_input != "chunk":
        limit = max_length if long_input == "truncate" else None
        if offsets:
            encoded = tok.encode_with_offsets(texts, max_length=limit, truncation_side=side)
        else:
            encoded = [(ids, None) for ids in tok.encode(texts, max_length=limit, truncation_side=side)]
        for i, (ids, _) in enumerate(encoded):
            if len(ids) > max_length:
                # only long_input 'error' (or TEI's truncate: false) gets here: the client turned truncation off
                raise InvalidInput(f"input {i} has {len(ids)} tokens, above the limit of {max_length} (the "
                                   "model's input length), and the request turned truncation off; shorten it, "
                                   "allow truncation" + (", or send long_input='chunk'" if chunk_hint else ""),
                                   param="inputs", index=i)
        return [[(ids, len(ids))] for ids, _ in encoded], [o for _, o in encoded] if offsets else None
    if offsets:
        raise ValueError("character offsets are for whole inputs, not chunks")
    out = []
    for ids in tok.encode(texts, add_special_tokens=False):
        out.append([(tok.wrap(ids[a:b]), w) for a, b, w in chunk_windows(len(ids), window, overlap)])
    return out, None


def char_bounds(offsets: list[tuple[int, int]], bounds: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Character bounds of each token range: from its first content token's start to its last one's stop;
    special tokens (offset (0, 0)) have no text, so a range of them only is empty where the text stopped."""
    out, end = [], 0
    for a, b in bounds:
        text = [o for o in offsets[a:b] if o[1] > o[0]]
        if text:
            out.append((text[0][0], text[-1][1]))
            end = text[-1][1]
        else:
            out.append((end, end))
    return out
