"""Server settings: one pydantic-settings model, every field a ``--flag`` and a ``YOSO_<NAME>`` env var.

Precedence: command-line flag > environment variable > default. Cross-field rules (batch budget vs
input length, runtime availability) are checked here so a bad deployment fails at start with a
message that says how to fix it, not on the first request.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from yoso_serve.model.hashes import AUTO, AUTO_EXACT_BELOW, MAX_HASHES, resolve_hashes

from .runtimes import check_hybrid_serving, check_onnx_serving

# Defaults of --max-padding-tokens (see ServeSettings.padding_limit).
CPU_PADDING_TOKENS = 64
CUDA_PADDING_TOKENS = 2048
# Upper bounds that keep a typo from crashing the process: torch sizes its thread pool by --threads (100000
# segfaults it), and the drain's deadline must be a timestamp the platform can hold (inf or 1e30 overflow).
MAX_THREADS = 1024
MAX_DRAIN_S = 86400.0


class ServeSettings(BaseSettings):
    """Everything an operator can set. Field descriptions double as ``--help`` text and docs."""

    model_config = SettingsConfigDict(env_prefix="YOSO_", extra="forbid", validate_default=True)

    model: Path | None = Field(None, description="Model directory (config.json + weights + tokenizer). "
                               "Default: the bundled default model (`default_model_dir()`).")
    host: str = Field("0.0.0.0", description="Bind address. 0.0.0.0 suits containers; use 127.0.0.1 "
                      "to keep the server local.")
    port: int = Field(8080, ge=1, le=65535, description="HTTP port.")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="Extra port that serves only "
                                     "/metrics (it is always on the main port too).")
    api_key: SecretStr | None = Field(None, description="Require `Authorization: Bearer <key>` on "
                                      "every route except /health, /ready, /metrics and the docs. Never logged.")
    hashes: Union[Annotated[int, Field(ge=0)], Literal["auto"]] = Field(
        AUTO, description="Default hash count per request. auto = per input, exact YOSO-E below "
        "--auto-exact-below tokens and the model's count (0 if use_expectation else num_hash) at and above; "
        "m = m LSH samples; 0 = exact YOSO-E for every input.")
    auto_exact_below: int = Field(AUTO_EXACT_BELOW, ge=0, description="Under hashes=auto, inputs with fewer "
                                  "tokens than this (specials included) run exact YOSO-E, which costs less "
                                  "than LSH there (measured: docs/benchmarks.md); 0 = never. The same on torch and hybrid; "
                                  "--runtime onnx needs 0 (or a --hashes count).")
    max_hashes: int = Field(MAX_HASHES, ge=0, description="Largest hash count a request may ask for.")
    max_batch_tokens: int = Field(16384, ge=1, description="Token budget of one batch, counted "
                                  "padded (batch size x longest input); also the most vectors one /embed_all "
                                  "(token states) or /embed_pieces (pieces) answer may hold.")
    max_batch_requests: int = Field(64, ge=1, description="Most inputs in one batch.")
    max_padding_tokens: int | None = Field(None, ge=0, description="Most padding tokens one input may "
                                           "add to a batch (a forward's fixed cost, counted in tokens); "
                                           "an input that would add more waits for a batch nearer its "
                                           "length. Default: 64 on CPU (measured), 2048 on CUDA.")
    max_wait_ms: float = Field(0.0, ge=0, description="How long an idle batcher waits for a fuller "
                               "batch once the oldest item is queued. 0: run what is queued at once (inputs "
                               "that arrive during a forward batch together anyway).")
    max_queue_tokens: int = Field(262144, ge=1, description="Queued tokens above which new "
                                  "requests get 429 with Retry-After (a hard cap under the "
                                  "admission by predicted wait).")
    max_client_batch_size: int = Field(64, ge=1, description="Most inputs in one request.")
    max_input_length: int | None = Field(None, ge=2, description="Token limit per input (with "
                                         "specials). Default and upper bound: the model's "
                                         "max_position_embeddings.")
    payload_limit: int = Field(2_000_000, ge=1, description="Largest request body in bytes "
                               "(checked before parsing, chunked bodies included).")
    request_timeout: float = Field(30.0, gt=0, description="Seconds a request may wait in the queue "
                                   "before its first input starts, else 504; once started, all its inputs "
                                   "run however long they take. A request whose predicted wait is "
                                   "over 0.8 x this gets 429 at once; a client may ask for less with "
                                   "the x-request-timeout header, never more.")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch CPU threads. Default: torch's "
                                "choice (the number of cores).")
    forward_nice: int = Field(10, ge=0, le=19, description="How much lower than the event loop the forward's "
                              "threads run (Linux nice, added to the process's): the forward fills every core, and "
                              "at equal priority the event loop waited its turn for a core, so refusals and "
                              "health checks took hundreds of ms under load (docs/benchmarks.md). The forward "
                              "still gets every core the event loop does not use. 0 = equal priority.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when "
                                                   "available, else cpu.")
    runtime: Literal["auto", "torch", "hybrid", "onnx"] = Field(
        "auto", description="Inference runtime. auto = the faster per device, torch on both CPU and CUDA "
        "(docs/benchmarks.md). torch = torch only; hybrid = ONNX Runtime for the served hash count "
        "(exported into YOSO_CACHE_DIR at the first start) and torch for other counts, needs the onnx "
        "extra; onnx = ONNX Runtime only, --model must be a directory written by `yoso-train export-onnx` "
        "(docs/onnx.md).")
    dense_dtype: Literal["auto", "fp32", "bf16", "int8"] = Field(
        "auto", description="Precision of the dense layers' matrix products on CPU (torch runtime; the attention "
        "kernels and the residual stream stay fp32). bf16 = bf16 inputs and weights, fp32 sums: about 1.5x the "
        "speed of a forward where the CPU has bf16 instructions (AVX512-BF16 or AMX), embeddings within about "
        "1e-3 of fp32 and retrieval unchanged (docs/benchmarks.md, \"Dense layers\"). int8 = per-channel int8 "
        "weights, activations quantized per row (LayerNorm-fed layers smoothed), int32 sums; opt-in: 1.29-1.51x "
        "bf16's forward with AVX-512 VNNI (1.43-1.75x fp32's on AVX2 CPUs, weights to +-63 there but FFN out's +-127), "
        "0.998-0.999 cosine to fp32 at hashes=auto, short-text recall@1 -0.012 and +0.003 of fp32's on two unseen "
        "corpora (-0.008 on AVX2) (docs/benchmarks.md, \"int8 GEMMs\"). auto = bf16 on such a CPU, else fp32.")
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="Weights and activations of the torch runtime on CUDA. auto = float16 on CUDA (what "
        "text-embeddings-inference serves there), float32 on CPU, where --dense-dtype picks the precision of the "
        "matrix products instead. float16 and bfloat16 need CUDA and the torch runtime.")
    exact_kernel: Literal["auto", "op", "flex"] = Field(
        "auto", description="Kernel of exact mode (0 hashes: queries and short texts under auto, every input at "
        "--hashes 0) in the torch runtime. op = the attention op (C++ on CPU, chunked PyTorch on CUDA). flex = "
        "one fused FlexAttention kernel compiled by torch.compile, CUDA with Triton only: the same embeddings "
        "to within fp16 rounding, every 256-token length bucket compiled before the server turns ready. "
        "auto = op, until flex is measured on a GPU (docs/cuda.md, \"Exact mode as one fused kernel\").")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Server log level.")
    log_texts: bool = Field(False, description="Log input texts (debugging only; off by default).")
    chunk_overlap: int = Field(64, ge=0, description="Tokens shared by neighbouring windows "
                               "when long_input=\"chunk\".")
    drain_timeout: float = Field(30.0, ge=0, le=MAX_DRAIN_S, description="Seconds SIGTERM waits for accepted "
                                 "requests to finish before cancelling them.")

    @field_validator("host")
    @classmethod
    def _resolvable(cls, host: str) -> str:
        """An address uvicorn cannot bind fails late and hard (the process aborts); say so at start."""
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError) as exc:
            raise ValueError(f"{host!r} is not an address or host name this machine can resolve ({exc})") from None
        return host

    @model_validator(mode="after")
    def _check_start(self) -> "ServeSettings":
        if self.dtype in ("float16", "bfloat16"):
            if self.runtime not in ("auto", "torch"):
                raise ValueError(f"--dtype {self.dtype} is for the torch runtime; --runtime {self.runtime} runs "
                                 "float32")
            if self.resolved_device() != "cuda":
                raise ValueError(f"--dtype {self.dtype} is for CUDA; on a CPU --dense-dtype bf16 runs the matrix "
                                 "products in bf16 and keeps the rest float32")
        if self.exact_kernel == "flex":
            if self.runtime == "onnx":
                raise ValueError("--exact-kernel flex is a torch kernel; --runtime onnx never runs it")
            if self.resolved_device() != "cuda":
                raise ValueError("--exact-kernel flex runs on CUDA only (on a CPU the C++ exact kernel is 4-5x "
                                 "faster than FlexAttention); use --exact-kernel op or --device cuda")
            from yoso_serve.kernels import flex

            if (why := flex.unavailable("cuda")) is not None:
                raise ValueError(f"--exact-kernel flex cannot run here: {why}; use --exact-kernel op")
        if self.runtime == "onnx":
            check_onnx_serving(self.model, self.hashes, self.auto_exact_below)
        if self.runtime == "hybrid":
            check_hybrid_serving(self.hashes)
        resolve_hashes(None, self.hashes, source="setting", max_hashes=self.max_hashes)
        if self.model is not None and not (self.model / "config.json").is_file():
            raise ValueError(f"--model {self.model} has no config.json; point --model / YOSO_MODEL "
                             "at a directory written by save_pretrained or yoso-convert")
        if self.metrics_port is not None and self.metrics_port == self.port:
            raise ValueError(f"--metrics-port {self.metrics_port} is --port too; give /metrics another port or "
                             "leave --metrics-port unset (/metrics is always on the main port)")
        if self.max_input_length is not None and self.max_input_length > self.max_batch_tokens:
            raise ValueError(f"--max-input-length {self.max_input_length} is above "
                             f"--max-batch-tokens {self.max_batch_tokens}: one input must fit in a batch")
        if self.dense_dtype == "bf16":
            from yoso_serve.model.linear import bf16_gemms

            if not bf16_gemms():
                raise ValueError("--dense-dtype bf16 but this CPU has no bf16 GEMM in oneDNN (it needs AVX-512); "
                                 "use --dense-dtype fp32 or auto")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda but no CUDA device is visible; use --device cpu or auto")
        return self

    def resolved_device(self) -> str:
        """``auto`` made concrete: ``cuda`` when a GPU is visible, else ``cpu``."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        """``dtype`` made concrete: ``auto`` is float16 for the torch runtime on CUDA, else float32."""
        if self.dtype != "auto":
            return self.dtype
        return "float16" if self.resolved_device() == "cuda" and self.runtime in ("auto", "torch") else "float32"

    def resolved_exact_kernel(self) -> str:
        """``exact_kernel`` made concrete: ``auto`` is the op everywhere until flex is measured on a GPU."""
        return "op" if self.exact_kernel == "auto" else self.exact_kernel

    def resolved_dense_dtype(self) -> str:
        """``dense_dtype`` made concrete: ``auto`` is bf16 where the CPU multiplies bf16 in hardware."""
        if self.dense_dtype != "auto":
            return self.dense_dtype
        from yoso_serve.model.linear import native_bf16

        return "bf16" if native_bf16() else "fp32"

    def padding_limit(self, device: str) -> int:
        """``max_padding_tokens`` made concrete for ``device``. On 2 CPU cores a forward's fixed cost
        is worth about 40-60 tokens (one 8-token input costs what 50 more tokens cost: bench notes in
        docs/benchmarks.md); on a GPU, where launches dominate short batches, it is far larger."""
        if self.max_padding_tokens is not None:
            return self.max_padding_tokens
        return CUDA_PADDING_TOKENS if device.startswith("cuda") else CPU_PADDING_TOKENS


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return "YOSO_" + field.upper()


def describe_errors(err: ValidationError) -> str:
    """One line per problem, naming both the flag and the env var so the operator can fix either."""
    lines = []
    for e in err.errors():
        field = str(e["loc"][0]) if e["loc"] else ""
        where = f"{flag_name(field)} / {env_name(field)}: " if field else ""
        lines.append(f"  {where}{e['msg'].removeprefix('Value error, ')}")
    return "invalid settings:\n" + "\n".join(lines)
