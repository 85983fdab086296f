"""Prometheus instruments on an app-owned registry (not the global one: tests build many apps).

Every name starts with ``yoso_``. Durations are seconds, as Prometheus conventions ask.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 1 ms to 60 s: queue waits are sub-millisecond to seconds, long documents run seconds.
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def power_of_two_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 4, ... up to and including ``limit`` (which need not be a power of two)."""
    buckets, b = [], 1
    while b < limit:
        buckets.append(float(b))
        b *= 2
    buckets.append(float(limit))
    return tuple(buckets)


class ServiceMetrics:
    """All instruments of one app. ``max_batch_tokens`` tops the batch-token histogram, and the
    input-length one until :meth:`set_model_info` narrows it to the served model's input limit."""

    def __init__(self, max_batch_tokens: int = 16384) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("yoso_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=r)
        self.request_duration = Histogram("yoso_request_duration_seconds", "HTTP request duration",
                                          ["route", "status"], buckets=_SECONDS, registry=r)
        self.failures = Counter("yoso_failures", "Failed requests by reason", ["reason"], registry=r)
        self.in_flight = Gauge("yoso_in_flight_requests", "Requests being served (work routes)",
                               registry=r)
        self.queue_items = Gauge("yoso_queue_items", "Inputs waiting in the batch queue", registry=r)
        self.queue_tokens = Gauge("yoso_queue_tokens", "Tokens waiting in the batch queue", registry=r)
        self.queue_wait = Histogram("yoso_queue_wait_seconds", "Time an input waited in the queue",
                                    buckets=_SECONDS, registry=r)
        self.rejections = Counter("yoso_rejections", "Requests refused with 429 at admission, by reason: "
                                  "predicted_wait (would start after its deadline) or queue_full "
                                  "(over max_queue_tokens)", ["reason"], registry=r)
        for reason in ("predicted_wait", "queue_full"):  # both series exist from the start, at 0
            self.rejections.labels(reason)
        self.predicted_wait = Histogram("yoso_admission_predicted_wait_seconds", "Predicted wait before an "
                                        "admitted request's first input starts", buckets=_SECONDS, registry=r)
        self.actual_wait = Histogram("yoso_admission_actual_wait_seconds", "Actual wait before an admitted "
                                     "request's first input started (requests with a prediction only)",
                                     buckets=_SECONDS, registry=r)
        self.throughput = Gauge("yoso_throughput_padded_tokens_per_second", "The admission's running "
                                "estimate of padded tokens per second, per hash count", ["hashes"], registry=r)
        self.tokenize_duration = Histogram("yoso_tokenize_duration_seconds",
                                           "Tokenisation time per request", buckets=_SECONDS, registry=r)
        self.inference_duration = Histogram("yoso_inference_duration_seconds",
                                            "Forward time per batch", buckets=_SECONDS, registry=r)
        self.batch_size = Histogram("yoso_batch_size", "Inputs per batch", buckets=_BATCH_SIZES,
                                    registry=r)
        self.batch_tokens = Histogram("yoso_batch_tokens", "Padded tokens per batch",
                                      buckets=power_of_two_buckets(max_batch_tokens), registry=r)
        # no input is longer than a batch; set_model_info narrows this to the model's limit
        self.input_length = self._input_length(max_batch_tokens)
        self.tokens = Counter("yoso_tokens_processed", "Real (unpadded) tokens run through the model",
                              registry=r)
        self.inputs_by_hashes = Counter("yoso_inputs_by_hashes", "Inputs run (a chunked input's windows "
                                        "one each) by the hash count each ran with (0 = exact YOSO-E)",
                                        ["hashes"], registry=r)
        self.model_info = Info("yoso_model", "Served model and how it runs", registry=r)
        self.gpu_memory = Gauge("yoso_gpu_memory_bytes", "CUDA memory allocated by torch (CUDA only)",
                                registry=r)
        self.ready = Gauge("yoso_ready", "1 when the model is loaded and warmed up and not draining",
                           registry=r)
        self.device = "cpu"

    def _input_length(self, limit: int) -> Histogram:
        return Histogram("yoso_input_length_tokens", "Tokens per input (after truncation)",
                         buckets=power_of_two_buckets(limit), registry=self.registry)

    def set_model_info(self, *, model: str, hashes: int, backend: str, device: str, runtime: str,
                       max_length: int, policy: str | None = None, auto_exact_below: int | None = None) -> None:
        """``hashes``: the count at and above auto's crossover (always, under a fixed ``policy``);
        ``max_length``: the served input limit, the input-length histogram's top bucket (set before
        any input is observed); ``policy``: --hashes ("auto" or a count); ``auto_exact_below``: the
        crossover in tokens."""
        self.registry.unregister(self.input_length)
        self.input_length = self._input_length(max_length)
        self.model_info.info({"model": model, "hashes": str(hashes), "backend": backend,
                              "device": device, "runtime": runtime, "hashes_policy": str(policy or hashes),
                              "auto_exact_below": str(auto_exact_below or 0)})
        self.device = device

    def exposition(self) -> bytes:
        if self.device.startswith("cuda"):
            import torch

            self.gpu_memory.set(torch.cuda.memory_allocated())
        return generate_latest(self.registry)
