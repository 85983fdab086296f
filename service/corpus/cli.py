"""``yoso-embed``: embed a whole corpus into a Parquet dataset, resumable, on this machine or on Ray.

Exit status: 0 when every document is written (bad rows are reported and skipped, not failures); 1 when
some document failed in the engine (rerun to retry it) or the job stopped; 2 when it cannot run as asked
(a bad option, a missing input, an output folder written with other settings).
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing

from ..settings import ServeSettings, env_name, flag_name
from .job import ENGINES, PART_ROWS, embed_corpus
from .sources import CorpusError
from .work import BATCH_SETTINGS, VECTOR_SETTINGS

# The settings the job's own flags cover (--model; --threads-per-worker sets the engine's threads).
_SERVER_FLAGS = tuple(n for n in VECTOR_SETTINGS + BATCH_SETTINGS if n != "hashes")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yoso-embed", description="Embed every document of a corpus with the server's engine into a Parquet "
        "dataset under --out (one row per document; parts/ and manifest.json). Rerun the same command after a "
        "kill to finish: ids already written are skipped. See docs/corpus.md.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="JSONL files (.jsonl, .ndjson, .json: one object a line), Parquet files (.parquet), or "
                   "folders of UTF-8 text files (one document each, its path in the folder is its id).")
    p.add_argument("--out", required=True, metavar="DIR", help="Output folder: parts/part-*.parquet and "
                   "manifest.json.")
    p.add_argument("--model", metavar="DIR", help="Model directory [default: the bundled default model].")
    p.add_argument("--pieces", type=int, metavar="TOKENS", help="Also store the vector of each TOKENS-token piece "
                   "with its token and character ranges, from the same one pass (what /embed_pieces returns; a "
                   "document past the model's length is read up to it, and marked truncated).")
    p.add_argument("--hashes", metavar="auto|m", help="Hash count, as yoso-serve's --hashes [default: auto].")
    p.add_argument("--id-field", default="id", help="JSONL key or Parquet column of the id [default: id].")
    p.add_argument("--text-field", default="text", help="JSONL key or Parquet column of the text [default: text].")
    p.add_argument("--engine", choices=ENGINES, default="local", help="local: this process; ray: Ray Data "
                   "workers [default: local].")
    p.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to run on (ray.init's address); default: "
                   "a Ray started for the job on this machine.")
    p.add_argument("--workers", type=int, default=1, help="Ray workers, each loading the model once [default: 1].")
    p.add_argument("--threads-per-worker", type=int, metavar="T", help="CPU threads of each worker (the local "
                   "engine's torch threads) [default: torch's choice locally, the CPUs / --workers on Ray].")
    p.add_argument("--gpus-per-worker", type=float, default=0, metavar="G", help="GPUs of each Ray worker; > 0 "
                   "runs the workers on CUDA [default: 0].")
    p.add_argument("--overwrite", action="store_true", help="Replace what an earlier run wrote in --out, "
                   "whatever its settings.")
    p.add_argument("--part-rows", type=int, default=PART_ROWS, help=f"Documents per Parquet part (a part is "
                   f"what a kill can lose and a rerun redoes) [default: {PART_ROWS}].")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="No progress bar.")
    server = p.add_argument_group("server settings", "as yoso-serve's flags and YOSO_<NAME> variables (a flag "
                                  "wins); those that decide a vector are stored in the manifest and must match "
                                  "on a rerun")
    for name in _SERVER_FLAGS:
        field = ServeSettings.model_fields[name]
        choices = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else None
        server.add_argument(flag_name(name), dest=f"serve_{name}", choices=choices, metavar=None if choices
                            else name.upper(), help=f"{field.description} [env {env_name(name)}]".replace("%", "%%"))
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve = {k.removeprefix("serve_"): v for k, v in vars(args).items() if k.startswith("serve_") and v is not None}
    try:
        manifest = embed_corpus(
            args.input, args.out, model=args.model, pieces=args.pieces, hashes=args.hashes, id_field=args.id_field,
            text_field=args.text_field, engine=args.engine, ray_address=args.ray_address, workers=args.workers,
            threads_per_worker=args.threads_per_worker, gpus_per_worker=args.gpus_per_worker,
            overwrite=args.overwrite, part_rows=args.part_rows, progress=args.progress, **serve)
    except CorpusError as exc:
        print(f"yoso-embed: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"yoso-embed: interrupted; what is in {args.out}/parts is complete: run the same command again to "
              "finish", file=sys.stderr)
        sys.exit(130)
    c = manifest["counts"]
    print(f"yoso-embed: {c['documents']} documents in {args.out} ({c['embedded']} embedded now, {c['already_done']} "
          f"already there), {c['bad']} bad rows skipped; manifest: {args.out}/manifest.json", file=sys.stderr)
    sys.exit(0 if manifest["state"] == "complete" else 1)
