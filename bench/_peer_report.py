"""What bench/peer.py prints and plots from its runs: yoso-serve against the best infinity-emb configuration
of each measure, and the served tokens/s as a share of the dense-layer floor.

A run is ``{server key: {cell label: cell}}`` (server keys "yoso" and ``PeerConfig.key``); a cell has ``rate``
(requests or documents per second), ``p50_ms``, ``p95_ms`` and, for yoso-serve, the scheduler's counters
over the cell (bench/_peer_servers.py's ``cell``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from _peer_servers import PEER_MAX, PEERS

SHORT_TOKENS, WINDOW_TOKENS, PIECE_TOKENS = 128, 240, 128


@dataclass(frozen=True)
class Measure:
    """One figure both sides serve: yoso-serve's cell against each infinity configuration's cell."""

    name: str
    unit: str
    yoso: str
    peer: str


def measures(concurrency: list[int]) -> list[Measure]:
    short = [Measure(f"short, concurrency {c}", "req/s", f"short c={c}", f"short c={c}") for c in concurrency]
    return short + [
        Measure(f"long, one pass / {WINDOW_TOKENS}-token windows averaged", "docs/s", "long one pass", "long windows"),
        Measure(f"long, `/embed_pieces` / each {PIECE_TOKENS}-token window", "docs/s", "long pieces",
                "long small windows")]


def median(runs: list[dict], server: str, label: str, key: str = "rate") -> float | None:
    values = [r[server][label][key] for r in runs if label in r.get(server, {}) and r[server][label][key] is not None]
    return statistics.median(values) if values else None


def best_peer(runs: list[dict], peers: list, label: str):
    """The configuration with the highest median rate on ``label`` (None when none was measured)."""
    rated = [(median(runs, p.key, label), i, p) for i, p in enumerate(peers)]
    rated = [(rate, -i, p) for rate, i, p in rated if rate is not None]
    return max(rated, key=lambda t: t[:2])[2] if rated else None


def best_kept(runs: list[dict], peers: list, label: str, excluded: dict | None = None):
    """:func:`best_peer` among the configurations that keep their vectors (``excluded`` left out)."""
    return best_peer(runs, [p for p in peers if p not in (excluded or {})], label)


def ratios(runs: list[dict], a: tuple[str, str], b: tuple[str, str]) -> list[float]:
    """Per run, the rate of cell ``a`` over cell ``b`` ((server, label) each), where both were measured."""
    return [r[a[0]][a[1]]["rate"] / r[b[0]][b[1]]["rate"] for r in runs
            if a[1] in r.get(a[0], {}) and b[1] in r.get(b[0], {}) and r[b[0]][b[1]]["rate"]]


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "—" if x is None else format(x, spec)


def ratio_text(values: list[float]) -> str:
    if not values:
        return "—"
    return f"**{statistics.median(values):.2f}×** ({', '.join(f'{r:.2f}' for r in values)})"


def tables(runs: list[dict], peers: list, concurrency: list[int], excluded: dict | None = None) -> str:
    """The rates table (best configuration in bold, yoso-serve over it per run) and the latencies. ``excluded``
    (config → its mean cosine to fp32) are shown but never the best: they do not keep their vectors."""
    excluded = excluded or {}
    head = "".join(f" {p.label} |" for p in peers)
    kept = "" if not excluded else (
        f" that keeps its vectors (mean cosine to fp32 ≥ {AGREEMENT_BAR}, the bar yoso-serve's own int8 must pass to "
        "be a default; shown, not compared: " + ", ".join(f"{p.label} at {c:.3f}" for p, c in excluded.items()) + ")")
    lines = [f"Medians of {len(runs)} run(s); yoso-serve over the best infinity configuration of each row{kept} "
             "(per run in brackets):", "",
             f"| measure | yoso-serve |{head} yoso-serve / best |", "|---|---:|" + "---:|" * len(peers) + "---|"]
    for m in measures(concurrency):
        best = best_kept(runs, peers, m.peer, excluded)
        spec = ".1f" if m.unit == "req/s" else ".2f"
        cells = [fmt(median(runs, p.key, m.peer), spec) for p in peers]
        cells = [f"**{c}**" if p is best else c for c, p in zip(cells, peers)]
        versus = [] if best is None else ratios(runs, ("yoso", m.yoso), (best.key, m.peer))
        lines.append(f"| {m.name} ({m.unit}) | {fmt(median(runs, 'yoso', m.yoso), spec)} |"
                     f"{''.join(f' {c} |' for c in cells)} {ratio_text(versus)} |")
    if any("long truncated" in r.get(p.key, {}) for r in runs for p in peers):
        truncated = [fmt(median(runs, p.key, "long truncated"), ".2f") for p in peers]
        lines.append(f"| long, infinity truncated at {PEER_MAX} (docs/s, not compared) | — | {' | '.join(truncated)} "
                     "| — |")
    labels = [f"short c={c}" for c in concurrency]
    lines += ["", "Latency p50 / p95, short in ms, long in s (medians):", "",
              "| server | " + " | ".join(f"short c={c}" for c in concurrency) + " | long (one pass / 240-token "
              "windows) | pieces (`/embed_pieces` / 128-token windows) |", "|---|" + "---:|" * (len(labels) + 2)]
    for key, name, long_labels in [("yoso", "yoso-serve", ("long one pass", "long pieces"))] + [
            (p.key, p.label, ("long windows", "long small windows")) for p in peers]:
        row = [f"{fmt(median(runs, key, lb, 'p50_ms'), '.0f')} / {fmt(median(runs, key, lb, 'p95_ms'), '.0f')}"
               for lb in labels]
        for lb in long_labels:
            p50, p95 = median(runs, key, lb, "p50_ms"), median(runs, key, lb, "p95_ms")
            row.append(f"{fmt(p50 and p50 / 1000)} / {fmt(p95 and p95 / 1000)}")
        lines.append(f"| {name} | {' | '.join(row)} |")
    return "\n".join(lines)


def cosines(a: list, b: list) -> np.ndarray:
    """Row-wise cosine of two lists of vectors (in float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


# A configuration whose probe vectors' mean cosine to its own fp32 falls below this is shown, not compared:
# issue 77's bar for making yoso-serve's int8 a default.
AGREEMENT_BAR = 0.995


def peer_cosines(vectors: dict, peers: list) -> dict:
    """Each configuration's probe cosines (→ array) to infinity torch fp32's, that reference itself and the
    configurations without vectors left out; none where the reference is missing."""
    fp32 = PEERS["torch-fp32"].key
    ref = vectors.get(fp32)
    if ref is None:
        return {}
    return {p: cosines(vectors[p.key], ref) for p in peers if p.key in vectors and p.key != fp32}


def excluded_peers(vectors: dict, peers: list) -> dict:
    """The configurations (→ mean cosine) whose probe vectors stray below AGREEMENT_BAR from infinity torch
    fp32's; none where that reference is missing."""
    means = {p: float(c.mean()) for p, c in peer_cosines(vectors, peers).items()}
    return {p: c for p, c in means.items() if c < AGREEMENT_BAR}


def agreement_table(vectors: dict, peers: list, yoso_as: str) -> str:
    """What each server's speed costs its vectors: the probe texts' mean (min) cosine to the same model in fp32,
    yoso-serve's against its dense layers in fp32 in the bench process, each infinity configuration's against
    infinity torch fp32's server (absent where that one did not run)."""
    rows = []
    if "yoso" in vectors and "yoso fp32" in vectors:
        rows.append((f"yoso-serve ({yoso_as})", "the same model, dense layers in fp32 (in the bench process)",
                     cosines(vectors["yoso"], vectors["yoso fp32"])))
    rows += [(p.label, PEERS["torch-fp32"].label, c) for p, c in peer_cosines(vectors, peers).items()]
    if not rows:
        return ""
    n = len(next(iter(vectors.values())))
    return "\n".join([f"Cosine to fp32 over the first {n} short texts (each server's first run):", "",
                      "| server | against | mean cosine | min |", "|---|---|---:|---:|",
                      *(f"| {name} | {against} | {c.mean():.5f} | {c.min():.5f} |" for name, against, c in rows)])


def plot(runs: list[dict], peers: list, concurrency: list[int], long_concurrency: int, path,
         dense: str | None = None, excluded: dict | None = None) -> None:
    """``dense``: the dense dtype yoso-serve's /info reported (the legend says it); ``excluded`` as in
    :func:`tables` (the legend gives their cosine to fp32)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _sections import save_figure

    yoso = "yoso-serve (defaults)" if dense is None else f"yoso-serve (dense {dense})"
    excluded = excluded or {}
    servers = [("yoso", yoso)] + [(p.key, p.label + (f" (cosine {excluded[p]:.3f} to fp32)" if p in excluded else ""))
                                  for p in peers]
    fig, (ax_s, ax_l) = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(servers)
    for ax, groups in ((ax_s, [m for m in measures(concurrency) if m.unit == "req/s"]),
                       (ax_l, [m for m in measures(concurrency) if m.unit == "docs/s"])):
        xs = np.arange(len(groups))
        for i, (key, name) in enumerate(servers):
            rates = [median(runs, key, m.yoso if key == "yoso" else m.peer) or 0 for m in groups]
            ax.bar(xs + (i - (len(servers) - 1) / 2) * width, rates, width, label=name)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_xticks(xs, [m.name.split(", ", 1)[1] for m in groups], fontsize=8)
    ax_s.set_ylabel(f"req/s, {SHORT_TOKENS}-token texts")
    ax_l.set_ylabel(f"docs/s, mean 2.5k tokens, concurrency {long_concurrency}")
    fig.suptitle(f"Served over loopback, CPU, medians of {len(runs)} run(s)")
    save_figure(fig, path)


# the yoso-serve cells whose served tokens/s the floor is compared with
FLOOR_CELLS = ("short c=1", "short c=8", "short c=32", "long one pass", "long pieces")


def batch_shape(cell: dict) -> tuple[int, int]:
    """The cell's mean batch as (inputs, padded tokens per input), from the scheduler's counters."""
    inputs = max(1, round(cell["inputs"] / cell["batches"]))
    return inputs, max(1, round(cell["padded_tokens"] / cell["batches"] / inputs))


def floor_share(cell: dict, dense_s: float, shape: tuple[int, int]) -> dict:
    """Served tokens/s against the dense-layer floor: ``dense_s`` is one dense pass over ``shape``, so the
    cell's padded tokens alone cost ``padded_tokens / rows * dense_s`` seconds of GEMMs. ``share`` is served
    tokens/s over the floor's (the fraction of the wall time the GEMMs alone would take); ``forward`` the
    fraction spent in the forward; ``dense_in_forward`` the GEMMs' fraction of the forward."""
    floor_s = cell["padded_tokens"] / (shape[0] * shape[1]) * dense_s
    return {"served_tokens_s": cell["tokens"] / cell["seconds"], "floor_tokens_s": cell["tokens"] / floor_s,
            "share": floor_s / cell["seconds"], "forward": cell["forward_s"] / cell["seconds"],
            "dense_in_forward": floor_s / cell["forward_s"]}


def floor_rows(runs: list[dict], dense: dict) -> dict:
    """Per FLOOR_CELLS label, the per-run floor shares (``dense``: batch shape → seconds of one pass)."""
    out = {}
    for label in FLOOR_CELLS:
        per_run = [floor_share(r["yoso"][label], dense[batch_shape(r["yoso"][label])], batch_shape(r["yoso"][label]))
                   for r in runs if label in r.get("yoso", {}) and r["yoso"][label].get("batches")]
        if per_run:
            out[label] = per_run
    return out


def ceilings(runs: list[dict], dense: dict, label: str, best_key: str, peer_label: str) -> list[float]:
    """Per run, what yoso-serve's cell ``label`` would make of its ratio to the best configuration's cell were it
    served at the floor (its ratio over its share): the most that faster code around the same GEMMs can give."""
    out = []
    for r in runs:
        cell, peer = r.get("yoso", {}).get(label), r.get(best_key, {}).get(peer_label)
        if cell and cell.get("batches") and peer and peer["rate"]:
            shape = batch_shape(cell)
            out.append(cell["rate"] / peer["rate"] / floor_share(cell, dense[shape], shape)["share"])
    return out


def floor_table(rows: dict, runs: list[dict], peers: list | None = None, dense: dict | None = None,
                excluded: dict | None = None, concurrency: list[int] | None = None) -> str:
    """The floor shares per cell; with ``peers`` and ``dense``, also yoso-serve over the row's best configuration
    (``excluded`` left out, as in :func:`tables`) at the floor (:func:`ceilings`)."""
    ceiling = peers is not None and dense is not None
    lines = ["| served (yoso-serve cell) | mean batch (inputs × tokens) | served tokens/s | dense floor tokens/s | "
             "share of the floor (per run) | in the forward | GEMMs / forward |"
             + (" over the best, at the floor (per run) |" if ceiling else ""),
             "|---|---|---:|---:|---|---:|---:|" + ("---|" if ceiling else "")]
    by_cell = {m.yoso: m for m in measures(concurrency or [1, 8, 32])}
    for label, per_run in rows.items():
        shapes = [batch_shape(r["yoso"][label]) for r in runs if label in r.get("yoso", {})]
        med = {k: statistics.median(x[k] for x in per_run) for k in per_run[0]}
        shares = [x["share"] for x in per_run]
        line = (f"| {label} | {' / '.join(dict.fromkeys(f'{a} × {b}' for a, b in shapes))} | "
                f"{med['served_tokens_s']:,.0f} | {med['floor_tokens_s']:,.0f} | **{100 * med['share']:.0f} %** "
                f"({', '.join(f'{100 * s:.0f}' for s in shares)}) | {100 * med['forward']:.0f} % | "
                f"{100 * med['dense_in_forward']:.0f} % |")
        if ceiling:
            m = by_cell.get(label)
            best = None if m is None else best_kept(runs, peers, m.peer, excluded)
            line += f" {ratio_text(ceilings(runs, dense, label, best.key, m.peer) if best else [])} |"
        lines.append(line)
    return "\n".join(lines)


def plot_floor(rows: dict, path) -> None:
    """Where each served shape's wall time goes: the GEMMs, the rest of the forward, outside the forward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from _sections import save_figure

    labels = list(rows)
    med = [{k: statistics.median(x[k] for x in rows[lb]) for k in rows[lb][0]} for lb in labels]
    gemm = np.array([m["share"] for m in med])
    forward = np.array([m["forward"] for m in med])
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(labels) + 2.4))
    ax.barh(labels, 100 * gemm, label="dense layers alone (the floor)")
    ax.barh(labels, 100 * np.clip(forward - gemm, 0, None), left=100 * gemm,
            label="rest of the forward (attention, LayerNorm, ...)")
    ax.barh(labels, 100 * (1 - forward), left=100 * forward, label="outside the forward (HTTP, tokenising, idle)")
    ax.axvline(70, color="k", lw=0.8, ls="--", label="the target: 70 % at concurrency 32")
    ax.set_xlabel("% of the served wall time")
    ax.set_title("yoso-serve's served time against its dense layers alone")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)  # below: no bar hidden
    save_figure(fig, path)
