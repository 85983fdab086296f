"""``yoso-serve``: parse flags (each setting also ``YOSO_<NAME>``), validate, run uvicorn with a graceful drain.

``yoso-serve --prepare`` loads the model for its runtime (with ``--runtime hybrid``: the ONNX export into
the cache, written once), prints the resolved runtime as JSON and exits 0 without serving (1 when the
model cannot be loaded for it): an image or an install step warms the cache with it.

SIGTERM/SIGINT: the engine stops taking work at once (/ready and new requests → 503), uvicorn stops
accepting connections and waits up to --drain-timeout for accepted requests, then the lifespan
shutdown runs what is still queued and the process exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import typing

import uvicorn
from pydantic import ValidationError

from .heap import retain_freed_memory
from .settings import CPU_PADDING_TOKENS, CUDA_PADDING_TOKENS, ServeSettings, describe_errors, env_name, flag_name

# uvicorn's C parser (a dependency), named so that a missing one fails at start instead of falling back to h11:
# with h11 a refused request cost the event loop twice what it costs with httptools.
HTTP_PARSER = "httptools"


def freeze_heap() -> None:
    """Everything the server holds once warmed up (the model, the libraries, the app) lives as long as the
    process: collected once and frozen out of the collector's sight, it is never walked again. A full
    collection over it took about 130 ms, holding the GIL, and so stopped the event loop in the middle of a
    burst of requests (docs/benchmarks.md, "Overload"). Only for a process that serves one app for its life:
    a frozen object that dies later is never freed if it sits in a cycle."""
    gc.collect()
    gc.freeze()


# What --help says for the settings whose default is None (decided later, or "not set").
NONE_DEFAULTS = {
    "model": "the bundled model",
    "metrics_port": "off",
    "api_key": "none (no key required)",
    "max_padding_tokens": f"{CPU_PADDING_TOKENS} on CPU, {CUDA_PADDING_TOKENS} on CUDA",
    "max_input_length": "the model's max_position_embeddings",
    "threads": "torch's choice",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yoso-serve", description="Serve a YOSO encoder over HTTP. Every setting is a flag and an env "
        "var YOSO_<NAME> (flags win); --prepare is a flag only. See docs/configuration.md.")
    for name, field in ServeSettings.model_fields.items():
        default = NONE_DEFAULTS.get(name, "none") if field.default is None else field.default
        help_text = f"{field.description} [env {env_name(name)}; default {default}]"
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        if field.annotation is bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag_name(name), default=argparse.SUPPRESS, choices=choices,
                                metavar=name.upper(), help=help_text.replace("%", "%%"))
    parser.add_argument("--prepare", action="store_true", help="Load the model for its runtime (hybrid: write "
                        "the ONNX export into YOSO_CACHE_DIR if it is not there), print the resolved runtime "
                        "as JSON and exit 0 without serving.")
    return parser


def _parse(argv: list[str] | None) -> tuple[ServeSettings, bool]:
    given = vars(build_parser().parse_args(argv))
    prepare = given.pop("prepare")
    try:
        return ServeSettings(**given), prepare
    except ValidationError as err:
        print(f"yoso-serve: {describe_errors(err)}", file=sys.stderr)
        raise SystemExit(2) from None


def load_settings(argv: list[str] | None = None) -> ServeSettings:
    """Flags over env over defaults; exits 2 with a how-to-fix message when something is wrong."""
    return _parse(argv)[0]


def prepare(settings: ServeSettings) -> int:
    """``--prepare``: load (exporting into the cache if needed), print what would serve, 0 or 1."""
    import torch

    from .loading import check_model_limits, load_served_model

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        loaded = load_served_model(settings)
        check_model_limits(settings, loaded.model)  # what a start would refuse, --prepare refuses
    except Exception as exc:  # a bad checkpoint, a hybrid export that cannot be written: a start would exit 1 too
        print(f"yoso-serve --prepare: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"runtime": loaded.runtime, "reason": loaded.reason,
                      "onnx_export": None if loaded.export is None else str(loaded.export)}))
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, told to flip the engine to draining the moment a signal arrives."""

    def __init__(self, config: uvicorn.Config, engine) -> None:
        super().__init__(config)
        self.engine = engine
        self.exit_code = 0

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_drain()
        super().handle_exit(sig, frame)

    def fatal(self, exc: BaseException) -> None:
        self.exit_code = 1
        self.should_exit = True


def main(argv: list[str] | None = None) -> None:
    settings, prepare_only = _parse(argv)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if prepare_only:
        sys.exit(prepare(settings))
    log = logging.getLogger("yoso_serve.service")
    shown = settings.model_dump(exclude={"api_key"}, mode="json")
    log.info("settings: %s, api_key %s", shown, "set" if settings.api_key else "not set")
    log.info("heap: %s", retain_freed_memory())  # before the model loads: its buffers come from the same heap

    from .app import create_app

    holder: dict = {}
    app = create_app(settings, on_fatal=lambda exc: holder["server"].fatal(exc), on_ready=freeze_heap)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.drain_timeout), lifespan="on", http=HTTP_PARSER)
    server = holder["server"] = _DrainingServer(config, app.state.engine)
    # uvicorn re-raises the caught signal after a graceful shutdown; a no-op handler makes that
    # re-raise harmless so a clean drain exits 0 (what orchestrators expect) instead of -15.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    sys.exit(server.exit_code)
