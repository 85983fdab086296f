"""The engine's on_ready hook (create_app's ``on_ready``): called once, after the warm-up and before the server
answers ready, never for a model that fails to start; the CLI passes freeze_heap, which freezes what exists."""

from __future__ import annotations

import asyncio
import gc

from yoso_serve.service.app import create_app
from yoso_serve.service.cli import freeze_heap
from yoso_serve.service.settings import ServeSettings


def _settings(model_dir) -> ServeSettings:
    return ServeSettings(model=model_dir, runtime="torch", dense_dtype="fp32", chunk_overlap=16)


def _start(app) -> str:
    """Run the app's lifespan until its engine has started or failed; its state then."""
    async def main():
        async with app.router.lifespan_context(app):
            try:
                await app.state.startup
            except Exception:  # noqa: BLE001 - a failed start is what one case checks
                pass
            return app.state.engine.state

    return asyncio.run(main())


def test_on_ready_runs_once_warmed_up_just_before_ready(tiny_dir):
    seen = []

    def on_ready():
        engine = app.state.engine
        seen.append((engine.state, engine.scheduler.admission.estimate.last is not None))

    app = create_app(_settings(tiny_dir), on_ready=on_ready)
    assert _start(app) == "ready"
    # once, still loading, with the speed probe measured: the warm-up had run
    assert seen == [("loading", True)]


def test_on_ready_is_not_called_when_the_model_fails_to_start(tiny_dir):
    def broken():
        raise OSError("no weights here")

    calls = []
    app = create_app(_settings(tiny_dir), load_model=broken, model_name="broken", on_ready=lambda: calls.append(1))
    assert _start(app) == "failed" and calls == []


def test_freeze_heap_collects_then_freezes_what_exists():
    survivor = [object() for _ in range(1000)]
    before = gc.get_freeze_count()
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= before + len(survivor)
        assert gc.get_count()[0] < 100  # collected first: the young generation starts empty
    finally:
        gc.unfreeze()
