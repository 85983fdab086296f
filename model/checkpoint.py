"""Hugging Face-format checkpoint directories in and out.

A directory holds ``config.json`` (transformers' YosoConfig fields plus ours),
``model.safetensors`` (or a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin``,
read with ``weights_only=True``) and the tokenizer files. State-dict keys are transformers'
(``yoso.embeddings.…``, ``yoso.encoder.layer.N.…``, ``classifier.…``, ``cls.predictions.…``),
so a directory we save loads in ``transformers.YosoModel`` / ``YosoForSequenceClassification``
/ ``YosoForMaskedLM`` and theirs load here. Every failure is a :class:`CheckpointError`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import EncoderConfig
from .encoder_model import EncoderModel
from .tokenizer import TOKENIZER_FILES, TextTokenizer

WEIGHTS_SAFETENSORS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_BIN = "pytorch_model.bin"
BERT_FAMILY = ("bert", "roberta", "xlm-roberta", "camembert")

# Keys transformers writes (or wrote) that carry nothing we need: non-persistent buffers of old
# versions, and the tied decoder (it is the word-embedding matrix; its bias is cls.predictions.bias).
_IGNORED_KEYS = (
    "yoso.embeddings.position_ids",
    "yoso.embeddings.token_type_ids",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read: missing file, unsupported config, bad weights."""


def check_out_dir(src: str | Path, out: str | Path) -> None:
    """Refuse an output directory that overlaps the source or is a file, before anything is written:
    writing into the source would overwrite the checkpoint being read."""
    src, out = Path(src).resolve(), Path(out).resolve()
    if out == src or src in out.parents or out in src.parents:
        raise ValueError(f"--out {out} overlaps the input directory {src}; choose a separate directory")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is an existing file, not a directory")


def _read_config(path: Path) -> EncoderConfig:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {config_file}: {exc}") from exc
    model_type = raw.get("model_type")
    if model_type in BERT_FAMILY:
        raise CheckpointError(
            f"{config_file} is a {model_type!r} checkpoint, not YOSO; convert it first: "
            f"yoso-convert --from {path} --out DIR"
        )
    if model_type != "yoso":
        raise CheckpointError(f"unsupported model_type {model_type!r} in {config_file}; expected 'yoso'")
    try:
        return EncoderConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"invalid {config_file}: {exc}") from exc


def weight_files(path: str | Path) -> list[Path]:
    """The files a checkpoint directory's weights are read from, in the one order of precedence every reader
    uses (the loader, the export cache, the recipe's comparisons): ``model.safetensors``, else the sharded
    index and its shards, else ``pytorch_model.bin``. Raises CheckpointError when there are none."""
    path = Path(path)
    if (path / WEIGHTS_SAFETENSORS).is_file():
        return [path / WEIGHTS_SAFETENSORS]
    if (path / WEIGHTS_INDEX).is_file():
        try:
            index = json.loads((path / WEIGHTS_INDEX).read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except Exception as exc:  # JSON, a missing key or a wrong type all raise their own
            raise CheckpointError(f"cannot read the weights in {path}: {type(exc).__name__}: {exc}") from exc
        return [path / WEIGHTS_INDEX] + [path / shard for shard in shards]
    if (path / WEIGHTS_BIN).is_file():
        return [path / WEIGHTS_BIN]
    raise CheckpointError(f"no weights in {path}: expected {WEIGHTS_SAFETENSORS}, {WEIGHTS_INDEX} or {WEIGHTS_BIN}")


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, keys as stored, from :func:`weight_files`."""
    files = weight_files(path)
    try:
        if files[0].name == WEIGHTS_BIN:
            return torch.load(files[0], map_location="cpu", weights_only=True)
        state: dict[str, torch.Tensor] = {}
        for file in files:
            if file.name != WEIGHTS_INDEX:
                state.update(load_file(str(file)))
        return state
    except Exception as exc:  # safetensors, pickle and JSON all raise their own types
        raise CheckpointError(f"cannot read the weights in {path}: {type(exc).__name__}: {exc}") from exc


def normalize_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map stored keys to ours: bare ``embeddings.``/``encoder.`` get the ``yoso.`` prefix; legacy keys go."""
    out = {}
    for key, tensor in state.items():
        if key.startswith(("embeddings.", "encoder.")):
            key = "yoso." + key
        out[key] = tensor
    if "cls.predictions.bias" not in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    return {k: v for k, v in out.items() if k not in _IGNORED_KEYS}


def _with_labels(config: EncoderConfig, state: dict[str, torch.Tensor]) -> EncoderConfig:
    """Give a classifier checkpoint without id2label the default LABEL_i names."""
    out_proj = state.get("classifier.out_proj.weight")
    if out_proj is not None and config.id2label is None:
        config.id2label = {i: f"LABEL_{i}" for i in range(out_proj.shape[0])}
        config.label2id = {v: k for k, v in config.id2label.items()}
    return config


def copy_weights(model: EncoderModel, state: dict[str, torch.Tensor], path: Path) -> None:
    """Copy ``state`` into ``model`` after checking that the key sets and every shape match."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        raise CheckpointError(f"{path}: missing weights {missing[:8]}{' …' if len(missing) > 8 else ''}")
    if unexpected:
        raise CheckpointError(
            f"{path}: weights this model has no place for {unexpected[:8]}{' …' if len(unexpected) > 8 else ''}"
        )
    for key, target in expected.items():
        if tuple(state[key].shape) != tuple(target.shape):
            raise CheckpointError(
                f"{path}: shape mismatch for {key}: checkpoint {tuple(state[key].shape)}, "
                f"model {tuple(target.shape)}"
            )
    with torch.no_grad():
        for key, target in expected.items():
            target.copy_(state[key])


def load_pretrained(path: str | Path, *, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> EncoderModel:
    """Load a YOSO checkpoint directory → :class:`EncoderModel` in eval mode on ``device``/``dtype``.

    Heads are built when their weights are present (``classifier.*``, ``cls.predictions.*``);
    the tokenizer is loaded when tokenizer files are present, else ``model.tokenizer`` is None.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = _read_config(path)
    state = normalize_keys(read_state_dict(path))
    config = _with_labels(config, state)
    tokenizer = None
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        try:
            tokenizer = TextTokenizer.from_dir(path)
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"cannot load the tokenizer in {path}: {exc}") from exc
    model = EncoderModel(
        config,
        with_classifier="classifier.dense.weight" in state,
        with_mlm="cls.predictions.transform.dense.weight" in state,
        tokenizer=tokenizer,
    )
    copy_weights(model, state, path)
    return model.to(device=device, dtype=dtype).eval()


def save_pretrained(model: EncoderModel, path: str | Path, *, dtype: torch.dtype | None = None,
                    safe_serialization: bool = True) -> Path:
    """Write ``model`` as an HF-format directory; ``dtype`` (e.g. torch.float16) casts stored floats."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[key] = tensor.contiguous()
    if safe_serialization:
        save_file(state, str(path / WEIGHTS_SAFETENSORS), metadata={"format": "pt"})
    else:
        torch.save(state, path / WEIGHTS_BIN)
    model.config.to_json_file(path / "config.json", architectures=model.architectures)
    if model.tokenizer is not None:
        model.tokenizer.save(path)
    return path
