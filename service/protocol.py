"""Request and response models (pydantic). Requests turn themselves into plain engine parameters,
so the engine never sees a pydantic object.

Every fixed rule lives here (non-empty strings and lists, ranges, vocabularies), so /openapi.json
states what validation accepts. Limits that depend on the deployment or on the loaded model (inputs
per request, hash range, hidden size, whether a classification head exists) are the engine's to
check; :mod:`schema` writes them into the served OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, field_validator

from .params import ClassifyParams, EmbedParams, HiddenParams, PiecesParams

Direction = Literal["right", "left"]
LongInput = Literal["truncate", "chunk", "error"]


def _integral(value):
    """JSON Schema's integer includes 5.0, so a strict int field takes it too (not 5.5, "5" or true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _integer(minimum: int, description: str | None = None):
    # the bounds go before the validator, or pydantic leaves them out of the JSON schema
    return Annotated[int, Field(ge=minimum, description=description), BeforeValidator(_integral)]


Positive = _integer(1)
Text = Annotated[str, Field(min_length=1)]
# A label needs one character that is not blank by Python's str.isspace() (the engine's rule). The
# blanks are listed, not written \s: \s means other sets to Python, to pydantic's Rust regex and to
# JavaScript (\x1c-\x1f, \x85, \ufeff), and clients check the schema's pattern with any of them.
LABEL_PATTERN = r"[^\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
Label = Annotated[str, Field(pattern=LABEL_PATTERN)]
TEMPLATE_PATTERN = r"\{\}"
Hashes = _integer(0, "LSH samples; 0 = exact YOSO-E. Default: the server's. Only for attention_type=yoso "
                  "models (422 otherwise).")

# Union branches are picked by the input's JSON type, so an error names only the branch the client
# meant; the tags name those branches in error locations, which the error handler leaves out.
UNION_TAGS = frozenset({"text", "list", "single", "batch"})
# What a pattern asks for, in words: the error handler says this instead of quoting the regex.
PATTERN_MEANS = {LABEL_PATTERN: "String should contain a character that is not blank",
                 TEMPLATE_PATTERN: "String should contain {} (where each label goes)"}


def _text_or_list(value) -> str:
    return "list" if isinstance(value, list) else "text"


def _ids_shape(value) -> str:
    return "batch" if isinstance(value, list) and value and isinstance(value[0], list) else "single"


Texts = Annotated[Union[Annotated[Text, Tag("text")],
                        Annotated[list[Text], Field(min_length=1), Tag("list")]],
                  Discriminator(_text_or_list)]
TokenIds = Annotated[list[_integer(0)], Field(min_length=1)]
# a count, "auto" (per input by its own length), or absent (the server's); the engine checks the range
HashCount = Union[Hashes, Literal["auto"], None]


def _as_list(inputs: str | list[str]) -> list[str]:
    return [inputs] if isinstance(inputs, str) else list(inputs)


def _long_input(long_input: LongInput, truncate: bool | None) -> str:
    """TEI compatibility: ``truncate: false`` turns the default truncation into an error."""
    return "error" if truncate is False and long_input == "truncate" else long_input


class _Request(BaseModel):
    # strict: JSON's types as the schema states them (no "true" or 0 for a boolean, no "5" for a number)
    model_config = ConfigDict(extra="forbid", strict=True)


class EmbedRequest(_Request):
    inputs: Texts = Field(..., examples=["What is YOSO attention?"])
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
    dimensions: Positive | None = Field(None, description="Keep the first n "
                                                           "dimensions (before normalising).")

    def to_params(self) -> EmbedParams:
        return EmbedParams(texts=_as_list(self.inputs), normalize=self.normalize,
                           truncation_direction=self.truncation_direction, pooling=self.pooling,
                           hashes=self.hashes, long_input=_long_input(self.long_input, self.truncate),
                           dimensions=self.dimensions, chunk_hint=True)


class EmbedAllRequest(_Request):
    inputs: Texts
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    hashes: HashCount = None
    long_input: Literal["truncate", "error"] = "truncate"

    def to_params(self) -> HiddenParams:
        return HiddenParams(texts=_as_list(self.inputs), truncation_direction=self.truncation_direction,
                            hashes=self.hashes, long_input=_long_input(self.long_input, self.truncate))


class EmbedPiecesRequest(_Request):
    inputs: Texts = Field(..., examples=["A long document, read in one pass and indexed piece by piece."])
    piece_tokens: Positive | None = Field(None, description="Tokens per piece: the sequence (special tokens "
                                          "included) is cut into consecutive pieces of this many tokens from its "
                                          "first token; the last may be shorter. At most the model's input "
                                          "length. Default: 128, or the input length if shorter.")
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    hashes: HashCount = None
    long_input: Literal["truncate", "error"] = "truncate"

    def to_params(self) -> PiecesParams:
        return PiecesParams(texts=_as_list(self.inputs), piece_tokens=self.piece_tokens, normalize=self.normalize,
                            truncation_direction=self.truncation_direction, hashes=self.hashes,
                            long_input=_long_input(self.long_input, self.truncate))


