"""Admission by predicted wait: the pure policy, the client's deadline header, and the engine with a
stub model of known speed (rejections when and only when the queue ahead outlasts the deadline)."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from yoso_serve.model import load_pretrained
from yoso_serve.service.admission import (ADMIT_SHARE, AdmissionPolicy, Running, ThroughputEstimate,
                                          client_deadline, parse_client_timeout, request_budget)
from yoso_serve.service.errors import InvalidInput, Overloaded
from yoso_serve.service.metrics import ServiceMetrics
from yoso_serve.service.scheduler import BatchScheduler, OutputKind, WorkItem


# --- the estimate and the policy, no threads, no clock --------------------------------------------
def test_estimate_is_padded_tokens_per_second_weighted_by_tokens():
    est = ThroughputEstimate()
    assert not est.known(32)
    est.observe(32, real_tokens=3, padded_tokens=5, seconds=0.05)  # warm-up: tiny, overhead-bound
    assert est.padded_tokens_per_s(32) == pytest.approx(100)
    for _ in range(3):  # real batches at 4000 padded tokens/s, half of them padding
        est.observe(32, real_tokens=8000, padded_tokens=16000, seconds=4.0)
    assert est.padded_tokens_per_s(32) == pytest.approx(4000, rel=0.01)  # the tiny batch barely counts
    assert est.padding(32) == pytest.approx(2.0, rel=0.01)
    assert est.seconds_for(32, 2000) == pytest.approx(1.0, rel=0.01)  # 2000 real = 4000 padded = 1 s
    assert not est.known(0)


def test_estimate_follows_a_change_of_speed_within_about_ten_batches():
    est = ThroughputEstimate()
    for _ in range(20):
        est.observe(0, 1000, 1000, 1.0)
    for _ in range(20):
        est.observe(0, 1000, 1000, 0.5)  # twice as fast now
    assert est.padded_tokens_per_s(0) == pytest.approx(2000, rel=0.1)


def _policy(rate: float = 1000.0, hashes: int = 32, cap: int = 10**6) -> AdmissionPolicy:
    policy = AdmissionPolicy(max_queue_tokens=cap)
    policy.estimate.observe(hashes, int(rate), int(rate), 1.0)  # rate tokens/s, no padding
    return policy


def test_admitted_exactly_while_the_predicted_start_is_within_the_share_of_the_deadline():
    policy = _policy(rate=1000)
    queued = {32: 1000}  # 1 s of work ahead
    assert policy.predicted_wait(queued, None) == pytest.approx(1.0)
    at_limit = 1.0 / ADMIT_SHARE
    assert policy.decide(queued=queued, running=None, budget=at_limit + 1e-6).admitted
    refused = policy.decide(queued=queued, running=None, budget=at_limit - 0.01)
    assert refused.reason == "predicted_wait" and refused.retry_after == 1
    assert "predicted queue wait 1.00 s" in refused.message and "request_timeout" in refused.message
    # Retry-After: how long until enough of the queue has run for the request to fit, and never
    # more than the deadline (by then all that is queued now has started or been dropped)
    late = policy.decide(queued={32: 6000}, running=None, budget=5.0)
    assert late.retry_after == math.ceil(6.0 - ADMIT_SHARE * 5.0) == 2
    assert policy.decide(queued={32: 100000}, running=None, budget=5.0).retry_after == 5
    assert policy.decide(queued={}, running=None, budget=0.001).admitted  # an idle server takes anything


def test_the_running_batch_counts_what_is_left_of_it():
    policy = _policy(rate=1000)
    running = Running(hashes=32, padded_tokens=2000, elapsed=0.5)  # a 2 s batch, 0.5 s in
    assert policy.predicted_wait({32: 500}, running) == pytest.approx(1.5 + 0.5)
    overdue = Running(hashes=32, padded_tokens=2000, elapsed=3.0)
    assert policy.predicted_wait({}, overdue) == 0.0


def test_each_hash_count_at_its_own_speed_or_a_measured_stand_ins():
    policy = _policy(rate=1000, hashes=32, cap=5000)
    policy.estimate.observe(0, 100, 100, 1.0)  # exact attention: 100 tokens/s
    assert policy.predicted_wait({32: 1000, 0: 100}, None) == pytest.approx(2.0)
    # an LSH count that never ran goes at a measured one's speed, erring slow: 8 at 32's (more hashes cost
    # more), 64 at 32's halved (as if all cost grew with the count)
    assert not policy.estimate.known(8) and policy.estimate.predictable(8)
    assert policy.predicted_wait({8: 1000}, None) == pytest.approx(1.0)
    assert policy.predicted_wait({64: 1000}, None) == pytest.approx(2.0)
    assert policy.predicted_wait({}, Running(64, 2000, 1.0)) == pytest.approx(3.0)
    refused = policy.decide(queued={128: 1000}, running=None, budget=4.0, tokens=10)  # 4 s ahead > 0.8 x 4 s
    assert refused.reason == "predicted_wait" and refused.predicted_wait == pytest.approx(4.0)
    policy.estimate.observe(64, 1000, 1000, 1.5)  # once 64 ran, its own speed counts
    assert policy.predicted_wait({64: 1000}, None) == pytest.approx(1.5)
    assert policy.predicted_wait({48: 1000}, None) == pytest.approx(1.5)  # the fewest measured above 48: 64
    # exact mode that never ran has no stand-in (its cost grows with length squared): the token cap alone
    exact = _policy(rate=1000, hashes=32, cap=5000)
    assert exact.predicted_wait({0: 10}, None) is None
    assert exact.decide(queued={0: 10}, running=None, budget=0.001, tokens=10).admitted
    assert exact.predicted_wait({}, Running(0, 10, 0.0)) is None
    full = exact.decide(queued={0: 4000}, running=None, budget=100, tokens=2000)
    assert full.reason == "queue_full" and "max_queue_tokens=5000" in full.message
    assert full.retry_after == 1  # 1000 tokens over, at the fallback 1000 tokens/s
    # nothing measured at all: no LSH count has a stand-in either
    assert AdmissionPolicy(max_queue_tokens=10).predicted_wait({8: 10}, None) is None
    full = policy.decide(queued={32: 4000}, running=None, budget=100, tokens=3000)
    assert full.reason == "queue_full" and full.retry_after == 2  # 2000 over at the measured 1000/s
    assert policy.decide(queued={}, running=None, budget=100, tokens=10**6).admitted  # empty queue: any size


def test_requests_being_tokenised_count_ahead_at_the_learned_tokens_per_character():
    policy = _policy(rate=1000)
    assert policy.tokens_per_char == 0.25  # until a request has been tokenised: 4 characters a token
    for _ in range(60):
        policy.note_text(chars=1000, tokens=125)  # this text: 8 characters a token
    assert policy.tokens_per_char == pytest.approx(0.125, rel=0.01)
    queued = {32: 500}  # 0.5 s ahead; limit 0.8 x 1 s
    # 1600 characters being tokenised: 200 tokens, 0.2 s at the last measured speed
    assert policy.decide(queued=queued, running=None, budget=1.0, tokenizing_chars=1600).admitted  # 0.7 s
    refused = policy.decide(queued=queued, running=None, budget=1.0, tokenizing_chars=3200)  # 0.9 s
    assert refused.reason == "predicted_wait" and refused.predicted_wait == pytest.approx(0.9, rel=0.01)
    assert AdmissionPolicy(max_queue_tokens=10).decide(queued={}, running=None, budget=1.0,
                                                       tokenizing_chars=10**9).admitted  # no speed known yet


@pytest.mark.parametrize("raw,want", [(None, None), (b"2.5", 2.5), (b" 10 ", 10.0)])
def test_client_timeout_header_parses(raw, want):
    assert parse_client_timeout(raw) == want


@pytest.mark.parametrize("raw", [b"abc", b"0", b"-1", b"nan", b"inf", b""])
def test_client_timeout_header_refuses_what_is_not_a_positive_number(raw):
    with pytest.raises(InvalidInput) as info:
        parse_client_timeout(raw)
    assert info.value.param == "x-request-timeout" and "positive number of seconds" in info.value.message


def test_budget_is_the_server_timeout_or_less_never_more():
    assert request_budget(30.0) == 30.0
    token = client_deadline.set(time.monotonic() + 5.0)
    try:
        assert 4.9 < request_budget(30.0) <= 5.0
        assert request_budget(2.0) == 2.0  # the client cannot extend the server's deadline
    finally:
        client_deadline.reset(token)


def test_scheduler_measures_every_batch_but_the_first_and_counts_the_running_one():
    def forward(batch):
        time.sleep(0.2 if batch[0].length == 1 else 0.05)  # the first (warm-up) batch is slow
        return [0] * len(batch)

    async def main():
        loop = asyncio.get_running_loop()
        s = BatchScheduler(forward, max_batch_tokens=1000, max_batch_requests=8, max_wait_ms=0,
                           max_queue_tokens=10**6, metrics=ServiceMetrics())
        s.start()
        items = lambda n, budget=10.0: [WorkItem(list(range(n)), 32, OutputKind.EMBED, None, time.monotonic() + budget,
                                                 loop.create_future(), loop)]
        first = items(1)
        assert s.submit(first).predicted_wait == 0  # an idle server: no wait
        await asyncio.sleep(0.05)
        assert s.submit(items(50)).predicted_wait is None  # the running batch's speed is unknown
        await first[0].future
        assert not s.admission.estimate.known(32)  # the warm-up taught nothing
        await asyncio.sleep(0.2)
        assert s.admission.estimate.padded_tokens_per_s(32) == pytest.approx(1000, rel=0.3)  # 50 in 0.05 s
        running = items(50)
        s.submit(running)
        await asyncio.sleep(0.01)
        assert 0 < s.submit(items(50)).predicted_wait <= 0.05  # what is left of the running batch
        with pytest.raises(Overloaded) as info:  # the 50 queued alone take 0.05 s, over 0.8 x 0.05 s
            s.submit(items(50, budget=0.05))
        assert info.value.code == "predicted_wait"
        s.close(5)

    asyncio.run(main())


# --- the engine, with a model of known speed ------------------------------------------------------
SECONDS_PER_TOKEN = 0.1 / 8  # one 8-token input: 0.1 s
TEXT = "one two three four five six"  # 8 tokens with the specials
JSON = {"content-type": "application/json"}


def known_speed_loader(path):
    """The tiny model, whose forward takes exactly SECONDS_PER_TOKEN per padded token (plus its own
    few milliseconds): the throughput the engine should learn."""
    def load():
        model = load_pretrained(path)
        real = model.embed

        def embed(ids, *args, **kw):
            time.sleep(ids.numel() * SECONDS_PER_TOKEN)
            return real(ids, *args, **kw)

        model.embed = embed
        return model

    return load


def _serve_known_speed(serve, tiny_dir):
    # one input per batch: a queue of n inputs is n x 0.1 s of work; the deadline is 1 s, so a
    # request is admitted while at most 0.8 s of work is ahead of it
    return serve(tiny_dir, chunk_overlap=16, load_model=known_speed_loader(tiny_dir), max_batch_requests=1,
                 max_wait_ms=0, request_timeout=1.0)


def test_engine_refuses_when_and_only_when_the_queue_ahead_outlasts_the_deadline(tiny_dir, serve, metric):
    async def post(c, headers=None):
        t0 = time.monotonic()
        r = await c.post("/embed", json={"inputs": TEXT}, headers=headers)
        return r, time.monotonic() - t0

    async def main():
        async with _serve_known_speed(serve, tiny_dir) as c:
            sequential = [await post(c) for _ in range(4)]  # the estimate learns from real batches
            burst = await asyncio.gather(*(post(c) for _ in range(30)))
            sums = {k: (metric(c, f"yoso_admission_{k}_wait_seconds_sum"),
                        metric(c, f"yoso_admission_{k}_wait_seconds_count")) for k in ("predicted", "actual")}
            rejected = metric(c, "yoso_rejections_total", reason="predicted_wait")
            return burst, sequential, sums, rejected

    burst, sequential, sums, rejected = asyncio.run(main())
    statuses = [r.status_code for r, _ in burst]
    accepted = [(r, s) for r, s in burst if r.status_code == 200]
    refused = [(r, s) for r, s in burst if r.status_code == 429]
    assert len(accepted) + len(refused) == 30  # no 504: accepted work is never dropped
    # Work ahead of the k-th accepted input: (k - 1) x 0.1 s plus the tiny model's own few ms per
    # batch, so 8 or 9 fit in 0.8 s; allow one either way for a busy machine.
    assert 7 <= len(accepted) <= 10, statuses
    assert rejected == len(refused)
    for r, seconds in refused:
        err = r.json()["error"]
        assert err["code"] == "predicted_wait" and int(r.headers["retry-after"]) >= 1
        assert "limit of 0.80 s" in err["message"]
        predicted = float(err["message"].split("predicted queue wait ")[1].split(" s")[0])
        assert predicted >= 0.80  # over the limit, to the message's two decimals
    assert max(float(r.headers["x-queue-time"]) for r, _ in accepted) <= 1000  # all started in time
    assert all(r.status_code == 200 for r, _ in sequential)  # an idle server refuses nothing
    # the prediction matches the stub's known speed (its own forward adds a few ms per batch)
    (p_sum, p_n), (a_sum, a_n) = sums["predicted"], sums["actual"]
    assert p_n == a_n >= len(accepted)
    assert abs(p_sum / p_n - a_sum / a_n) < 0.05 + 0.15 * a_sum / a_n, (p_sum / p_n, a_sum / a_n)


def test_client_deadline_header_lowers_the_limit_but_never_raises_it(tiny_dir, serve):
    async def main():
        async with _serve_known_speed(serve, tiny_dir) as c:
            def post(text=TEXT, timeout=None):
                headers = {"x-request-timeout": timeout} if timeout else None
                return asyncio.create_task(c.post("/embed", json={"inputs": text}, headers=headers))

            for _ in range(4):  # the estimate learns from real batches
                await post()
            background = [post() for _ in range(6)]
            await asyncio.sleep(0.15)  # ~0.45 s of work ahead now
            short, ok = post(timeout="0.2"), post(timeout="5")  # limits 0.16 s and (capped) 0.8 s
            await asyncio.sleep(0.05)
            # 62 tokens, 0.78 s: admitted with ~0.5 s ahead, it leaves ~1.2 s ahead, over the 0.8 s limit
            long_input = post("word " * 60)
            await asyncio.sleep(0.1)
            capped = await post(timeout="100")
            bad = await post(timeout="soon")
            return await short, await ok, capped, bad, await asyncio.gather(*background, long_input)

    def deadline(r):  # the seconds left when it was judged: the header's (or the cap's), less what has passed
        return float(r.json()["error"]["message"].split("deadline of ")[1].split(" s")[0])

    short, ok, capped, bad, rest = asyncio.run(main())
    assert short.status_code == 429 and 0.10 < deadline(short) <= 0.20
    assert ok.status_code == 200
    assert capped.status_code == 429 and 0.90 < deadline(capped) <= 1.00  # request_timeout, not the header's 100
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "x-request-timeout"
    assert [r.status_code for r in rest] == [200] * 7


def test_a_saturated_server_refuses_model_work_before_parsing_it_and_still_tokenizes(tiny_dir, serve):
    soon = {"x-request-timeout": "0.2"}

    async def main():
        async with _serve_known_speed(serve, tiny_dir) as c:
            for _ in range(4):  # the estimate learns from real batches
                await c.post("/embed", json={"inputs": TEXT})
            background = [asyncio.create_task(c.post("/embed", json={"inputs": TEXT})) for _ in range(6)]
            await asyncio.sleep(0.15)  # ~0.45 s of work ahead now, over a 0.2 s deadline's 0.16 s limit
            unread = await c.post("/embed", content=b'{"inputs": ["never parsed', headers={**JSON, **soon})
            openai = await c.post("/v1/embeddings", json={"input": TEXT}, headers=soon)
            tokens = await c.post("/tokenize", json={"inputs": TEXT}, headers=soon)
            decoded = await c.post("/decode", json={"ids": [101, 102]}, headers=soon)
            return unread, openai, tokens, decoded, await asyncio.gather(*background)

    unread, openai, tokens, decoded, background = asyncio.run(main())
    # the edge answered from the queue alone: the body's JSON error was never reached
    assert unread.status_code == 429 and unread.json()["error"]["code"] == "predicted_wait", unread.text
    assert int(unread.headers["retry-after"]) >= 1 and int(unread.headers["content-length"]) == len(unread.content)
    assert openai.status_code == 429
    assert tokens.status_code == 200 and decoded.status_code == 200  # the tokenizer's routes never queue the model
    assert [r.status_code for r in background] == [200] * 6  # accepted work is never dropped

    async def idle():  # with nothing queued, the same body meets its own error: the edge only ever answers 429
        async with _serve_known_speed(serve, tiny_dir) as c:
            return await c.post("/embed", content=b'{"inputs": ["never parsed', headers={**JSON, **soon})

    assert asyncio.run(idle()).status_code == 400


def test_the_edge_admits_every_route_that_queues_the_model_and_no_other(tiny_dir):
    from yoso_serve.service.app import create_app
    from yoso_serve.service.middleware import RouteTable
    from yoso_serve.service.settings import ServeSettings

    routes = RouteTable.of(create_app(ServeSettings(model=str(tiny_dir))))
    assert routes.model == routes.work - {"/tokenize", "/decode"}
    assert {"/embed", "/embed_all", "/embed_pieces", "/classify", "/v1/embeddings", "/", "/predict", "/similarity",
            "/rerank"} <= routes.model
