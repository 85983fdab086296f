"""Long-document training and the retrieval evaluation: the contrastive command
(it learns, it resumes bit for bit) and the retrieval scores against hand-computed answers."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from yoso_serve.model.train import retrieval
from yoso_serve.model.train.cli import main
from yoso_serve.model.train.longdoc_data import (DocCorpus, crop_length, draw_spans, mine_neighbours,
                                                 parse_curriculum, step_documents)
from yoso_serve.model.train.longdoc_loss import LongDocLoss, kernel_logits
from yoso_serve.model.train.runtime import read_events

TOPICS = [("alpha", "beta", "gamma"), ("python", "module", "function"), ("file", "path", "error"),
          ("loop", "while", "for"), ("list", "dict", "string"), ("true", "false", "none")]
COMMON = ("if", "else", "return", "value", "object", "method", "type", "number", "class", "import")


def topic_docs(n_docs: int, seed: int = 0) -> list[dict]:
    """Documents whose blocks mix their own topic's words with common ones: a span finds its document
    only through the topic words, so retrieval has something to learn."""
    rng = random.Random(seed)
    rows = []
    for d in range(n_docs):
        topic = TOPICS[d % len(TOPICS)]
        blocks = []
        for _ in range(6):
            words = [rng.choice(topic if rng.random() < 0.35 else COMMON) for _ in range(rng.randint(18, 24))]
            first = " ".join(words[:5]).capitalize() + "."
            blocks.append(first + " " + " ".join(words[5:]).capitalize() + ".")
        rows.append({"doc": f"t/{d}.html#0", "source": "even" if d % 2 == 0 else "odd", "page": f"t/{d}.html",
                     "blocks": blocks, "tokens": sum(len(b.split()) for b in blocks) + 16})
    return rows


@pytest.fixture
def docs_file(tmp_path, write_jsonl):
    return write_jsonl(tmp_path / "docs.jsonl", topic_docs(24))


def longdoc_argv(tiny_bert, tiny_yoso, data, out, *extra):
    return ["longdoc", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--data", str(data), "--out", str(out),
            "--batch-size", "4", "--spans-per-doc", "2", "--short-pairs", "4", "--queue", "8",
            "--curriculum", "48:0.5,120:1", "--doc-hashes", "0,8", "--query-hashes", "0", "--log-every", "1",
            "--save-every", "4", "--lr", "1e-3", "--seed", "0", *extra]


def test_curriculum_stages():
    stages = parse_curriculum("512:0.25,1024:0.5,4096:1")
    assert [crop_length(stages, s, 100) for s in (0, 24, 25, 49, 50, 99)] == [512, 512, 1024, 1024, 4096, 4096]
    for bad in ("512:0.5", "512:0.6,1024:0.5,2048:1", "8:1", "x"):
        with pytest.raises(ValueError, match="--curriculum"):
            parse_curriculum(bad)


def test_scores_match_hand_computed_ranks():
    d = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    # query 0 ranks its document first, query 1 second, query 2 third
    q = torch.tensor([[1.0, 0.1], [1.0, 0.5], [0.5, 1.0]])
    got = retrieval.scores(q, d)
    assert got["recall_at_1"] == pytest.approx(1 / 3)
    assert got["mrr_at_10"] == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)


def test_pooled_draws_score_the_mean_of_the_separate_draws():
    long_block = " ".join(["w"] * 25)
    rows = [{"doc": f"d#{i}", "tokens": 2000, "blocks": ["early " + long_block] + [f"late{j} {i} " + long_block
                                                                                   for j in range(6)]}
            for i in range(4)]
    docs, one = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=10, seed=3)
    _, other = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=10, seed=4)
    same_docs, pooled = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=10, seed=3, draws=2)
    assert same_docs == docs and pooled == one + other and one != other
    # query j answers document j % n: two draws score the mean of each draw's score
    torch.manual_seed(0)
    corpus, q1, q2 = torch.randn(5, 8), torch.randn(5, 8), torch.randn(5, 8)
    both, a, b = (retrieval.scores(q, corpus) for q in (torch.cat([q1, q2]), q1, q2))
    for key in ("recall_at_1", "mrr_at_10"):
        assert both[key] == pytest.approx((a[key] + b[key]) / 2)
    owner = torch.arange(5).repeat_interleave(2)
    parts = torch.randn(10, 8)
    both, a, b = (retrieval.best_part_scores(q, parts, owner, 5) for q in (torch.cat([q1, q2]), q1, q2))
    assert both["mrr_at_10"] == pytest.approx((a["mrr_at_10"] + b["mrr_at_10"]) / 2)


def test_paired_margin_is_the_recall_difference_with_an_interval_over_documents():
    n = 40
    # method A finds documents 0-29, method B documents 0-19: A leads by 10 of 40
    a = torch.tensor([0] * 30 + [3] * 10)
    b = torch.tensor([0] * 20 + [1] * 20)
    got = retrieval.paired_margin(a, b, n)
    assert got["recall_at_1"] == pytest.approx(0.25)
    assert 0 < got["ci95_low"] < 0.25 < got["ci95_high"] < 0.5
    assert retrieval.paired_margin(a, a, n) == {"recall_at_1": 0.0, "ci95_low": 0.0, "ci95_high": 0.0}
    # a second draw that repeats the first (query j + n asks for document j too) adds no evidence: resampled
    # by document, the interval stays the one of one draw; resampled by query it would narrow
    twice = retrieval.paired_margin(a.repeat(2), b.repeat(2), n)
    assert twice == pytest.approx(got)
    with pytest.raises(ValueError, match="one shape"):
        retrieval.paired_margin(a, b[:-1], n)


def test_pooled_margin_weighs_corpora_by_queries_and_resamples_each_corpus():
    a = torch.tensor([0] * 30 + [3] * 10)
    b = torch.tensor([0] * 20 + [1] * 20)
    one = retrieval.paired_margin(a, b, 40)
    # one corpus: paired_margin itself
    assert retrieval.pooled_margin([((a == 0).tolist(), (b == 0).tolist(), 40)]) == pytest.approx(one)
    # a second corpus of 20 documents where A and B tie: the difference is over all 60 queries
    tie = [1] * 10 + [0] * 10
    got = retrieval.pooled_margin([((a == 0).tolist(), (b == 0).tolist(), 40), (tie, tie, 20)])
    assert got["recall_at_1"] == pytest.approx(10 / 60)
    assert got["ci95_low"] < 10 / 60 < got["ci95_high"]
    # two corpora of the same evidence: twice the documents, an interval narrower by about 1/sqrt(2)
    same = ((a == 0).tolist(), (b == 0).tolist(), 40)
    two = retrieval.pooled_margin([same, same])
    assert two["recall_at_1"] == pytest.approx(0.25)
    ratio = (two["ci95_high"] - two["ci95_low"]) / (one["ci95_high"] - one["ci95_low"])
    assert 0.55 < ratio < 0.85
    with pytest.raises(ValueError, match="no corpus"):
        retrieval.pooled_margin([])
    with pytest.raises(ValueError, match="one shape"):
        retrieval.pooled_margin([same, ([1, 0], [1], 2)])


def test_best_part_scores_rank_a_document_by_its_best_part():
    # doc 0 = parts 0, 1; doc 1 = part 2; doc 2 = parts 3, 4
    parts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7], [-1.0, 0.0], [0.6, -0.8]])
    owner = torch.tensor([0, 0, 1, 2, 2])
    q = torch.tensor([[0.1, 1.0],   # best part is doc 0's second: rank 1
                      [1.0, 0.9],   # doc 1 (0.7, 0.7) is nearest: rank 1
                      [1.0, 0.0]])  # doc 2's best is 0.6, below doc 0's 1.0 and doc 1's 0.7: rank 3
    got = retrieval.best_part_scores(q, parts, owner, 3)
    assert got["recall_at_1"] == pytest.approx(2 / 3)
    assert got["mrr_at_10"] == pytest.approx((1 + 1 + 1 / 3) / 3)
    # one part per document is the single-vector score
    single = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    assert retrieval.best_part_scores(q, single, torch.arange(3), 3) == retrieval.scores(q, single)


def test_cut_windows_wraps_consecutive_pieces_and_keeps_empty_texts(tiny_yoso):
    from yoso_serve.model import load_pretrained

    tok = load_pretrained(tiny_yoso).tokenizer
    owner, wins = retrieval.cut_windows([list(range(10, 17)), [], [20, 21]], tok, 5)  # 3 content ids per window
    assert owner == [0, 0, 0, 1, 2]
    assert wins == [tok.wrap([10, 11, 12]), tok.wrap([13, 14, 15]), tok.wrap([16]), tok.wrap([]), tok.wrap([20, 21])]
    assert max(map(len, wins)) == 5


def test_student_parts_are_the_segment_means_of_one_pass(tiny_yoso):
    from yoso_serve.model import load_pretrained

    model = load_pretrained(tiny_yoso, device=torch.device("cpu")).eval()
    emb = retrieval.Embedders(model, None, hashes=0, window=16, device=torch.device("cpu"), token_budget=64)
    texts = [" ".join(["alpha beta gamma"] * 12), "delta epsilon", " ".join(["zeta eta"] * 7)]
    pooled, parts, owner = emb.student_parts(texts, 8)
    seqs = model.tokenizer.encode(texts, max_length=model.config.max_length)
    assert owner.tolist() == [d for d, s in enumerate(seqs) for _ in range(-(-len(s) // 8))]
    with torch.no_grad():
        for d, s in enumerate(seqs):
            hidden = model.last_hidden(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), hashes=0)[0]
            want = torch.stack([hidden[i:i + 8].mean(0) for i in range(0, len(s), 8)])
            torch.testing.assert_close(parts[owner == d], want, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(pooled[d], hidden.mean(0), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(pooled, emb.student_one_pass(texts), atol=1e-5, rtol=1e-4)


def test_student_windowed_is_the_student_reading_each_window_alone(tiny_yoso):
    """The student as a chunker: each window read on its own, unit length, summed per document; a text
    inside one window is that window, so its vector is the one pass's direction."""
    from yoso_serve.model import load_pretrained

    model = load_pretrained(tiny_yoso, device=torch.device("cpu")).eval()
    emb = retrieval.Embedders(model, None, hashes=0, window=16, device=torch.device("cpu"), token_budget=64)
    texts = [" ".join(["alpha beta gamma"] * 12), "delta epsilon", " ".join(["zeta eta"] * 7)]
    got = emb.student_windowed(texts)
    owner, wins = retrieval.cut_windows(model.tokenizer.encode(texts, add_special_tokens=False), model.tokenizer, 16)
    assert owner.count(0) > 1  # the first text spans several windows
    with torch.no_grad():
        want = torch.zeros_like(got)
        for d, w in zip(owner, wins):
            want[d] += F.normalize(model.embed(torch.tensor([w]), torch.ones(1, len(w), dtype=torch.long), hashes=0)[0],
                                   dim=-1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    one = F.normalize(emb.student_one_pass(texts[1:2]), dim=-1)
    torch.testing.assert_close(F.normalize(got[1:2], dim=-1), one, atol=1e-5, rtol=1e-4)
    assert F.cosine_similarity(got[0], emb.student_one_pass(texts[:1])[0], dim=0) < 1 - 1e-4


def test_deep_pairs_skip_gives_the_next_disjoint_corpus():
    long_block = " ".join(["w"] * 25)
    rows = [{"doc": f"d{i}#0", "tokens": 2000 if i % 3 else 100,  # every third row is too short to qualify
             "blocks": [f"early {i} " + long_block, f"late {i} " + long_block]} for i in range(30)]
    first, _ = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=8, seed=0)
    second, queries = retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=8, seed=0, skip=8, draws=2)
    assert len(first) == len(second) == 8 and not set(first) & set(second)
    qualifying = ["\n".join(r["blocks"]) for r in rows if r["tokens"] == 2000]
    assert first + second == qualifying[:16]
    assert len(queries) == 16 and all(q.startswith(f"late {d.split()[1]} ") for q, d in zip(queries, second * 2))
    assert retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=8, seed=0, skip=20)[0] == qualifying[20:]
    with pytest.raises(ValueError, match="skip must be >= 0"):
        retrieval.deep_pairs(rows, lo=1200, hi=4000, max_docs=8, seed=0, skip=-1)


