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
from yoso_serve.model.train.longdoc_data import DocCorpus, crop_length, draw_spans, parse_curriculum, step_documents
from yoso_serve.model.train.longdoc_loss import Distill, LongDocLoss, ShortPairs, SpanDocument, segment_loss
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
    loss_fn = LongDocLoss(student, temperature=0.05, queue=4, terms=[SpanDocument(), ShortPairs(1.0), Distill(0.5)])
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


def test_the_loss_is_the_weighted_sum_of_its_terms_each_logged_by_name(tiny_yoso):
    """A term is a name, a weight and a call on the step: the loss sums weight × term in order, and each
    term's value is logged as <name>_loss; a term added to the list needs nothing else."""
    from yoso_serve.model import load_pretrained

    class Norm:  # the mean norm of the documents' token states: a term the command does not have
        name, weight = "norm", 0.25

        def __call__(self, step):
            return step.hidden.norm(dim=-1).mean(), {"norm_tokens": int(step.hidden.shape[1])}

    student = load_pretrained(tiny_yoso)
    g = torch.Generator().manual_seed(0)
    vocab = student.config.vocab_size
    docs, short = torch.randint(5, vocab, (2, 40), generator=g), torch.randint(5, vocab, (6, 12), generator=g)
    batch = {"input_ids": docs, "attention_mask": torch.ones_like(docs), "short_ids": short,
             "short_mask": torch.ones_like(short), "span_doc": torch.tensor([0, 1]), "n_pairs": torch.tensor(2),
             "doc_keys": torch.tensor([11, 12]), "doc_hashes": torch.tensor(0), "query_hashes": torch.tensor(0),
             "t_short": torch.randn(6, student.config.hidden_size, generator=g)}
    base = LongDocLoss(student, temperature=0.05, queue=0, terms=[SpanDocument(), Distill(0.5)])
    loss, logs = base(batch)
    assert set(logs) >= {"long_loss", "distill_loss", "temperature", "span_top1"} and "short_loss" not in logs
    assert torch.isclose(loss, torch.tensor(logs["long_loss"] + 0.5 * logs["distill_loss"]))
    more = LongDocLoss(student, temperature=0.05, queue=0, terms=[SpanDocument(), Distill(0.5), Norm()])
    loss2, logs2 = more(batch)
    assert logs2["norm_tokens"] == 40 and logs2["norm_loss"] > 0
    assert torch.isclose(loss2, loss + 0.25 * logs2["norm_loss"])


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

    d = load_pretrained(tiny_yoso).config.hidden_size
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
    loss, top1 = segment_loss(hidden, mask, spans, torch.tensor([0, 1]), torch.tensor([5, 0]),
                             torch.tensor([9, 3]), scale, 4)
    assert top1 == 0.5
    right = torch.stack([basis[1], basis[3]])
    good, top1 = segment_loss(hidden, mask, right, torch.tensor([0, 1]), torch.tensor([5, 0]),
                             torch.tensor([9, 3]), scale, 4)
    assert top1 == 1.0 and good < 0.01 < loss
    # the padded third piece of doc 1 is never a candidate: a span at its (empty) place is no positive
    none, _ = segment_loss(hidden, mask, basis[3:4], torch.tensor([1]), torch.tensor([8]),
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
    short = results["short_hits"]  # each pair's hit, for pairing two evals of the same pairs
    for row in results["short_retrieval"]:
        hits = short[row["method"]]
        assert short["pairs"] == row["pairs"] == len(hits) and set(hits) <= {0, 1}
        assert sum(hits) / len(hits) == pytest.approx(row["recall_at_1"])
    cos = short["student_cosines"]  # for how far zero-shot scores move between two evals
    assert len(cos["related"]) == len(cos["unrelated"]) == short["pairs"] and cos["score_center"] is None
    assert all(-1 <= c <= 1 for c in cos["related"] + cos["unrelated"])
    for hit, rel, unrel in zip(short["student"], cos["related"], cos["unrelated"]):
        assert not hit or rel >= unrel - 1e-6  # a hit ranked its own rest first, the next pair's rest among others
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
    short_corpus = {json.loads((tmp_path / name / "results.json").read_text())["short_corpus_sha256"]
                    for name in ("single", "own", "finer", "draws")}
    assert short_corpus == {results["short_corpus_sha256"]}  # the same pairs: the query draws are the deep ones'
    assert main(["eval", "--model", str(tiny_yoso), "--teacher", str(tiny_bert), "--retrieval-data", str(docs),
                 "--window", "16", "--query-draws", "0", "--out", str(tmp_path / "bad0")]) == 2
    assert "--query-draws must be >= 1, got 0" in capsys.readouterr().err