class ClassifyRequest(_Request):
    inputs: Texts = Field(..., examples=["the battery died after an hour"])
    labels: Annotated[list[Label], Field(min_length=1, json_schema_extra={"uniqueItems": True})] | None = Field(
        None, description="Classify zero-shot against these distinct, non-blank labels. Without it the "
        "model's classification head is used (required on a model without one).")
    multi_label: bool = False
    raw_scores: bool = Field(False, description="Logits (head) or cosine similarities (zero-shot) "
                             "instead of probabilities.")
    hashes: HashCount = None
    truncate: bool | None = None
    truncation_direction: Direction = "right"

    @field_validator("labels")
    @classmethod
    def _distinct(cls, labels: list[str] | None) -> list[str] | None:
        if labels is not None and len(set(labels)) != len(labels):
            raise ValueError("labels must be distinct")
        return labels

    def to_params(self) -> ClassifyParams:
        return ClassifyParams(texts=_as_list(self.inputs), labels=self.labels, multi_label=self.multi_label,
                              raw_scores=self.raw_scores, hashes=self.hashes,
                              truncation_direction=self.truncation_direction,
                              long_input=_long_input("truncate", self.truncate))


class TokenizeRequest(_Request):
    inputs: Texts
    add_special_tokens: bool = True

    def texts(self) -> list[str]:
        return _as_list(self.inputs)