def test_deep_pairs_take_a_late_paragraph_and_are_seeded():
    long_block = " ".join(["w"] * 25)
    row = {"doc": "d#0", "tokens": 2000, "blocks": ["early " + long_block, "short", "late " + long_block]}
    docs, queries = retrieval.deep_pairs([row, {**row, "tokens": 100}], lo=1200, hi=4000, max_docs=10, seed=0)
    assert docs == ["\n".join(row["blocks"])] and queries == ["late " + long_block]
    firsts, rests = retrieval.short_pairs(topic_docs(3), max_pairs=2, seed=0)
    assert len(firsts) == 2 and all(f.endswith(".") for f in firsts)
    assert (firsts, rests) == retrieval.short_pairs(topic_docs(3), max_pairs=2, seed=0)


def test_sentence_queries_come_from_late_paragraphs_of_the_same_documents():
    late = "Late one has words enough to count here. Tiny one. Another sentence with quite enough words in it, " \
           "and then some more words."
    row = {"doc": "d#0", "tokens": 2000, "blocks": ["early " + " ".join(["x"] * 25) + ". Early sentence of eight words here.",
                                                    "short", late]}
    bare = {"doc": "e#0", "tokens": 2000, "blocks": ["e " * 25, "f " * 25]}  # no sentence of 8+ words
    para_docs, _ = retrieval.deep_pairs([row, bare], lo=1200, hi=4000, max_docs=10, seed=0)
    docs, queries = retrieval.deep_pairs([row, bare], lo=1200, hi=4000, max_docs=10, seed=0, draws=4, unit="sentence")
    assert docs == para_docs and len(queries) == 8
    assert set(queries[0::2]) <= {"Late one has words enough to count here.",
                                  "Another sentence with quite enough words in it, and then some more words."}
    assert set(queries[1::2]) == {"f " * 25}  # falls back to the paragraph
    with pytest.raises(ValueError, match="query unit"):
        retrieval.deep_pairs([row], lo=0, hi=4000, max_docs=1, seed=0, unit="word")


