"""Request and response models (pydantic). Requests turn themselves into plain engine parameters,
so the engine never sees a pydantic object. Sizes that depend on the deployment (inputs per
request, hash range) are the engine's to check; here are only types and fixed vocabularies.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from yoso_serve.model.hashes import resolve_hashes

from .params import ClassifyParams, EmbedParams, HiddenParams

Direction = Literal["right", "left"]
LongInput = Literal["truncate", "chunk", "error"]


def _hash_count(value):
    """pydantic reads JSON true as 1; model/hashes.py refuses a boolean, as the encoder always did."""
    return resolve_hashes(None, value, source="request") if isinstance(value, bool) else value


# a count, "auto" (per input by its own length), or absent (the server's); the engine checks the range
HashCount = Annotated[Union[int, Literal["auto"], None], BeforeValidator(_hash_count)]


def _as_list(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def _long_input(long_input: LongInput, truncate: bool | None) -> str:
    """TEI compatibility: ``truncate: false`` turns the default truncation into an error."""
    return "error" if truncate is False and long_input == "truncate" else long_input


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbedRequest(_Request):
    inputs: str | list[str] = Field(..., examples=["What is YOSO attention?"])
    normalize: bool = True
    truncate: bool | None = Field(None, description="TEI habit: false makes an over-long input "
                                  "a 422 (same as long_input='error').")
    truncation_direction: Direction = "right"
    pooling: Literal["mean", "cls"] | None = Field(None, description="Default: the model's.")
    hashes: HashCount = Field(None, description="LSH samples; 0 = exact YOSO-E; \"auto\" = exact below the "
                              "server's crossover, the model's count above, by each input's own length. Default: "
                              "the server's. A count only for attention_type=yoso models (422 otherwise).")
    long_input: LongInput = Field("truncate", description="What to do with an input over the "
                                  "model's max length: cut it, embed overlapping windows and "
                                  "combine them, or answer 422.")

    def to_params(self) -> EmbedParams:
        return EmbedParams(texts=_as_list(self.inputs), normalize=self.normalize,
                           truncation_direction=self.truncation_direction, pooling=self.pooling,
                           hashes=self.hashes, long_input=_long_input(self.long_input, self.truncate))


class EmbedAllRequest(_Request):
    inputs: str | list[str]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    hashes: HashCount = None
    long_input: Literal["truncate", "error"] = "truncate"

    def to_params(self) -> HiddenParams:
        return HiddenParams(texts=_as_list(self.inputs), truncation_direction=self.truncation_direction,
                            hashes=self.hashes, long_input=_long_input(self.long_input, self.truncate))


class ClassifyRequest(_Request):
    inputs: str | list[str] = Field(..., examples=["the battery died after an hour"])
    labels: list[str] | None = Field(None, description="Classify zero-shot against these labels. "
                                     "Without it the model's classification head is used.")
    multi_label: bool = False
    raw_scores: bool = Field(False, description="Logits (head) or cosine similarities (zero-shot) "
                             "instead of probabilities.")
    hashes: HashCount = None
    truncate: bool | None = None
    truncation_direction: Direction = "right"

    def to_params(self) -> ClassifyParams:
        return ClassifyParams(texts=_as_list(self.inputs), labels=self.labels, multi_label=self.multi_label,
                              raw_scores=self.raw_scores, hashes=self.hashes,
                              truncation_direction=self.truncation_direction,
                              long_input=_long_input("truncate", self.truncate))


class TokenizeRequest(_Request):
    inputs: str | list[str]
    add_special_tokens: bool = True

    def texts(self) -> list[str]:
        return _as_list(self.inputs)


class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body. Unknown fields (``user``) are accepted and ignored, as OpenAI does."""

    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, description="Keep the first n dimensions, then renormalise.")

    def to_params(self) -> EmbedParams:
        return EmbedParams(texts=_as_list(self.input), normalize=True, dimensions=self.dimensions)


class ScoredLabel(BaseModel):
    label: str
    score: float


class Token(BaseModel):
    id: int
    text: str
    start: int
    stop: int
    special: bool


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