class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body. Unknown fields (``user``) are accepted and ignored, as OpenAI does."""

    model_config = ConfigDict(strict=True)

    input: Texts
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Positive | None = Field(
        None, description="Keep the first n dimensions, then renormalise.")
    hashes: HashCount = Field(None, description="yoso-serve's own, as on /embed: LSH samples, 0 = exact "
                              "YOSO-E, \"auto\"; default the server's.")
    truncate: bool | None = Field(None, description="yoso-serve's own, as on /embed: false makes an over-long "
                                  "input a 422.")
    long_input: LongInput = Field("truncate", description="yoso-serve's own, as on /embed: cut an input over "
                                  "the model's max length, embed it in windows (chunk), or answer 422 (error).")

    def to_params(self) -> EmbedParams:
        return EmbedParams(texts=_as_list(self.input), normalize=True, dimensions=self.dimensions,
                           hashes=self.hashes, long_input=_long_input(self.long_input, self.truncate),
                           chunk_hint=True)


# --- text-embeddings-inference's routes (/predict, /rerank, /similarity, /decode) -----------------
class PredictParameters(_Request):
    """The Inference API's ``parameters`` (what huggingface_hub's text_classification sends)."""

    function_to_apply: Literal["softmax", "sigmoid", "none"] | None = Field(
        None, description="softmax (one label), sigmoid (each label on its own) or none (logits). "
        "Overrides raw_scores.")
    top_k: Positive | None = Field(None, description="Keep the k best labels.")


class PredictRequest(_Request):
    inputs: Annotated[Union[Annotated[Text, Tag("text")],
                            Annotated[list[Annotated[list[Text], Field(min_length=1, max_length=1)]],
                                      Field(min_length=1), Tag("list")]],
                      Discriminator(_text_or_list)] = Field(
        ..., examples=["the battery died after an hour"],
        description="A text, or a batch [[text], ...]. TEI's pairs [text, text] need a cross-encoder; "
        "these models score single texts.")
    raw_scores: bool = Field(False, description="Logits instead of softmax probabilities.")
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    hashes: HashCount = None
    parameters: PredictParameters | None = Field(
        None, description="Inference API form: with it, a single text is answered as a batch of one.")

    @field_validator("inputs", mode="before")
    @classmethod
    def _no_pairs(cls, inputs):
        if isinstance(inputs, list) and inputs and all(isinstance(t, str) for t in inputs):
            raise ValueError("text pairs [text, text] need a cross-encoder; this model scores single "
                             "texts: send a string or a batch [[text], ...]")
        return inputs

    def to_params(self) -> ClassifyParams:
        apply = self.parameters.function_to_apply if self.parameters else None
        raw = apply == "none" if apply is not None else self.raw_scores
        return ClassifyParams(texts=self.texts(), multi_label=apply == "sigmoid", raw_scores=raw,
                              hashes=self.hashes, truncation_direction=self.truncation_direction,
                              long_input=_long_input("truncate", self.truncate))

    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else [t[0] for t in self.inputs]


class RerankRequest(_Request):
    # pieces come from one pass per text, so piece_tokens excludes long_input "chunk" (the engine's 422 says so)
    model_config = ConfigDict(json_schema_extra={"not": {  # merged with _Request's (extra forbid, strict)
        "required": ["piece_tokens", "long_input"],
        "properties": {"piece_tokens": {"type": "integer"}, "long_input": {"const": "chunk"}}}})

    query: Text = Field(..., examples=["What is YOSO attention?"])
    texts: Annotated[list[Text], Field(min_length=1)] = Field(
        ..., examples=[["YOSO approximates softmax attention by hashing.", "Bananas are yellow."]])
    raw_scores: bool = Field(False, description="Cosine similarities instead of scores in (0, 1).")
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    long_input: LongInput = Field("truncate", description="Texts over the model's max length: cut, "
                                  "embedded in windows ('chunk'), or a 422.")
    hashes: HashCount = None
    piece_tokens: Positive | None = Field(None, description="Score each text by its best piece of this many "
                                          "tokens (the pieces of /embed_pieces, from the same one pass) instead of "
                                          "its whole embedding, and name that piece in the answer. At most the "
                                          "model's input length; not with long_input 'chunk'.")

    def params(self) -> tuple[EmbedParams, EmbedParams | PiecesParams]:
        """(query, texts): two calls, so that ``texts`` alone counts against max_client_batch_size; the texts
        as pieces when ``piece_tokens`` is set."""
        common = dict(truncation_direction=self.truncation_direction, hashes=self.hashes,
                      long_input=_long_input(self.long_input, self.truncate))
        whole = self.piece_tokens is None  # pieces need one pass per text, so then no chunking either
        texts = (EmbedParams(list(self.texts), chunk_hint=True, **common) if whole
                 else PiecesParams(list(self.texts), piece_tokens=self.piece_tokens, **common))
        return EmbedParams([self.query], chunk_hint=whole, **common), texts


class SimilarityInput(_Request):
    source_sentence: Text
    sentences: Annotated[list[Text], Field(min_length=1)]


class SimilarityParameters(_Request):
    truncate: bool | None = None
    truncation_direction: Direction = "right"


class SimilarityRequest(_Request):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None

    def params(self) -> EmbedParams:
        p = self.parameters or SimilarityParameters()
        return EmbedParams([self.inputs.source_sentence, *self.inputs.sentences],
                           truncation_direction=p.truncation_direction,
                           long_input=_long_input("truncate", p.truncate))


class ZeroShotParameters(_Request):
    candidate_labels: Annotated[list[Label], Field(min_length=1, json_schema_extra={"uniqueItems": True})]
    multi_label: bool = False
    hypothesis_template: Annotated[str, Field(pattern=TEMPLATE_PATTERN)] | None = Field(
        None, description="Each label is embedded as this text with the label in place of {}.")

    @field_validator("candidate_labels")
    @classmethod
    def _distinct(cls, labels: list[str]) -> list[str]:
        if len(set(labels)) != len(labels):
            raise ValueError("candidate_labels must be distinct")
        return labels


class ZeroShotRequest(_Request):
    """The Inference API's zero-shot classification (huggingface_hub's zero_shot_classification)."""

    inputs: Text
    parameters: ZeroShotParameters

    def to_params(self) -> ClassifyParams:
        p = self.parameters
        labels = [p.hypothesis_template.replace("{}", label) if p.hypothesis_template else label
                  for label in p.candidate_labels]
        return ClassifyParams(texts=[self.inputs], labels=labels, multi_label=p.multi_label)


class DecodeRequest(_Request):
    ids: Annotated[Union[Annotated[TokenIds, Tag("single")],
                         Annotated[list[TokenIds], Field(min_length=1), Tag("batch")]],
                   Discriminator(_ids_shape)] = Field(..., examples=[[101, 7592, 102]])
    skip_special_tokens: bool = True

    def batch(self) -> list[list[int]]:
        return self.ids if isinstance(self.ids[0], list) else [self.ids]


class RankPiece(BaseModel):
    tokens: list[int] = Field(description="[start, stop) token positions of the text's best piece.")
    chars: list[int] = Field(description="[start, stop) character offsets of its text.")


class Rank(BaseModel):
    index: int
    score: float
    text: str | None = Field(None, description="Only with return_text.")
    piece: RankPiece | None = Field(None, description="Only with piece_tokens: the piece that scored.")


class ScoredLabel(BaseModel):
    label: str
    score: float


class Token(BaseModel):
    id: int
    text: str
    start: int
    stop: int
    special: bool


class Piece(BaseModel):
    embedding: list[float] = Field(description="Mean of the piece's token states (normalised if asked).")
    tokens: list[int] = Field(description="[start, stop) token positions, special tokens counted.")
    chars: list[int] = Field(description="[start, stop) character offsets of the piece's text in the input; "
                             "empty ([n, n]) for a piece of special tokens only.")


class PiecedEmbedding(BaseModel):
    embedding: list[float] = Field(description="The input's embedding, as /embed gives it (mean pooling).")
    pieces: list[Piece]


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