def test_longdoc_learns_to_find_spans_and_writes_a_servable_model(tiny_bert, tiny_yoso, docs_file, tmp_path):
    out = tmp_path / "run"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "24")) == 0
    rows = read_events(out, "train")
    first, last = rows[:4], rows[-4:]
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(last, "long_loss") < mean(first, "long_loss")
    assert {"short_loss", "distill_loss", "temperature", "span_top1"} <= set(rows[0])
    from yoso_serve.model import load_pretrained

    model = load_pretrained(out / "model")
    ids = torch.tensor([model.tokenizer.encode(["alpha beta gamma"])[0]])
    assert torch.isfinite(model.embed(ids, torch.ones_like(ids))).all()


def test_teacher_init_distils_towards_the_frozen_starting_model(tiny_bert, tiny_yoso, docs_file, tmp_path):
    """`--teacher init` needs no teacher weights: the short-text term compares the student with itself as it
    started, so with dropout off the first step's distillation loss is zero, and it grows as the student moves."""
    out = tmp_path / "init"
    argv = longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "8", "--dropout", "0")
    argv[argv.index("--teacher") + 1] = "init"
    assert main(argv) == 0
    rows = read_events(out, "train")
    assert rows[0]["distill_loss"] < 1e-6
    assert rows[-1]["distill_loss"] > 1e-4
    assert (out / "model" / "config.json").exists()


