"""The training stages of ``yoso-minilm-l6-4096`` as data: one list, in pipeline order.

Each stage is one ``yoso-train`` command: its name (the run directory under ``--work``), the stage whose
model it starts from (None: the converted teacher), the data it reads (a file under ``--work``), its seed,
its steps, its flags and one line on why it exists. ``card`` is the sentence the model card says of it,
formatted with the stage's recorded config (``c``), ``steps``, ``minutes``, ``sessions`` and ``size`` (its
piece sizes, "64 or 128"). LOG.md has what each stage was measured to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stage:
    name: str
    command: str  # distill | longdoc
    start: str | None  # the stage whose model/ it trains on; None: the teacher, converted
    data: str  # under --work
    seed: int
    steps: int
    flags: str  # after --out; {steps} and {seed} are filled in
    why: str
    card: str
    kept_out_eval: str = ""  # the run directory of its deep retrieval on the source kept out ("" = not measured)
    label: str = ""  # that eval's row label in the card


# Flags every distillation stage shares around its own (model, schedule).
_DISTILL = ("--max-length 256 --train-hashes 0,32 --serve-hashes 32 --hash-family gaussian --exact-backward true "
            "--dropout 0 {model}{schedule} --save-every 50 --log-every 10 --seed {{seed}} --save-fp16")
# Stages four to nine: whole 4096-token crops, a 1024-document queue, a starting temperature of 0.03, 32 short
# pairs; {near} the neighbourhood flags, {w} the distillation weight, {tail} the piece loss.
_HARDER = ("--batch-size 4 --spans-per-doc 4 --short-pairs 32 --queue 1024 {near}--w-distill {w} "
           "--curriculum 4096:1 --doc-hashes 32 --query-hashes 0 --lr 2e-5 --warmup 0.02 --max-steps {{steps}} "
           "--save-every 10 --log-every 1 --seed {{seed}} --save-fp16{tail}")
_NEAR = "--neighbourhood 12 --temperature 0.03 --temperature-lr-scale 250 "
_PIECE_CARD = (". {minutes:.1f} minutes over {sessions} session(s).")

STAGES: list[Stage] = [
    Stage("distill", "distill", None, "data/train_passages.jsonl", 0, 1100,  # ≈ 2.2 epochs; ≈ 80 min on 2 cores
          _DISTILL.format(model="", schedule="--epochs 3 --max-steps {steps} --batch-size 16 --lr 1.5e-4 "
                                             "--warmup 0.03"),
          "the converted teacher's softmax replaced by LSH attention: distillation (LSH in training) brings the "
          "student back towards the teacher at the served 32 hashes",
          "the converted teacher trained {steps} optimizer steps (batch {c[batch_size]} × {c[grad_accum]}, lr "
          "{c[lr]:g}) in {minutes:.1f} minutes of wall-clock time over {sessions} session(s)."),
    Stage("refine", "distill", "distill", "data/train_passages.jsonl", 1, 800,  # ≈ 55 min on 2 cores
          # AdamW moves a zero-initialised weight about lr per step: at 5e-5 the new kernels would stay near zero
          _DISTILL.format(model="--conv-window 33 --conv-lr-scale 40 ",
                          schedule="--epochs 1 --max-steps {steps} --batch-size 16 --lr 5e-5 --warmup 0.05"),
          "a zero-initialised YOSO-C value convolution (the paper's 33-wide) adds local attention LSH misses",
          "a YOSO-C depthwise convolution over the values (width {c[conv_window]}, zero-initialised, so the stage "
          "starts from stage 1's outputs) added to every layer; {steps} optimizer steps (batch {c[batch_size]} × "
          "{c[grad_accum]}, lr {c[lr]:g}, the convolution at {c[conv_lr_scale]:g}× that) in {minutes:.1f} minutes "
          "over {sessions} session(s).",
          "retrieval-refined", "refined model (stage 2), one pass"),
    Stage("longdoc", "longdoc", "refine", "longdoc-data/train_docs.jsonl", 0, 240,  # ≈ 5–8 h on 2 cores
          "--batch-size 4 --spans-per-doc 4 --short-pairs 16 --queue 128 --curriculum 1024:0.35,2048:0.7,4096:1 "
          "--doc-hashes 32 --query-hashes 0 --lr 3e-5 --warmup 0.05 --max-steps {steps} --save-every 10 "
          "--log-every 1 --seed {seed} --save-fp16",
          "distillation only ever saw 256 tokens: contrastive spans → whole documents teach the one pass to find "
          "what is deep inside 4096 tokens",
          "{steps} optimizer steps of {c[batch_size]} documents of one source (the in-batch negatives of the same "
          "source are the hard ones) with {c[spans_per_doc]} spans each (a paragraph or one of its sentences, drawn "
          "uniformly over the document's tokens), lr {c[lr]:g}, documents cropped by the length curriculum "
          "{c[curriculum]} (tokens:fraction of the steps); losses: symmetric InfoNCE spans ↔ documents with a "
          "learned temperature and a queue of {c[queue]} recent documents, symmetric InfoNCE of {c[short_pairs]} "
          "first-sentence → rest pairs, and 1 − cos to the teacher on every short text; documents at "
          "{c[doc_hashes]} hashes with the served projections, short texts at {c[query_hashes]} (exact). "
          "{minutes:.1f} minutes over {sessions} session(s).",
          "retrieval-longdoc", "stage 3's model, one pass"),
    Stage("longdoc2", "longdoc", "longdoc", "longdoc-data/train_docs.jsonl", 1, 360,  # ≈ 4–5 h on 2 cores
          _HARDER.format(near="--temperature 0.03 ", w="2", tail=""),
          "stage 3 had solved its in-batch task (span top-1 ≈ 0.95) and short texts drifted: a 1024-document queue, "
          "a colder start, twice the short pairs and distillation",
          "stage 3 continued for {steps} optimizer steps on crops of {c[curriculum]} (tokens:fraction) with harder "
          "contrast: a queue of {c[queue]} documents, a starting temperature of {c[temperature]:g}, "
          "{c[short_pairs]} short pairs, distillation weight {c[w_distill]:g}, lr {c[lr]:g}. {minutes:.1f} minutes "
          "over {sessions} session(s).",
          "retrieval-longdoc2", "stage 4's model, one pass"),
    Stage("longdoc3", "longdoc", "longdoc2", "longdoc-data/train_docs.jsonl", 2, 160,  # ≈ 70 min on 2 cores
          _HARDER.format(near=_NEAR, w="2", tail=""),
          "a quarter of stage 4's misses were neighbouring pages: a step's documents come from 12 consecutive ones, "
          "and the temperature (stuck at the model's lr) learns at 250×",
          "stage 4 continued for {steps} optimizer steps with neighbouring documents as the hard negatives: each "
          "step's {c[batch_size]} documents drawn from {c[neighbourhood]} consecutive documents of one source in key "
          "order (pages of one section), the temperature (starting at {c[temperature]:g}) at "
          "{c[temperature_lr_scale]:g}× the lr of the rest, lr {c[lr]:g}, otherwise as stage 4. {minutes:.1f} "
          "minutes over {sessions} session(s).",
          "retrieval-longdoc3", "stage 5's model, one pass"),
    Stage("longdoc4", "longdoc", "longdoc3", "longdoc-data-wide/train_docs.jsonl", 7, 100,  # ≈ 32 min on 2 cores
          _HARDER.format(near=_NEAR, w="0.5", tail=""),
          "of six continuations of stage 5, only the wider corpus at a quarter of the distillation weight gained on "
          "the source kept out",
          "stage 5 continued for {steps} optimizer steps on the wider corpus (Data above) with the distillation "
          "weight at {c[w_distill]:g}, otherwise as stage 5. {minutes:.1f} minutes over {sessions} session(s).",
          "retrieval-longdoc4", "stage 6's model, one pass"),
    Stage("longdoc5", "longdoc", "longdoc4", "longdoc-data-wide/train_docs.jsonl", 11, 100,  # each ≈ 25–37 min
          _HARDER.format(near=_NEAR, w="0.5", tail=" --w-segment 1 --segment-tokens 128"),
          "indexed piece by piece, stage 6 lost to the teacher's 128-token windows (0.866 vs 0.887): a span → piece "
          "loss on the one pass's pieces",
          "stage 6 continued for {steps} optimizer steps with a third loss, span → piece: each span against the mean "
          "token states of the consecutive {size}-token pieces of the batch's crops (cut from the first token, as "
          "the piece evaluation cuts them), its positives the pieces of its own block, weight {c[w_segment]:g}; "
          "otherwise as stage 6" + _PIECE_CARD),
    Stage("longdoc6", "longdoc", "longdoc5", "longdoc-data-wide/train_docs.jsonl", 12, 100,
          _HARDER.format(near=_NEAR, w="0.5", tail=" --w-segment 1 --segment-tokens 64,128"),
          "pieces of 64 or 128 tokens, one size drawn per step, so that both piece sizes users index are trained",
          "stage 7 continued for {steps} optimizer steps with pieces of {size} tokens (one size drawn per step)"
          + _PIECE_CARD),
    Stage("longdoc7", "longdoc", "longdoc6", "longdoc-data-wide/train_docs.jsonl", 13, 100,
          _HARDER.format(near=_NEAR, w="0.5", tail=" --w-segment 1 --segment-tokens 64,128"),
          "stage 8 continued as it, with another seed",
          "stage 8 continued for {steps} optimizer steps as stage 8 (pieces of {size} tokens)" + _PIECE_CARD),
]

BY_NAME = {s.name: s for s in STAGES}
FINAL = STAGES[-1].name  # the model that is evaluated and bundled


def model_dir(work: Path, stage: str) -> Path:
    return work / stage / "model"


def argv(stage: Stage, work: Path, teacher: Path, minutes: float = 0.0, resume: bool = False) -> list[str]:
    """The ``yoso-train`` command of ``stage`` under ``work``, with ``teacher``; ``minutes`` > 0 bounds it,
    ``resume`` continues its last checkpoint."""
    data, out = str(work / stage.data), str(work / stage.name)
    if stage.command == "distill":
        head = ["distill", "--teacher", str(teacher), "--data", data,
                *(["--student", str(model_dir(work, stage.start))] if stage.start else []), "--out", out]
    else:
        head = [stage.command, "--model", str(model_dir(work, stage.start)), "--teacher", str(teacher),
                "--data", data, "--out", out]
    argv_ = head + stage.flags.format(steps=stage.steps, seed=stage.seed).split()
    if minutes:
        argv_ += ["--max-minutes", str(minutes)]
    return argv_ + (["--resume"] if resume else [])
