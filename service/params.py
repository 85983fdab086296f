"""Plain engine parameters and results: what protocol models turn into, what routes turn back.

No pydantic here: the engine and its tests work with these dataclasses only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EmbedParams:
    texts: list[str]
    normalize: bool = True
    truncation_direction: str = "right"
    pooling: str | None = None
    hashes: int | str | None = None  # an int, "auto", or None (the server's)
    long_input: str = "truncate"  # "truncate" | "chunk" | "error"
    dimensions: int | None = None
    chunk_hint: bool = False  # the route takes long_input 'chunk': the over-length error may suggest it


@dataclass(frozen=True)
class HiddenParams:
    texts: list[str]
    truncation_direction: str = "right"
    hashes: int | str | None = None
    long_input: str = "truncate"  # "truncate" | "error"


@dataclass(frozen=True)
class PiecesParams(HiddenParams):
    piece_tokens: int | None = None  # None: the engine's PIECE_TOKENS, or the input length if shorter
    normalize: bool = True


@dataclass(frozen=True)
class ClassifyParams:
    texts: list[str]
    labels: list[str] | None = None
    multi_label: bool = False
    raw_scores: bool = False
    hashes: int | str | None = None
    truncation_direction: str = "right"
    long_input: str = "truncate"


@dataclass
class Usage:
    """What the response headers report: tokens computed and where the time went (ms)."""

    tokens: int = 0
    hashes: str = "0"  # x-hashes: what ran, per input when they differ (model/hashes.py hashes_header)
    tokenize_ms: float = 0.0
    queue_ms: float = 0.0
    inference_ms: float = 0.0


@dataclass
class Output:
    value: object  # np.ndarray | list, depending on the call
    usage: Usage = field(default_factory=Usage)