def test_a_step_whose_crops_hold_no_span_trains_on_its_short_texts(tiny_yoso):
    # a batch of documents with no block of 8+ tokens inside the crop gives no span at all: once, this
    # built a float (0,) target and stopped a run at step 33 (cross_entropy wants integer targets)
    from yoso_serve.model import load_pretrained

    student = load_pretrained(tiny_yoso)
    loss_fn = LongDocLoss(student, temperature=0.05, queue=4, weights=(1.0, 0.5))
    g = torch.Generator().manual_seed(0)
    vocab = student.config.vocab_size
    docs, short = torch.randint(5, vocab, (2, 40), generator=g), torch.randint(5, vocab, (4, 12), generator=g)
    batch = {"input_ids": docs, "attention_mask": torch.ones_like(docs), "short_ids": short,
             "short_mask": torch.ones_like(short), "span_doc": torch.tensor([], dtype=torch.long),
             "n_pairs": torch.tensor(2), "doc_keys": torch.tensor([11, 12]), "doc_hashes": torch.tensor(0),
             "query_hashes": torch.tensor(0), "t_short": torch.randn(4, student.config.hidden_size, generator=g)}
    loss, logs = loss_fn(batch)
    assert torch.isfinite(loss) and logs["long_loss"] == 0.0 and logs["short_loss"] > 0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in loss_fn.student.parameters())
    assert (loss_fn.queue_keys >= 0).sum() == 2  # the step's documents still enter the queue


def test_span_ranges_locate_each_span_block_in_the_crop_and_leave_the_draws_alone(tiny_yoso):
    from yoso_serve.model import load_pretrained

    corpus = DocCorpus(topic_docs(4), load_pretrained(tiny_yoso).tokenizer, 32)
    flat = [t for ids in corpus.ids[1] for t in ids]
    lo, hi = 20, 20 + 60
    where: list[tuple[int, int]] = []
    spans = draw_spans(random.Random(5), corpus, 1, lo, hi, 3, where)
    assert spans == draw_spans(random.Random(5), corpus, 1, lo, hi, 3)
    assert len(where) == len(spans) >= 1
    blocks = [tuple(ids) for ids in corpus.ids[1]]
    for a, z in where:
        assert 0 <= a < z <= hi - lo and tuple(flat[lo + a:lo + z]) in blocks


def test_segment_loss_takes_the_pieces_of_the_span_block_as_positives(tiny_yoso):
    from yoso_serve.model import load_pretrained

    student = load_pretrained(tiny_yoso)
    loss_fn = LongDocLoss(student, temperature=0.05, queue=0, weights=(1.0, 0.5), w_segment=1.0)
    d = student.config.hidden_size
    basis = torch.eye(d)
    # two documents of 10 tokens (the second padded after 6): pieces [0,4) [4,8) [8,10) and [0,4) [4,6);
    # each piece's tokens point along their own axis, so a span along an axis finds exactly that piece
    hidden = torch.zeros(2, 10, d)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    for b in range(2):
        for t in range(10):
            hidden[b, t] = basis[b * 3 + t // 4]
    scale = torch.tensor(20.0)
    # span 0: block [5, 9) of doc 0 overlaps pieces 1 and 2; it points at piece 2 → a positive
    # span 1: block [0, 3) of doc 1 is piece 0 of doc 1 (axis 3); it points at doc 0's piece 0 → wrong
    spans = torch.stack([basis[2], basis[0]])
    loss, top1 = loss_fn.segment_loss(hidden, mask, spans, torch.tensor([0, 1]), torch.tensor([5, 0]),
                                      torch.tensor([9, 3]), scale, 4)
    assert top1 == 0.5
    right = torch.stack([basis[1], basis[3]])
    good, top1 = loss_fn.segment_loss(hidden, mask, right, torch.tensor([0, 1]), torch.tensor([5, 0]),
                                      torch.tensor([9, 3]), scale, 4)
    assert top1 == 1.0 and good < 0.01 < loss
    # the padded third piece of doc 1 is never a candidate: a span at its (empty) place is no positive
    none, _ = loss_fn.segment_loss(hidden, mask, basis[3:4], torch.tensor([1]), torch.tensor([8]),
                                   torch.tensor([10]), scale, 4)
    assert none > 100


def test_longdoc_trains_its_segments_with_w_segment(tiny_bert, tiny_yoso, docs_file, tmp_path):
    out = tmp_path / "seg"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "24", "--w-segment", "1",
                             "--segment-tokens", "16,32")) == 0
    rows = read_events(out, "train")
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert {"segment_loss", "segment_top1"} <= set(rows[0])
    assert {r["segment_tokens"] for r in rows} == {16, 32}  # one of the sizes drawn per step, both used
    assert mean(rows[-6:], "segment_loss") < mean(rows[:6], "segment_loss")


def test_kernel_logits_are_the_log_mean_kernel_over_each_document_s_real_pieces():
    g = torch.Generator().manual_seed(1)
    spans = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=-1)
    pieces = torch.nn.functional.normalize(torch.randn(4, 5, 8, generator=g), dim=-1)
    valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    got = kernel_logits(spans, pieces, valid, 7.0)
    for s in range(3):
        for c in range(3):
            real = pieces[c][valid[c]]
            want = torch.exp(7.0 * (real @ spans[s] - 1.0)).mean().log()
            assert torch.allclose(got[s, c], want, atol=1e-5)
    assert torch.isinf(got[:, 3]).all() and (got[:, 3] < 0).all()  # no piece: never a target


