"""Every per-request rule, checked once, before any work (after vLLM's ``PoolingParams.verify``).

:class:`RequestRules` is made when the model is loaded, from the settings and what the model says
(its input length, hidden size, pooling, head, and the one count an exported graph runs). ``verify``
takes a request's parameters and returns its hash count or raises :class:`InvalidInput` naming the
limit; the engine calls it before it tokenises, so a refused request costs nothing. Hash-count rules
themselves live in the model layer (model/hashes.py); this module words them for a client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from yoso_serve.model.hashes import HashesError, resolve_hashes

from .errors import InvalidInput
from .params import ClassifyParams, EmbedParams, HiddenParams, PiecesParams
from .settings import ServeSettings

log = logging.getLogger("yoso_serve.service")

# /embed_pieces' default piece size: the default model's pieces were trained and measured at 64 and 128
# tokens; 128 gives half the vectors to store.
PIECE_TOKENS = 128


@dataclass(frozen=True)
class RequestRules:
    settings: ServeSettings
    config: object  # the model's EncoderConfig
    has_classifier: bool
    max_length: int  # tokens per input, specials included
    fixed_hashes: int | None  # the one count an exported graph runs
    exact_below: int  # auto's crossover, in tokens

    def verify(self, p: EmbedParams | PiecesParams | HiddenParams | ClassifyParams) -> int | str:
        """The request's hash count ("auto" stays "auto"); raises InvalidInput for the first rule it breaks."""
        if isinstance(p, PiecesParams):
            if self.config.pooling != "mean":
                raise InvalidInput("pieces are means of token states, and this model pools by its first token "
                                   "(pooling 'cls'); use /embed or /embed_all")
            size = self.piece_tokens(p)
            if not 1 <= size <= self.max_length:
                raise InvalidInput(f"piece_tokens must be in [1, {self.max_length}] (the model's input length), "
                                   f"got {size}", param="piece_tokens")
            return self._whole_inputs(p, "long_input='chunk' is only for pooled embeddings (/embed); use "
                                         "'truncate' or 'error' here")
        if isinstance(p, ClassifyParams):  # with the model's head; zero-shot labels go through /embed's rules
            if not self.has_classifier:
                raise InvalidInput("this model has no classification head; pass `labels` to classify "
                                   "zero-shot by embedding similarity", param="labels")
            return self._whole_inputs(p, "long_input='chunk' is not supported with a classification head; "
                                         "use 'truncate' or 'error'")
        if isinstance(p, HiddenParams):
            return self._whole_inputs(p, "long_input='chunk' is only for pooled embeddings (/embed); use "
                                         "'truncate' or 'error' here")
        hashes = self.hashes(p.hashes)
        self.texts(p.texts)
        if p.dimensions is not None and not 1 <= p.dimensions <= self.config.hidden_size:
            raise InvalidInput(f"dimensions must be in [1, {self.config.hidden_size}] (the "
                               f"model's hidden size), got {p.dimensions}", param="dimensions")
        return hashes

    def _whole_inputs(self, p, no_chunk: str) -> int | str:
        hashes = self.hashes(p.hashes)
        self.texts(p.texts)
        if p.long_input == "chunk":
            raise InvalidInput(no_chunk, param="long_input")
        return hashes

    def hashes(self, requested: int | str | None, n_tokens: int | None = None) -> int | str:
        """A request's count ("auto" stays), or one input's with ``n_tokens``; model/hashes.py decides."""
        s = self.settings
        try:
            return resolve_hashes(self.config, requested, source="request", default=s.hashes,
                                  max_hashes=s.max_hashes, fixed=self.fixed_hashes,
                                  exact_below=self.exact_below, n_tokens=n_tokens)
        except HashesError as exc:
            raise InvalidInput(str(exc), param="hashes") from None

    def texts(self, texts: list[str]) -> None:
        limit = self.settings.max_client_batch_size
        if not texts:
            raise InvalidInput("inputs must not be empty", param="inputs")
        if len(texts) > limit:
            raise InvalidInput(f"{len(texts)} inputs is above max_client_batch_size {limit}; split the request",
                               param="inputs")
        if any(not t for t in texts):
            raise InvalidInput("inputs must not contain empty strings", param="inputs")
        if self.settings.log_texts:
            log.info("inputs: %r", texts)

    def piece_tokens(self, p: PiecesParams) -> int:
        return min(PIECE_TOKENS, self.max_length) if p.piece_tokens is None else p.piece_tokens

    def answer_size(self, seqs: list[list[int]], vector_tokens: int, pieces: bool) -> None:
        """A request may ask for at most ``max_batch_tokens`` vectors (one per ``vector_tokens`` tokens of
        each input: 1 for /embed_all's token states, n for /embed_pieces' pieces): the states of one full
        batch, about 125 MB of JSON at 384 dimensions."""
        vectors, limit = sum(-(-len(ids) // vector_tokens) for ids in seqs), self.settings.max_batch_tokens
        if vectors > limit:
            each = f"one per {vector_tokens}-token piece" if pieces else "one per token"
            raise InvalidInput(f"the answer would hold {vectors} vectors ({each}), above max_batch_tokens "
                               f"({limit}) vectors per request; send fewer or shorter inputs"
                               + (", or larger pieces" if pieces else ""), param="inputs")

    def token_ids(self, batch: list[list[int]], vocab: int) -> None:
        """/decode's lists of ids: at most ``max_client_batch_size`` lists, every id in the vocabulary."""
        limit = self.settings.max_client_batch_size
        if len(batch) > limit:
            raise InvalidInput(f"{len(batch)} id lists is above max_client_batch_size {limit}; split the request",
                               param="ids")
        if any(i >= vocab for ids in batch for i in ids):
            raise InvalidInput(f"token ids must be in [0, {vocab}) (the vocabulary size)", param="ids")
