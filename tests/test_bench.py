"""The helpers the bench scripts share: timing (bench/_sections.py: warm-up, alternation, medians) and the
overload scenario's latencies (bench/_overload.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
import _sections  # noqa: E402


def test_alternated_medians_warms_up_once_then_alternates_and_takes_medians(monkeypatch):
    order, clock = [], iter(range(100))
    monkeypatch.setattr(_sections.time, "perf_counter", lambda: next(clock))
    calls = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    syncs = []
    out = _sections.alternated_medians(calls, 3, sync=lambda: syncs.append(len(order)))
    assert order == ["a", "b"] + ["a", "b"] * 3  # one warm-up each, then the rounds in turn
    assert len(syncs) == 2 * 6  # before and after every timed call, never around the warm-ups
    assert out == {"a": 1, "b": 1}  # each timed call spans one tick of the fake clock


def test_overload_latencies_leave_out_the_opening_and_read_the_event_loop_wait():
    import os

    import _overload

    s = _overload.Scenario("overload", 64, 60.0)
    s.answers = [_overload.Answer(0.01, 0.25, 429, 0), *(_overload.Answer(3.0 + i, 0.01, 429, 0) for i in range(9))]
    assert s.latency_ms(429, 100) == 250.0  # the opening burst is in the whole window's figure
    assert round(s.latency_ms(429, 100, _overload.OPENING_S), 6) == 10.0  # and not in the steady state's
    assert s.latency_ms((400, 422), 99) != s.latency_ms((400, 422), 99)  # none: nan
    if os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        run_ns, wait_ns, slices = _overload.schedstat(os.getpid())
        assert run_ns > 0 and wait_ns >= 0 and slices > 0
    assert _overload.schedstat(2**22 + 12345) is None  # no such process


def _cell(rate, **counters):
    return {"rate": rate, "p50_ms": 10.0, "p95_ms": 20.0, **counters}


def test_peer_configurations_parse_in_order_once_and_refuse_unknown_names():
    import pytest
    from _peer_servers import PEERS, parse_peers

    assert [p.name for p in parse_peers("all")] == list(PEERS) == ["torch-fp32", "torch-bf16", "onnx", "torch-int8"]
    assert [p.name for p in parse_peers("onnx, torch-fp32,onnx")] == ["onnx", "torch-fp32"]
    assert {(p.engine, p.dtype) for p in PEERS.values()} == {("torch", "float32"), ("torch", "bfloat16"),
                                                              ("optimum", "auto"), ("torch", "int8")}
    # infinity's ONNX engine pools the first token unless told: all-MiniLM-L6-v2's vectors are mean-pooled
    assert PEERS["onnx"].pooling == "mean" and {p.pooling for p in PEERS.values() if p.engine == "torch"} == {"auto"}
    for bad in ("", "torch-fp16", "onnx,int8"):
        with pytest.raises(ValueError, match="--peers"):
            parse_peers(bad)


def test_yoso_serve_is_set_against_the_best_configuration_of_each_measure_by_median():
    from _peer_report import best_peer, tables
    from _peer_servers import PEERS

    fp32, bf16 = PEERS["torch-fp32"], PEERS["torch-bf16"]
    # short c=1: fp32 is faster in one run of three, bf16 in the median; long windows: fp32 is the best
    runs = [{"yoso": {"short c=1": _cell(30.0), "long one pass": _cell(4.0)},
             fp32.key: {"short c=1": _cell(25.0), "long windows": _cell(2.0)},
             bf16.key: {"short c=1": _cell(20.0), "long windows": _cell(1.0)}},
            {"yoso": {"short c=1": _cell(30.0), "long one pass": _cell(4.0)},
             fp32.key: {"short c=1": _cell(10.0), "long windows": _cell(2.0)},
             bf16.key: {"short c=1": _cell(15.0), "long windows": _cell(1.0)}},
            {"yoso": {"short c=1": _cell(30.0), "long one pass": _cell(5.0)},
             fp32.key: {"short c=1": _cell(12.0), "long windows": _cell(2.5)},
             bf16.key: {"short c=1": _cell(15.0), "long windows": _cell(1.0)}}]
    assert best_peer(runs, [fp32, bf16], "short c=1") is bf16  # median 15 against 12
    assert best_peer(runs, [fp32, bf16], "long windows") is fp32
    assert best_peer(runs, [fp32, bf16], "long small windows") is None  # measured by no one
    md = tables(runs, [fp32, bf16], [1])
    short = next(line for line in md.splitlines() if line.startswith("| short, concurrency 1"))
    # yoso 30 over bf16's own figure in each run (20, 15, 15), the best in bold
    assert short == "| short, concurrency 1 (req/s) | 30.0 | 12.0 | **15.0** | **2.00×** (1.50, 2.00, 2.00) |"
    long = next(line for line in md.splitlines() if line.startswith("| long, one pass"))
    assert long.endswith("| 4.00 | **2.00** | 1.00 | **2.00×** (2.00, 2.00, 2.00) |")
    pieces = next(line for line in md.splitlines() if line.startswith("| long, `/embed_pieces`"))
    assert pieces.endswith("| — | — | — | — |")


def test_the_floor_is_the_gemm_time_of_the_padded_tokens_served_against_the_wall_time():
    from _peer_report import batch_shape, floor_rows, floor_share, floor_table
    from _peer_servers import PEERS

    # 10 batches of 32 texts of 128 tokens in 2 s, 1.6 s of them in the forward
    cell = _cell(160.0, batches=10.0, inputs=320.0, padded_tokens=40960.0, tokens=40960.0, seconds=2.0,
                 forward_s=1.6)
    assert batch_shape(cell) == (32, 128)
    out = floor_share(cell, dense_s=0.1, shape=(32, 128))  # one dense pass over 32 × 128: 0.1 s
    assert out["served_tokens_s"] == 20480.0
    assert out["floor_tokens_s"] == 40960.0  # 10 passes, 1 s of GEMMs for the 40,960 tokens
    assert out["share"] == 0.5 and out["forward"] == 0.8 and out["dense_in_forward"] == 0.625
    # padding costs GEMM time but serves no tokens: half the tokens real, the same GEMM seconds
    padded = floor_share({**cell, "tokens": 20480.0}, dense_s=0.1, shape=(32, 128))
    assert padded["share"] == 0.5 and padded["floor_tokens_s"] == 20480.0
    runs = [{"yoso": {"short c=32": cell}}, {"yoso": {"short c=32": {**cell, "seconds": 1.25}}}]
    rows = floor_rows(runs, {(32, 128): 0.1})
    assert [round(r["share"], 2) for r in rows["short c=32"]] == [0.5, 0.8]
    line = floor_table(rows, runs).splitlines()[-1]
    assert line.startswith("| short c=32 | 32 × 128 | 26,624 | 40,960 | **65 %** (50, 80) |")
    # at the floor: yoso-serve's ratio to the best configuration over its share (1.6 / 0.5, then 2.0 / 0.8)
    onnx, fp32 = PEERS["onnx"], PEERS["torch-fp32"]
    for r, peer_rate in zip(runs, (100.0, 80.0)):
        r[onnx.key], r[fp32.key] = {"short c=32": _cell(peer_rate)}, {"short c=32": _cell(85.0)}
    line = floor_table(rows, runs, [fp32, onnx], {(32, 128): 0.1}).splitlines()[-1]
    assert line.endswith("| **2.85×** (3.20, 2.50) |")  # onnx: the best by median (90 against 85)


def test_the_peer_bench_prints_the_bound_of_its_run_time():
    import argparse

    import peer
    from _peer_servers import PEERS

    args = argparse.Namespace(runs=3, concurrency=[1, 8, 32], short_seconds=15.0, long_seconds=45.0, truncated=False)
    # per run: yoso-serve 60 + 45 + 90 s, each of four configurations the same (two long cells)
    assert peer.estimate_s(args, list(PEERS.values())) == 3 * 5 * 195
    args.truncated = True  # a third long cell for each configuration
    assert peer.estimate_s(args, list(PEERS.values())) == 3 * (195 + 4 * 240)


def test_the_agreement_table_sets_each_server_against_its_own_fp32():
    from _peer_report import agreement_table
    from _peer_servers import PEERS

    import numpy as np

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((4, 8))
    tilted = ref.copy()
    tilted[0, 0] += 1.0  # one vector moved: the min falls below the mean
    vectors = {"yoso": ref.tolist(), "yoso fp32": (2 * ref).tolist(),  # a scale is not a disagreement
               PEERS["torch-fp32"].key: ref.tolist(), PEERS["torch-int8"].key: tilted.tolist()}
    md = agreement_table(vectors, list(PEERS.values()), "bf16")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in md.splitlines() if line.startswith("| ")}
    assert "first 4 short texts" in md
    assert rows["yoso-serve (bf16)"][2:4] == ["1.00000", "1.00000 |"]
    int8 = rows["infinity torch int8"]
    assert int8[1] == "infinity torch fp32" and float(int8[3].rstrip(" |")) < float(int8[2]) < 1.0
    assert "infinity torch fp32" not in rows and "infinity torch bf16" not in rows  # itself; not in the run
    assert agreement_table({PEERS["torch-int8"].key: ref.tolist()}, list(PEERS.values()), "bf16") == ""


def test_a_configuration_that_does_not_keep_its_vectors_is_shown_but_never_the_best():
    import numpy as np
    from _peer_report import excluded_peers, tables
    from _peer_servers import PEERS

    fp32, bf16, int8 = PEERS["torch-fp32"], PEERS["torch-bf16"], PEERS["torch-int8"]
    ref = np.random.default_rng(1).standard_normal((16, 8))
    noisy = ref + 0.3 * np.random.default_rng(2).standard_normal(ref.shape)  # far below 0.995
    vectors = {fp32.key: ref.tolist(), bf16.key: (ref * 1.001).tolist(), int8.key: noisy.tolist()}
    excluded = excluded_peers(vectors, [fp32, bf16, int8])
    assert list(excluded) == [int8] and excluded[int8] < 0.995
    assert excluded_peers({int8.key: noisy.tolist()}, [int8]) == {}  # no fp32 reference: nothing to judge by
    runs = [{"yoso": {"short c=1": _cell(30.0)}, fp32.key: {"short c=1": _cell(10.0)},
             bf16.key: {"short c=1": _cell(15.0)}, int8.key: {"short c=1": _cell(40.0)}}]
    md = tables(runs, [fp32, bf16, int8], [1], excluded)
    short = next(line for line in md.splitlines() if line.startswith("| short, concurrency 1"))
    assert short == "| short, concurrency 1 (req/s) | 30.0 | 10.0 | **15.0** | 40.0 | **2.00×** (2.00) |"
    assert f"infinity torch int8 at {excluded[int8]:.3f}" in md and "0.995" in md
    assert "**0.75×**" in tables(runs, [fp32, bf16, int8], [1])  # compared when nothing is excluded


def test_int8_layers_captures_every_linears_input_and_puts_the_model_back():
    """bench/int8_layers.py's capture runs the bundled model with Q/K/V one by one (its stand-in for the fused
    product takes the forward's keywords) and the FFN's two layers apart, records each Linear's fp32 input, then
    leaves the model and the encoder module as they were."""
    import torch

    import int8_layers
    from yoso_serve.model import default_model_dir, encoder, linear, load_pretrained

    model = load_pretrained(default_model_dir()).eval()
    patched = encoder.project, encoder.int8_feed_forward
    short = torch.randint(1000, 20000, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = int8_layers.captured_inputs(model, short)
    linears = [m for m in model.modules() if isinstance(m, linear.Linear)]
    assert set(seen) == set(linears) and all(x.shape == (24, m.in_features) for m, x in seen.items())
    assert (encoder.project, encoder.int8_feed_forward) == patched and not any(m.int8 or "_int8" in vars(m) for m in linears)


def test_emulated_bf16_rounds_as_bf16_gemms_do_and_puts_the_switches_back(monkeypatch):
    """bench/emulated.py: a Linear in bf16 mode gives the fp32 product of its bf16 operands rounded to bf16 (GELU
    before the rounding); with K-blocks of 384 a 1536-input layer sums its blocks' bf16 outputs in fp32, bias in the
    first; where this CPU has bf16 GEMMs, within two bf16 roundings of oneDNN's; main hands the rest of its arguments
    to yoso-train inside the emulation (bf16 GEMMs said to be there); the switches are put back."""
    import torch
    import torch.nn.functional as F

    import emulated
    from yoso_serve.model import linear
    from yoso_serve.model.train import cli

    switches = lambda: (linear.ONEDNN_LINEAR, linear.BF16_K_BLOCK, linear.bf16_gemms)  # noqa: E731
    saved = switches()
    torch.manual_seed(0)
    lin = linear.Linear(1536, 24).eval()
    linear.set_dense_dtype(lin, "bf16")
    x = torch.randn(5, 1536)
    w, b = (t.detach().bfloat16().float() for t in (lin.weight, lin.bias))
    with torch.inference_mode():
        with emulated.emulate_bf16(None):
            one, gelu = lin(x), lin.activated(x, "gelu", F.gelu)
        with emulated.emulate_bf16(384):
            blocked = lin(x)
        product = F.linear(x.bfloat16().float(), w, b)
        assert torch.equal(one, product.bfloat16().float()) and torch.equal(gelu, F.gelu(product).bfloat16())
        parts = [F.linear(xj.bfloat16().float(), wj, b if j == 0 else None).bfloat16().float()
                 for j, (xj, wj) in enumerate(zip(x.split(384, dim=1), w.split(384, dim=1)))]
        assert torch.equal(blocked, ((parts[0] + parts[1]) + parts[2]) + parts[3])
        assert switches() == saved
        if linear.bf16_gemms():  # the real bf16 GEMM on this CPU
            with emulated.emulate_bf16(linear.BF16_K_BLOCK):
                mimic = lin(x)
            assert ((lin(x) - mimic).abs() <= 2 ** -7 * mimic.abs() + 1e-2).all()
    seen = []
    monkeypatch.setattr(cli, "main", lambda argv: seen.append((argv, linear.BF16_K_BLOCK, linear.bf16_gemms())) or 0)
    assert emulated.main(["--as", "zen4-bf16", "eval", "--dense-dtype", "bf16"]) == 0
    assert seen == [(["eval", "--dense-dtype", "bf16"], None, True)] and switches() == saved


def test_emulated_vnni_int8_gives_the_int_mm_routes_bits_and_puts_the_route_back(monkeypatch):
    """bench/emulated.py --as vnni-int8: an int8 Linear (weights at ±127, rows not shifted) gives the bits the real
    ``_int_mm`` route gives, its sums through a float64 GEMM; the route and ``torch._int_mm`` are put back."""
    import torch

    import emulated
    from yoso_serve.kernels import dense_int8
    from yoso_serve.model import linear
    from yoso_serve.model.dense_int8 import int8_weights

    saved = dense_int8.INT8_GEMM, torch._int_mm
    torch.manual_seed(0)
    x = torch.randn(7, 1536)
    with torch.inference_mode():
        with emulated.emulate_vnni_int8():
            lin = linear.Linear(1536, 40).eval()
            linear.set_dense_dtype(lin, "int8")
            fast = lin(x)
            assert dense_int8.weight_levels() == 127 and int8_weights(lin)[0].abs().max() > 63
        assert (dense_int8.INT8_GEMM, torch._int_mm) == saved
        monkeypatch.setattr(dense_int8, "INT8_GEMM", "int_mm")  # the real route: torch._int_mm itself
        assert torch.equal(lin(x), fast)


def test_forward_parts_times_each_part_inside_the_forward_and_puts_everything_back():
    """bench/forward_parts.py: in int8 the GEMMs, the attention, the C++ passes and LayerNorm are each timed (the
    call counts of the bundled model's six blocks), their sum stays inside the forward, and every patched function
    is the original again afterwards."""
    import torch

    import forward_parts
    from yoso_serve.kernels import cpu_kernels_built, dense_int8
    from yoso_serve.model import default_model_dir, linear, load_pretrained

    if not cpu_kernels_built():
        import pytest

        pytest.skip("needs the C++ extension")
    model = load_pretrained(default_model_dir()).eval()
    linear.set_dense_dtype(model, "int8")
    before = dense_int8.int8_sums, linear.ONEDNN_LINEAR, torch.nn.LayerNorm.forward
    out = forward_parts.parts(model, 2, 40, repeats=1)
    assert (dense_int8.int8_sums, linear.ONEDNN_LINEAR, torch.nn.LayerNorm.forward) == before
    calls = {label: n for label, (_, n) in out["parts"].items()}
    # the blocks' output norms run in the int8 scale-back pass: only the embeddings' is a LayerNorm call
    assert calls["GEMMs"] == 4 * 6 and calls["attention"] == 6 and calls["LayerNorm"] == 1
    assert calls["inputs quantized per row"] == 3 * 6 and calls["FFN in scaled back, GELU, quantized for FFN out"] == 6
    assert 0 < sum(s for s, _ in out["parts"].values()) <= out["forward"]
    text = forward_parts.table({("int8", 2, 40): out})
    assert "| GEMMs |" in text and "**forward**" in text


def test_exact_bf16_sets_the_dot_products_against_the_fp32_tiles_in_alternated_processes(capsys, monkeypatch):
    """bench/exact_bf16.py: each side in its own process (the switch is read once a process), the order
    alternating by run; one markdown row per shape, the per-run ratios and their median."""
    import pytest

    import exact_bf16

    seen = []
    real = exact_bf16.one_side
    monkeypatch.setattr(exact_bf16, "one_side", lambda dots, *a: seen.append(dots) or real(dots, *a))
    try:
        exact_bf16.main(["--shapes", "2x16", "1x40", "--runs", "2", "--repeats", "1"])
    except SystemExit as stop:
        pytest.skip(str(stop))
    assert seen == [True, False, False, True]
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| 2 × 16", "| 1 × 40"]
    assert all(r.endswith("× |") and len(r.split(" | ")[3].split(", ")) == 2 for r in rows[1:])


def test_fp32_packed_compares_both_paths_on_the_same_bits_and_puts_the_switch_back():
    """bench/fp32_packed.py: both paths run (each forward's output kept), give the same bits, and the module's
    switch is what it was afterwards."""
    import fp32_packed
    from yoso_serve.model import default_model_dir, linear, load_pretrained

    if linear.ONEDNN_LINEAR is None:
        import pytest

        pytest.skip("this torch has no oneDNN linear")
    model = load_pretrained(default_model_dir()).eval()
    before = linear.FP32_PACKED
    out = fp32_packed.compare(model, 2, 24, runs=2, repeats=1)
    assert linear.FP32_PACKED == before
    assert len(out["ratios"]) == 2 and all(r > 0 for r in out["ratios"]) and set(out["ms"]) == {"plain", "packed"}
    assert out["same"]
    assert "| 2 × 24 |" in fp32_packed.table({(2, 24): out})


def test_paired_evals_pair_each_query_of_two_evals_per_corpus_and_pooled(tmp_path, capsys):
    import json

    import paired_evals
    import pytest

    def write(name, deep, short, sha="s", cosines=None):
        folder = tmp_path / name
        folder.mkdir()
        results = {"deep_hits": {"docs": 2, "student, one pass": deep}, "deep_corpus_sha256": "d",
                   "short_hits": {"pairs": len(short), "student": short, "teacher": [1] * len(short)},
                   "short_corpus_sha256": sha}
        if cosines is not None:
            results["short_hits"]["student_cosines"] = cosines
        (folder / "results.json").write_text(json.dumps(results))
        return folder

    a, b = write("a", [1, 1, 0, 0], [1, 1, 1, 1]), write("b", [1, 1, 1, 0], [1, 1, 1, 0])
    c, d = write("c", [0, 0, 0, 0], [1, 0]), write("d", [0, 0, 0, 0], [1, 0])
    rows, scores = paired_evals.main([f"one={a},{b}", f"two={c},{d}"])
    assert scores == []  # evals without the short pairs' cosines: no score table
    got = {(r["corpus"], r["measure"]): r for r in rows}
    assert got["one", "student, one pass"]["recall_at_1"] == pytest.approx(0.25)  # candidate − baseline
    assert got["one", paired_evals.SHORT]["recall_at_1"] == pytest.approx(-0.25)
    assert (got["one", paired_evals.SHORT]["baseline"], got["one", paired_evals.SHORT]["candidate"]) == (1.0, 0.75)
    assert got["two", paired_evals.SHORT]["recall_at_1"] == 0 == got["two", paired_evals.SHORT]["ci95_low"]
    pooled = got["pooled", paired_evals.SHORT]  # every query of both corpora
    assert pooled["queries"] == 6 and pooled["recall_at_1"] == pytest.approx(-1 / 6)
    assert pooled["ci95_low"] <= pooled["recall_at_1"] <= pooled["ci95_high"]
    printed = capsys.readouterr().out
    assert "| one | short texts, student | 4 | 1.000 | 0.750 | -0.2500" in printed and "| **no** |" in printed
    with pytest.raises(SystemExit):  # the two evals of a corpus read other short pairs: refused, not paired
        paired_evals.main([f"one={a},{write('e', [1, 1, 0, 0], [1, 1, 1, 1], sha='other')}"])
    assert "different short queries" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a corpus named twice: refused, not one of its pairs dropped
        paired_evals.main([f"one={a},{b}", f"one={c},{d}"])
    assert "each corpus NAME once, got ['one', 'one']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        paired_evals.main([f"one={a}"])
    assert "expected NAME=BASELINE_DIR,CANDIDATE_DIR" in capsys.readouterr().err


def test_paired_evals_report_how_far_zero_shot_scores_move(tmp_path, capsys):
    import json
    import math

    import paired_evals
    import pytest

    def write(name, related, unrelated, center):
        folder = tmp_path / name
        folder.mkdir()
        short = {"pairs": 2, "student": [1, 1], "teacher": [1, 1],
                 "student_cosines": {"related": related, "unrelated": unrelated, "score_center": center}}
        (folder / "results.json").write_text(json.dumps({"short_hits": short, "short_corpus_sha256": "s"}))
        return folder

    def score(cos, center):  # the service's zero-shot score
        return 1 / (1 + math.exp(-20 * (cos - center)))

    base, cand = write("fp32", [0.50, 0.60], [0.20, 0.40], 0.43), write("int8", [0.50, 0.61], [0.20, 0.44], 0.43)
    other = write("plain", [0.50, 0.60], [0.20, 0.40], None)  # a model without a centre: the service's 0.3
    _, scores = paired_evals.main([f"pg={base},{cand}", f"seven={other},{other}"])
    got = {(r["corpus"], r["pairs"]): r for r in scores}
    unrelated = got["pg", "unrelated"]  # 0.40 → 0.44 crosses the centre 0.43: score below 0.5, then above
    moved = score(0.44, 0.43) - score(0.40, 0.43)
    assert unrelated["max_abs"] == pytest.approx(moved) and unrelated["crossed"] == 0.5
    assert unrelated["mean_abs"] == pytest.approx(moved / 2) == pytest.approx(unrelated["mean"])
    related = got["pg", "related"]
    assert related["max_abs"] == pytest.approx(score(0.61, 0.43) - score(0.60, 0.43)) and related["crossed"] == 0
    assert got["seven", "related"]["max_abs"] == 0 and got["seven", "related"]["n"] == 2
    pooled = got["pooled", "unrelated"]  # both corpora's pairs
    assert pooled["n"] == 4 and pooled["crossed"] == 0.25 and pooled["mean_abs"] == pytest.approx(moved / 4)
    printed = capsys.readouterr().out
    assert "Zero-shot scores" in printed and "| pg | unrelated | 2 |" in printed and "| 50.0 % |" in printed