def test_kernel_loss_pulls_the_one_vector_ranking_towards_the_pieces(tiny_yoso):
    # document 0's mean points away from the span, but one of its pieces is the span: the kernel mean ranks
    # it first and the loss pulls its one vector (a free parameter here) towards the span
    from yoso_serve.model import load_pretrained

    student = load_pretrained(tiny_yoso)
    loss_fn = LongDocLoss(student, temperature=0.05, queue=0, weights=(1.0, 0.5), w_kernel=1.0, kernel_tokens=4,
                          max_tokens=8)
    d = student.config.hidden_size
    basis = torch.eye(d)
    pieces = torch.stack([torch.stack([basis[0], basis[1]]), torch.stack([basis[2], basis[3]])])
    valid = torch.ones(2, 2, dtype=torch.bool)
    docs = torch.stack([basis[1], (basis[0] + basis[2]) / 2 ** 0.5]).requires_grad_()
    span = basis[0:1]
    loss, top1 = loss_fn.kernel_loss(span, docs, pieces, valid, torch.tensor(20.0), torch.tensor([0]))
    assert top1 == 1.0 and loss > 1.0
    loss.backward()
    assert docs.grad[0, 0] < 0 < docs.grad[1, 0]  # descent raises doc 0's cosine with the span, lowers doc 1's
    same, _ = loss_fn.kernel_loss(span, torch.stack([basis[0], basis[2]]), pieces, valid, torch.tensor(20.0 / 0.5),
                                  torch.tensor([0]))
    assert same < 1e-3  # the target is reached when the one vectors score as the pieces do (β 20 = 40 × 0.5)


def test_longdoc_with_w_kernel_queues_the_pieces_and_learns(tiny_bert, tiny_yoso, docs_file, tmp_path):
    out = tmp_path / "kernel"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "16", "--w-kernel", "1",
                             "--kernel-tokens", "16")) == 0
    rows = read_events(out, "train")
    assert {"kernel_loss", "kernel_top1"} <= set(rows[0])
    assert all(r["kernel_loss"] >= 0 for r in rows)
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert state["queue_pieces"].shape == (8, -(-120 // 16), 32)
    assert state["queue_piece_valid"].any(-1).sum() == 8  # a full queue: every entry has pieces


def test_longdoc_resume_reproduces_an_uninterrupted_run(tiny_bert, tiny_yoso, docs_file, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, whole, "--max-steps", "8")) == 0
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, split, "--max-steps", "8",
                             "--max-minutes", "1e-9")) == 0
    assert read_events(split, "stop")[-1]["reason"] == "time limit"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, split, "--max-steps", "8", "--resume")) == 0
    a = torch.load(whole / "checkpoints" / "last.pt", weights_only=False)["model"]
    b = torch.load(split / "checkpoints" / "last.pt", weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_neighbourhood_draws_documents_that_are_near_in_key_order(tiny_yoso):
    from yoso_serve.model import load_pretrained

    rows = topic_docs(40)
    random.Random(3).shuffle(rows)  # file order is not key order
    corpus = DocCorpus(rows, load_pretrained(tiny_yoso).tokenizer, 32)
    order = corpus.in_key_order["even"]
    assert [corpus.keys[i] for i in order] == sorted(corpus.keys[i] for i in order)
    rng = random.Random(0)
    for _ in range(50):
        drawn = step_documents(rng, corpus, "even", 3, 5)
        places = sorted(order.index(d) for d in drawn)
        assert len(set(drawn)) == 3 and places[-1] - places[0] < 5
    spread = [step_documents(rng, corpus, "even", 3, 0) for _ in range(50)]
    assert max(max(order.index(d) for d in s) - min(order.index(d) for d in s) for s in spread) >= 5
    # a neighbourhood as large as the source is the whole source, drawn as without one
    a, b = random.Random(1), random.Random(1)
    assert step_documents(a, corpus, "even", 3, 20) == step_documents(b, corpus, "even", 3, 0)


def test_mined_neighbours_are_the_nearest_openings_of_the_same_source(tiny_yoso):
    from yoso_serve.model import load_pretrained

    rows = topic_docs(36)
    corpus = DocCorpus(rows, load_pretrained(tiny_yoso).tokenizer, 32)
    topic_of = {i: i % len(TOPICS) for i in range(len(rows))}  # topic_docs cycles through TOPICS
    tok = corpus.tokenizer
    opening = {tuple(tok.wrap([t for ids in corpus.ids[d] for t in ids][:62])): topic_of[d] for d in topic_of}

    def embed(ids, mask):  # a stand-in teacher that knows each opening's topic
        rows = [opening[tuple(row[m.bool()].tolist())] for row, m in zip(ids, mask)]
        return torch.nn.functional.one_hot(torch.tensor(rows), len(TOPICS)).float() + 1e-3

    mined = mine_neighbours(corpus, embed, k=2, tokens=64, pad_id=tok.pad_id, device=torch.device("cpu"))
    assert sorted(mined) == list(range(len(rows)))
    for d, near in mined.items():
        source = rows[d]["source"]
        assert len(near) == 2 and d not in near and all(rows[n]["source"] == source for n in near)
        assert all(topic_of[n] == topic_of[d] for n in near)  # each has 5 of its topic in its source
    rng = random.Random(0)
    for _ in range(20):
        drawn = step_documents(rng, corpus, "even", 3, 0, mined)
        assert set(drawn[1:]) == set(mined[drawn[0]])


def test_longdoc_trains_on_mined_neighbours(tiny_bert, tiny_yoso, docs_file, tmp_path, capsys):
    out = tmp_path / "mined"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "2", "--mined-neighbours", "3",
                             "--mine-tokens", "32")) == 0
    assert len(read_events(out, "train")) == 2
    assert "mining neighbours" in capsys.readouterr().err
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "bad", "--mined-neighbours", "2")) == 2
    assert "--mined-neighbours must be 0 or >= --batch-size - 1 (3)" in capsys.readouterr().err
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "bad2", "--mined-neighbours", "3",
                             "--mine-tokens", "2")) == 2
    assert "--mine-tokens must be >= 8, got 2" in capsys.readouterr().err


