"""BERT-family checkpoint → YOSO checkpoint (``yoso-convert``).

The two architectures share every weight: YOSO changes only what attention does with Q, K and
V (ℓ2-normalised, LSH collision probability instead of softmax, N-YOSO output norm), so the
weights are copied key by key. The position table changes shape: YOSO's position ids start at
2 (rows 0–1 unused) and a long-document model needs more rows than BERT's 512, so the learned
table is tiled up to ``max_positions``, as Longformer initialised its 4096 positions. The
tokenizer and the sentence-transformers pooling mode (``1_Pooling/config.json``) travel along;
BERT's pooler and task heads other than the masked-LM head are dropped (YOSO has no pooler).
No network access: the source is a local directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from .argtypes import bounded
from .checkpoint import BERT_FAMILY, CheckpointError, check_out_dir, copy_weights, read_state_dict, save_pretrained
from .config import EncoderConfig
from .encoder import POSITION_OFFSET
from .encoder_model import EncoderModel
from .hashes import MAX_HASHES
from .tokenizer import SIDE_FILES, TextTokenizer

log = logging.getLogger(__name__)

# roberta-style tables already carry padding_idx + 1 = 2 leading rows before position 0.
_OFFSET_FAMILIES = ("roberta", "xlm-roberta", "camembert")
_RAW_TOKENIZER_FILES = ("vocab.txt", "vocab.json", "merges.txt")
_LM_HEAD_RENAMES = {
    "cls.predictions.transform.dense.": "cls.predictions.transform.dense.",
    "cls.predictions.transform.LayerNorm.": "cls.predictions.transform.LayerNorm.",
    "lm_head.dense.": "cls.predictions.transform.dense.",
    "lm_head.layer_norm.": "cls.predictions.transform.LayerNorm.",
}


def find_transformer_dir(src: Path) -> tuple[Path, Path | None]:
    """(directory of the BERT weights, pooling config or None), also for sentence-transformers layouts."""
    modules = src / "modules.json"
    model_dir, pooling = src, None
    if modules.is_file():
        for entry in json.loads(modules.read_text(encoding="utf-8")):
            kind, sub = entry.get("type", ""), entry.get("path", "")
            if kind.endswith("Transformer"):
                model_dir = src / sub
            elif kind.endswith("Pooling") and (src / sub / "config.json").is_file():
                pooling = src / sub / "config.json"
    if pooling is None and (src / "1_Pooling" / "config.json").is_file():
        pooling = src / "1_Pooling" / "config.json"
    return model_dir, pooling


def pooling_mode(pooling_config: Path | None) -> str:
    """"cls" or "mean" from a sentence-transformers pooling config (mean when absent or unsupported)."""
    if pooling_config is None:
        return "mean"
    data = json.loads(pooling_config.read_text(encoding="utf-8"))
    if data.get("pooling_mode_cls_token"):
        return "cls"
    if not data.get("pooling_mode_mean_tokens"):
        log.warning("pooling in %s is neither mean nor cls; the YOSO model pools by mean", pooling_config)
    return "mean"


def extend_positions(table: torch.Tensor, max_positions: int, *, offset_rows: int) -> torch.Tensor:
    """(rows, h) learned table → (max_positions + 2, h): zero rows 0–1, then the table tiled."""
    learned = table[offset_rows:]  # (P, h): row i = position i
    repeats = math.ceil(max_positions / learned.shape[0])
    tiled = learned.repeat(repeats, 1)[:max_positions]
    head = torch.zeros(POSITION_OFFSET, table.shape[1], dtype=table.dtype)
    return torch.cat([head, tiled], dim=0)


def yoso_state_dict(state: dict[str, torch.Tensor], model_type: str, max_positions: int) -> dict[str, torch.Tensor]:
    """Rename BERT-family keys to YOSO keys and extend the position table; other keys are dropped."""
    out, dropped = {}, []
    for key, tensor in tqdm(sorted(state.items()), desc="converting weights", unit="tensor"):
        bare = key.split(".", 1)[1] if key.startswith(("bert.", "roberta.")) else key
        if bare.startswith("encoder.layer.") or (bare.startswith("embeddings.") and not bare.endswith("_ids")):
            out["yoso." + bare] = tensor
            continue
        if key in ("cls.predictions.bias", "lm_head.bias"):
            out["cls.predictions.bias"] = tensor
            continue
        prefix = next((p for p in _LM_HEAD_RENAMES if key.startswith(p)), None)
        if prefix is not None:
            out[_LM_HEAD_RENAMES[prefix] + key[len(prefix):]] = tensor
        elif not bare.endswith("_ids"):
            dropped.append(key)
    if dropped:
        log.info("not converted (no YOSO counterpart): %s", ", ".join(dropped))
    key = "yoso.embeddings.position_embeddings.weight"
    if key not in out:
        raise CheckpointError("the source checkpoint has no embeddings.position_embeddings.weight")
    offset_rows = POSITION_OFFSET if model_type in _OFFSET_FAMILIES else 0
    out[key] = extend_positions(out[key], max_positions, offset_rows=offset_rows)
    return out


def yoso_config(src: dict, *, max_positions: int, pooling: str, **attention) -> EncoderConfig:
    """The YOSO config of a BERT-family config.json dict; ``attention`` sets the YOSO fields."""
    roberta_like = src.get("model_type") in _OFFSET_FAMILIES
    return EncoderConfig(
        vocab_size=src["vocab_size"],
        hidden_size=src["hidden_size"],
        num_hidden_layers=src["num_hidden_layers"],
        num_attention_heads=src["num_attention_heads"],
        intermediate_size=src["intermediate_size"],
        hidden_act=src.get("hidden_act", "gelu"),
        hidden_dropout_prob=src.get("hidden_dropout_prob", 0.1),
        attention_probs_dropout_prob=src.get("attention_probs_dropout_prob", 0.1),
        max_position_embeddings=max_positions,
        type_vocab_size=src.get("type_vocab_size", 2),
        layer_norm_eps=src.get("layer_norm_eps", 1e-12),
        initializer_range=src.get("initializer_range", 0.02),
        pad_token_id=src.get("pad_token_id", 1 if roberta_like else 0),
        bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"),
        pooling=pooling,
        **attention,
    )


def convert_bert_to_yoso(src_dir: str | Path, out_dir: str | Path, *, max_positions: int = 4096,
                         use_expectation: bool = False, num_hash: int = 32, hash_code_len: int = 8,
                         hash_seed: int = 0, pooling: str | None = None) -> Path:
    """Convert a local BERT-family checkpoint (plain or sentence-transformers) into a YOSO directory.

    ``pooling`` None takes the sentence-transformers pooling mode (mean when there is none).
    Returns ``out_dir``. Raises CheckpointError for a missing or unsupported source.
    """
    if max_positions < 1:
        raise ValueError(f"max_positions must be >= 1, got {max_positions}")
    src, out = Path(src_dir), Path(out_dir)
    model_dir, pooling_config = find_transformer_dir(src)
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {model_dir}")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    if raw.get("model_type") not in BERT_FAMILY:
        raise CheckpointError(
            f"cannot convert model_type {raw.get('model_type')!r} from {config_file}; supported: {BERT_FAMILY}"
        )
    check_out_dir(src, out)  # before anything is written: an --out in the source would overwrite it
    config = yoso_config(raw, max_positions=max_positions, pooling=pooling or pooling_mode(pooling_config),
                         use_expectation=use_expectation, num_hash=num_hash, hash_code_len=hash_code_len,
                         hash_seed=hash_seed)
    state = yoso_state_dict(read_state_dict(model_dir), raw["model_type"], max_positions)
    tokenizer = TextTokenizer.from_dir(model_dir)
    tokenizer_config = tokenizer.side_files.get("tokenizer_config.json")
    if tokenizer_config is not None:
        tokenizer.side_files["tokenizer_config.json"] = {**tokenizer_config, "model_max_length": max_positions}
    model = EncoderModel(config, with_mlm="cls.predictions.transform.dense.weight" in state, tokenizer=tokenizer)
    copy_weights(model, state, model_dir)
    save_pretrained(model, out)
    for name in _RAW_TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    log.info("converted %s → %s (%s)", model_dir, out, ", ".join(n for n in SIDE_FILES if (out / n).is_file()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="yoso-convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="src", required=True, help="BERT-family checkpoint directory")
    parser.add_argument("--out", required=True, help="output directory for the YOSO checkpoint")
    parser.add_argument("--max-positions", type=bounded(int, 1, 65536), default=4096,
                        help="position table size (default 4096)")
    parser.add_argument("--num-hash", type=bounded(int, 0, MAX_HASHES), default=32,
                        help="default LSH hashes per call (default 32)")
    parser.add_argument("--hash-code-len", type=int, default=8, help="hash bits τ (default 8)")
    parser.add_argument("--use-expectation", action="store_true", help="default to exact YOSO-E")
    parser.add_argument("--pooling", choices=("mean", "cls"), default=None, help="override the pooling mode")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = convert_bert_to_yoso(args.src, args.out, max_positions=args.max_positions,
                                   use_expectation=args.use_expectation, num_hash=args.num_hash,
                                   hash_code_len=args.hash_code_len, pooling=args.pooling)
    except ValueError as exc:  # CheckpointError included
        parser.exit(2, f"yoso-convert: error: {exc}\n")
    except OSError as exc:  # a missing, unreadable or unwritable path
        parser.exit(1, f"yoso-convert: error: {exc}\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