def test_the_temperature_learns_at_its_own_rate(tiny_bert, tiny_yoso, docs_file, tmp_path):
    runs = {}
    for scale in ("1", "2000"):
        out = tmp_path / scale
        assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "6", "--lr", "1e-5", "--warmup", "0",
                                 "--temperature-lr-scale", scale, "--neighbourhood", "6")) == 0
        runs[scale] = [r["temperature"] for r in read_events(out, "train")]
    # AdamW moves the log temperature by about lr per step; 5 updates precede the last logged value
    assert abs(runs["1"][-1] - 0.05) < 1e-4  # lr 1e-5
    assert abs(runs["2000"][-1] - 0.05) > 2e-3  # lr 2e-2: the log moves ~0.1


def test_longdoc_refuses_bad_configuration(tiny_bert, tiny_yoso, docs_file, tmp_path, capsys, write_jsonl):
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "a", "--curriculum", "64:0.5,4096:1")) == 2
    assert "curriculum reaches 4096" in capsys.readouterr().err
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "no blocks"}])
    assert main(longdoc_argv(tiny_bert, tiny_yoso, bad, tmp_path / "b")) == 2
    assert "bad.jsonl:1: not a document row" in capsys.readouterr().err
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "c", "--neighbourhood", "3")) == 2
    assert "--neighbourhood must be 0 or >= --batch-size (4), got 3" in capsys.readouterr().err
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "d", "--temperature-lr-scale", "0")) == 2
    assert "--temperature-lr-scale must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused at parse time
        main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "e", "--w-segment", "-1"))
    assert "argument --w-segment: must be finite and >= 0" in capsys.readouterr().err
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "f", "--w-segment", "1",
                             "--segment-tokens", "64,x")) == 2
    assert "--segment-tokens must be piece sizes >= 1" in capsys.readouterr().err


def test_eval_reports_deep_and_short_retrieval(tiny_bert, tiny_yoso, tmp_path, write_jsonl, capsys):
    docs = write_jsonl(tmp_path / "held.jsonl", [{**r, "tokens": 1500} for r in topic_docs(6)])
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    deep = {r["method"]: r for r in results["deep_retrieval"]}
    assert list(deep) == ["student, one pass", "teacher, 16-token windows averaged", "teacher, truncated at 64",
                          "multi-vector: teacher, each 16-token window, best",
                          "multi-vector: student, one pass, each 16-token segment, best"]
    for row in deep.values():
        assert row["docs"] == 6 and 0 <= row["recall_at_1"] <= row["mrr_at_10"] <= 1 and row["docs_per_s"] > 0
    assert [r["method"] for r in results["short_retrieval"]] == ["student", "teacher"]
    margins = results["deep_margin"]
    assert [(m["student"], m["teacher"]) for m in margins] == [(list(deep)[0], list(deep)[1]),
                                                                (list(deep)[4], list(deep)[3])]
    for m in margins:
        assert m["recall_at_1"] == pytest.approx(deep[m["student"]]["recall_at_1"] - deep[m["teacher"]]["recall_at_1"])
        assert m["ci95_low"] <= m["recall_at_1"] <= m["ci95_high"] and (m["docs"], m["queries"]) == (6, 6)
    # each query's hit per method, for pooling the margins of several corpora; the margin is theirs
    hits = results["deep_hits"]
    assert hits["docs"] == 6 and set(hits) == {"docs", *deep}
    for name, row in deep.items():
        assert len(hits[name]) == 6 and set(hits[name]) <= {0, 1}
        assert sum(hits[name]) / 6 == pytest.approx(row["recall_at_1"])
    assert retrieval.pooled_margin([(hits[margins[0]["student"]], hits[margins[0]["teacher"]], 6)]) == \
        pytest.approx({k: margins[0][k] for k in ("recall_at_1", "ci95_low", "ci95_high")})
    printed = capsys.readouterr().out
    assert "### deep_retrieval" in printed and "### deep_margin" in printed and "deep_hits" not in printed
    for flag, value, message in (("--segment", "-1", "--segment must be >= 0"), ("--window", "2", "--window must be in 3..64"),
                                 ("--retrieval-tokens", "x", "--retrieval-tokens must be LO,HI")):
        assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                     "--window", "16", flag, value, "--out", str(tmp_path / "bad")]) == 2
        assert message in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--segment", "0", "--out", str(tmp_path / "single")]) == 0
    single = json.loads((tmp_path / "single" / "results.json").read_text())["deep_retrieval"]
    assert [r["method"] for r in single] == list(deep)[:3]
    assert len(json.loads((tmp_path / "single" / "results.json").read_text())["deep_margin"]) == 1
    # --own-windows: the student as a chunker of the same windows, and the one pass's margin over it, last
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--own-windows", "--out", str(tmp_path / "own")]) == 0
    own = json.loads((tmp_path / "own" / "results.json").read_text())
    own_deep = {r["method"]: r for r in own["deep_retrieval"]}
    assert list(own_deep) == [*list(deep)[:3], "student, 16-token windows averaged", *list(deep)[3:]]
    assert [(m["student"], m["teacher"]) for m in own["deep_margin"]] == [
        *[(m["student"], m["teacher"]) for m in margins], ("student, one pass", "student, 16-token windows averaged")]
    m = own["deep_margin"][-1]
    assert m["recall_at_1"] == pytest.approx(own_deep["student, one pass"]["recall_at_1"]
                                             - own_deep["student, 16-token windows averaged"]["recall_at_1"])
    assert sum(own["deep_hits"]["student, 16-token windows averaged"]) / 6 == pytest.approx(
        own_deep["student, 16-token windows averaged"]["recall_at_1"])
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--segment", "8", "--out", str(tmp_path / "finer")]) == 0
    finer = json.loads((tmp_path / "finer" / "results.json").read_text())["deep_retrieval"]
    assert finer[-1]["method"] == "multi-vector: student, one pass, each 8-token segment, best"
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--query-draws", "3", "--out", str(tmp_path / "draws")]) == 0
    drawn = json.loads((tmp_path / "draws" / "results.json").read_text())["deep_retrieval"]
    assert {(r["docs"], r["queries"]) for r in drawn} == {(6, 18)}
    # what the hits are hits on: the same documents and queries whatever rows are added, other draws not
    corpus = {name: json.loads((tmp_path / name / "results.json").read_text())["deep_corpus_sha256"]
              for name in ("single", "own", "finer", "draws")}
    assert corpus["single"] == corpus["own"] == corpus["finer"] == results["deep_corpus_sha256"] != corpus["draws"]
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--query-draws", "0", "--out", str(tmp_path / "bad0")]) == 2
    assert "--query-draws must be >= 1, got 0" in capsys.readouterr().err


def test_cut_negatives_read_each_crop_without_its_span_blocks(tiny_bert, tiny_yoso, docs_file, tmp_path):
    """--cut-negatives: every crop is read a second time with its spans' blocks cut out, a negative of its own
    spans; the log says how often a span prefers its whole document to the cut one."""
    out = tmp_path / "cut"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "16", "--cut-negatives")) == 0
    rows = read_events(out, "train")
    wins = [r["cut_win"] for r in rows if "cut_win" in r]
    assert len(wins) >= 12 and all(0.0 <= w <= 1.0 for w in wins)
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)  # noqa: E731
    assert mean(rows[-4:], "long_loss") < mean(rows[:4], "long_loss")


def test_cut_fixed_reads_the_copies_without_gradient(tiny_bert, tiny_yoso, docs_file, tmp_path, monkeypatch, capsys):
    """--cut-fixed: the cut copies are read with gradient off (a fixed negative, no activations kept), the
    crops and the short texts with it on; without --cut-negatives the option is refused by name."""
    from yoso_serve.model.train import longdoc

    graded = {}
    real = longdoc.LongDocLoss.embed

    def embed(self, ids, mask, hashes):
        graded.setdefault(int(ids.shape[0]), set()).add(torch.is_grad_enabled())
        return real(self, ids, mask, hashes)

    monkeypatch.setattr(longdoc.LongDocLoss, "embed", embed)
    seen = []
    forward = longdoc.LongDocLoss.forward
    monkeypatch.setattr(longdoc.LongDocLoss, "forward", lambda self, b: seen.append(b) or forward(self, b))
    out = tmp_path / "fixed"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "4", "--cut-negatives",
                             "--cut-fixed")) == 0
    cut_rows = {int(b["cut_ids"].shape[0]) for b in seen}
    short_rows = {int(b["short_ids"].shape[0]) for b in seen}
    assert cut_rows.isdisjoint(short_rows)  # the two reads are told apart by their row counts
    assert all(graded[n] == {False} for n in cut_rows)
    assert all(graded[n] == {True} for n in short_rows)
    assert any("cut_win" in r for r in read_events(out, "train"))
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "bad", "--cut-fixed")) == 2
    assert "--cut-fixed fixes the copies of --cut-negatives" in capsys.readouterr().err


def test_a_cut_copy_is_its_crop_less_exactly_the_span_blocks(tiny_bert, tiny_yoso, docs_file, tmp_path, monkeypatch):
    from yoso_serve.model.train import longdoc

    seen = []
    real = longdoc.LongDocLoss.forward
    monkeypatch.setattr(longdoc.LongDocLoss, "forward", lambda self, batch: seen.append(batch) or real(self, batch))
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "cut", "--max-steps", "3",
                             "--cut-negatives")) == 0
    for batch in seen:
        doc_len, cut_len = batch["attention_mask"].sum(1), batch["cut_mask"].sum(1)
        for i, d in enumerate(batch["cut_doc"].tolist()):
            blocks = [(lo, hi) for lo, hi, s in zip(batch["span_lo"].tolist(), batch["span_hi"].tolist(),
                                                     batch["span_doc"].tolist()) if s == d]
            cut = set().union(*(range(lo, hi) for lo, hi in blocks))
            assert cut_len[i] == doc_len[d] - len(cut)
            keep = [p for p in range(int(doc_len[d])) if p not in cut]
            assert batch["cut_ids"][i, : int(cut_len[i])].tolist() == batch["input_ids"][d, keep].tolist()


def test_own_windows_target_is_the_student_chunking_each_crop(tiny_bert, tiny_yoso, docs_file, tmp_path,
                                                               monkeypatch):
    """--w-own-windows: a crop's windows are its content cut as the eval's chunker cuts a document, and the
    target is the student reading each alone (exact), unit, averaged: the eval's own-windows row."""
    from yoso_serve.model.train import longdoc

    seen, targets = [], []
    real, real_own = longdoc.LongDocLoss.forward, longdoc.LongDocLoss.own_windows
    monkeypatch.setattr(longdoc.LongDocLoss, "forward", lambda self, batch: seen.append(batch) or real(self, batch))
    monkeypatch.setattr(longdoc.LongDocLoss, "own_windows",
                        lambda self, *a: targets.append(real_own(self, *a)) or targets[-1])
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "own", "--max-steps", "2",
                             "--w-own-windows", "1", "--own-window-tokens", "16")) == 0
    assert len(seen) == len(targets) == 2
    batch = seen[0]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    crops = [ids[d, 1:int(mask[d].sum()) - 1].tolist() for d in range(len(ids))]
    wins = [batch["win_ids"][w, :int(batch["win_mask"][w].sum())].tolist() for w in range(len(batch["win_ids"]))]
    owner = batch["win_doc"].tolist()
    assert owner == sorted(owner) and set(owner) == set(range(len(crops)))
    assert all(len(w) <= 16 for w in wins)
    for d, crop in enumerate(crops):  # the windows of a crop, specials stripped, are the crop in order
        assert [t for w, o in zip(wins, owner) if o == d for t in w[1:-1]] == crop
    # the target against the student embedding each window alone (no padding), from the first step's weights
    from yoso_serve.model import load_pretrained

    model = load_pretrained(tiny_yoso, device=torch.device("cpu")).eval()
    with torch.no_grad():
        want = torch.zeros(len(crops), targets[0].shape[1])
        for w, d in zip(wins, owner):
            want[d] += F.normalize(model.embed(torch.tensor([w]), torch.ones(1, len(w), dtype=torch.long),
                                               hashes=0)[0], dim=-1)
    torch.testing.assert_close(targets[0], F.normalize(want, dim=-1), atol=1e-5, rtol=1e-4)
    assert not targets[0].requires_grad


def test_longdoc_with_w_own_windows_pulls_the_one_pass_to_its_windows(tiny_bert, tiny_yoso, docs_file, tmp_path):
    """The same run (seed, crops) with the pull and with a negligible one: the pull brings the one pass nearer
    its own windows; without the option nothing is computed or logged."""
    def run(name, weight):
        out = tmp_path / name
        assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "12", "--curriculum", "120:1",
                                 "--w-own-windows", weight, "--own-window-tokens", "16")) == 0
        rows = read_events(out, "train")
        return sum(r["own_windows_loss"] for r in rows[-4:]) / 4, rows[0]["own_windows_loss"]

    pulled, start = run("pulled", "8")
    free, free_start = run("free", "1e-9")
    assert start == pytest.approx(free_start)  # the same first step: same crops, same weights
    assert pulled < 0.5 * free, (pulled, free)
    plain = tmp_path / "plain"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, plain, "--max-steps", "2")) == 0
    assert "own_windows_loss" not in read_events(plain, "train")[0]


def test_train_positions_from_trains_only_the_later_positions(tiny_bert, tiny_yoso, docs_file, tmp_path):
    """`--train-positions-from N`: every weight but the position rows N and up stays bit for bit (weight decay
    included), those rows move, and so an input of at most N tokens embeds exactly as the starting model's
    at every hash count, while a longer one does not."""
    from yoso_serve.model import load_pretrained
    from yoso_serve.model.encoder import POSITION_OFFSET
    from yoso_serve.model.train.longdoc import POSITION_WEIGHT as table

    first, out = 40, tmp_path / "positions"
    assert main(longdoc_argv(tiny_bert, tiny_yoso, docs_file, out, "--max-steps", "6",
                             "--train-positions-from", str(first))) == 0
    before, after = load_pretrained(tiny_yoso), load_pretrained(out / "model")
    old, new = before.encoder.state_dict(), after.encoder.state_dict()
    assert all(torch.equal(old[k], new[k]) for k in old if k != table)
    assert torch.equal(old[table][:first + POSITION_OFFSET], new[table][:first + POSITION_OFFSET])
    assert not torch.equal(old[table][first + POSITION_OFFSET:], new[table][first + POSITION_OFFSET:])
    text = " ".join(["alpha beta gamma loop"] * 40)
    short = torch.tensor([before.tokenizer.encode([text], max_length=first)[0]])
    long = torch.tensor([before.tokenizer.encode([text], max_length=120)[0]])
    assert short.shape[1] == first and long.shape[1] == 120
    for hashes in (0, 8):
        assert torch.equal(before.embed(short, torch.ones_like(short), hashes=hashes),
                           after.embed(short, torch.ones_like(short), hashes=hashes))
    assert not torch.equal(before.embed(long, torch.ones_like(long), hashes=0),
                           after.embed(long, torch.ones_like(long), hashes=0))


def test_train_positions_from_refuses_a_row_the_model_lacks(tiny_bert, tiny_yoso, docs_file, tmp_path, capsys):
    argv = longdoc_argv(tiny_bert, tiny_yoso, docs_file, tmp_path / "bad", "--max-steps", "2",
                        "--train-positions-from", "128")
    assert main(argv) != 0
    assert "--train-positions-from must be in 1..127" in capsys.readouterr().err
