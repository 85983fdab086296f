"""The four commands end to end on tiny real models: run directories, metrics, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from yoso_serve.model import load_pretrained, save_pretrained
from yoso_serve.model.train.cli import main
from yoso_serve.model.train.data import split_train_val
from yoso_serve.model.train.distill import add_conv, layer_loss, teacher_targets
from yoso_serve.model.train.mlm import mask_tokens
from yoso_serve.model.train.runtime import autocast_dtype, read_events as events
from yoso_serve.model.train.trainer import TrainOptions, _adamw
from yoso_serve.model.train.teacher import BertTeacher

CPU = ["--device", "cpu", "--seed", "0"]


@pytest.fixture
def mixed_texts(tmp_path, sentences, write_jsonl) -> Path:
    """Short sentences plus a few texts longer than the tiny teacher's 64 positions."""
    rows = [{"text": t} for t in sentences(24, seed=2)]
    rows += [{"text": t} for t in sentences(4, seed=3, lo=80, hi=100)]
    rows.append("{broken")
    return write_jsonl(tmp_path / "texts.jsonl", rows)


def test_finetune_learns_a_separable_task_and_best_dir_serves(tiny_yoso, topic_data, tmp_path):
    out = tmp_path / "ft"
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(out),
                 "--epochs", "4", "--batch-size", "8", "--lr", "3e-3", "--val-fraction", "0.25", *CPU]) == 0
    epochs = events(out, "epoch")
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]
    assert all({"val_accuracy", "val_f1", "val_loss"} <= set(e) for e in epochs)
    best = max(epochs, key=lambda e: e["val_f1"])
    assert best["val_accuracy"] >= 0.9
    config = json.loads((out / "config.json").read_text())
    assert config["command"] == "finetune" and config["world_size"] == 1
    # best/ is a servable HF directory whose own predictions reproduce the logged validation score
    model = load_pretrained(out / "best")
    assert model.id2label == {0: "code", 1: "greek"} and model.config.problem_type == "single_label_classification"
    rows = [json.loads(line) for line in topic_data.read_text().splitlines()]
    _, val = split_train_val(len(rows), 0.25, seed=0)
    ids = model.tokenizer.encode([rows[i]["text"] for i in val], max_length=512)
    correct = 0
    for i, seq in zip(val, ids):
        logits = model.classify(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        correct += model.id2label[int(logits.argmax())] == rows[i]["label"]
    assert correct / len(val) == pytest.approx(best["val_accuracy"])
    assert json.loads((out / "results.json").read_text())["best"]["epoch"] == best["epoch"]


def test_finetune_scores_at_eval_hashes(tiny_yoso, topic_data, tmp_path):
    """Training in exact mode, scoring at a served hash count: the logged validation loss is the
    saved model's loss at that count, not at the training count."""
    out = tmp_path / "ft8"
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(out),
                 "--epochs", "1", "--batch-size", "8", "--lr", "3e-3", "--val-fraction", "0.25",
                 "--hashes", "0", "--eval-hashes", "8", *CPU]) == 0
    logged = events(out, "epoch")[0]["val_loss"]
    model = load_pretrained(out / "best")
    rows = [json.loads(line) for line in topic_data.read_text().splitlines()]
    _, val = split_train_val(len(rows), 0.25, seed=0)
    label2id = {v: k for k, v in model.id2label.items()}
    targets = torch.tensor([label2id[rows[i]["label"]] for i in val])
    seqs = model.tokenizer.encode([rows[i]["text"] for i in val], max_length=512)

    def loss(hashes: int) -> float:
        logits = torch.cat([model.classify(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long),
                                           hashes=hashes) for seq in seqs])
        return F.cross_entropy(logits.float(), targets).item()

    assert logged == pytest.approx(loss(8), rel=1e-4)
    assert abs(loss(0) - loss(8)) > 1e-3  # the two counts are told apart


def test_finetune_multi_label(tiny_yoso, tmp_path, sentences, write_jsonl):
    rows = [{"text": t, "labels": (["x", "y"] if i % 3 == 0 else ["x"])} for i, t in enumerate(sentences(24))]
    data = write_jsonl(tmp_path / "ml.jsonl", rows)
    out = tmp_path / "ml"
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(data), "--out", str(out),
                 "--epochs", "1", "--batch-size", "8", *CPU]) == 0
    model = load_pretrained(out / "model")
    assert model.config.problem_type == "multi_label_classification"
    assert sorted(model.id2label.values()) == ["x", "y"]


def test_distill_improves_agreement_and_uses_teacher_windows(tiny_bert, tiny_yoso, mixed_texts, tmp_path, sentences):
    # a converted tiny random model already sits close to its teacher; noise gives distillation work to do
    student = load_pretrained(tiny_yoso)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in student.named_parameters():
            if name.endswith("weight") and p.ndim == 2 and "embeddings" not in name:
                p.add_(0.1 * torch.randn_like(p))
    save_pretrained(student, tmp_path / "noisy")
    out = tmp_path / "distill"
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tmp_path / "noisy"),
                 "--out", str(out), "--max-length", "128", "--train-hashes", "0,8", "--epochs", "2",
                 "--batch-size", "4", "--lr", "2e-3", "--warmup", "0", "--log-every", "1", *CPU]) == 0
    report = json.loads((out / "data_report.json").read_text())["train"]
    assert report["kept"] == 28 and report["reasons"] == {"invalid JSON": 1}
    teacher = BertTeacher.from_dir(tiny_bert)
    texts = sentences(16, seed=9)

    def hidden_mse(model_dir: Path) -> float:
        model = load_pretrained(model_dir)
        errors = []
        for seq in model.tokenizer.encode(texts):
            x = torch.tensor([seq])
            errors.append(F.mse_loss(model.last_hidden(x, hashes=0), teacher(x)).item())
        return sum(errors) / len(errors)

    # unseen texts: the student moved towards the teacher, not just onto its training rows
    assert hidden_mse(out / "model") < 0.7 * hidden_mse(tmp_path / "noisy")
    train = events(out, "train")
    assert {"cos_loss", "pooled_mse", "hidden_mse", "tokens_per_s", "lr"} <= set(train[0])
    assert events(out, "stop")[0]["reason"] == "done"
    saved = load_pretrained(out / "model")
    assert saved.config.num_hash == 32 and not saved.config.use_expectation


def test_distill_hash_family_is_written_to_the_student(tiny_bert, tiny_yoso, mixed_texts, tmp_path):
    assert load_pretrained(tiny_yoso).config.use_fast_hash
    out = tmp_path / "gauss"
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
                 "--out", str(out), "--max-length", "64", "--train-hashes", "8", "--max-steps", "1",
                 "--batch-size", "4", "--hash-family", "gaussian", *CPU]) == 0
    assert not load_pretrained(out / "model").config.use_fast_hash


def test_fixed_hash_seed_trains_with_the_served_projections_only(tiny_bert, tiny_yoso, mixed_texts, tmp_path,
                                                                 monkeypatch):
    """--fixed-hash-seed: LSH steps hash with the config's per-layer seeds (what serving uses); by
    default every step draws fresh ones. Either way the saved student keeps the config's seed."""
    import yoso_serve.model.attention.yoso as core_module
    from yoso_serve.model.encoder import layer_seed

    config = load_pretrained(tiny_yoso).config
    served = {layer_seed(config.hash_seed, i) for i in range(config.num_hidden_layers)}
    op, seen = core_module.yoso_attention, []

    def spy(*args, **kwargs):
        if kwargs["num_hashes"]:
            seen.append(kwargs["seed"])
        return op(*args, **kwargs)

    monkeypatch.setattr(core_module, "yoso_attention", spy)
    for flag, name in ((["--fixed-hash-seed"], "fixed"), ([], "fresh")):
        seen.clear()
        assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student",
                     str(tiny_yoso), "--out", str(tmp_path / name), "--max-length", "64", "--train-hashes", "8",
                     "--max-steps", "3", "--batch-size", "4", *flag, *CPU]) == 0
        assert len(seen) >= 3 * config.num_hidden_layers
        if flag:
            assert set(seen) == served
        else:
            assert not set(seen) & served and len(set(seen)) >= 3 * config.num_hidden_layers
        assert load_pretrained(tmp_path / name / "model").config.hash_seed == config.hash_seed


def test_conv_window_adds_a_yoso_c_conv_that_starts_at_zero_and_trains(tiny_bert, tiny_yoso, mixed_texts, tmp_path):
    model = load_pretrained(tiny_yoso)
    ids = torch.tensor([model.tokenizer.encode(["a short text about modules"])[0]])
    before = model.last_hidden(ids, hashes=0)
    add_conv(model, 3)
    assert model.config.conv_window == 3
    torch.testing.assert_close(model.last_hidden(ids, hashes=0), before, atol=0, rtol=0)
    add_conv(model, 3)  # same width: nothing to do
    with pytest.raises(ValueError, match="already has conv_window 3"):
        add_conv(model, 5)

    out = tmp_path / "conv"
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
                 "--out", str(out), "--max-length", "64", "--train-hashes", "0", "--max-steps", "3",
                 "--batch-size", "4", "--lr", "1e-2", "--warmup", "0", "--conv-window", "3", *CPU]) == 0
    saved = load_pretrained(out / "model")  # strict load: the conv weights are in the checkpoint
    assert saved.config.conv_window == 3
    convs = [m.conv.weight for m in saved.modules() if getattr(m, "conv", None) is not None]
    assert len(convs) == saved.config.num_hidden_layers and all(w.abs().sum() > 0 for w in convs)


def test_lr_scales_give_matched_parameters_their_own_learning_rate(tiny_yoso):
    model = load_pretrained(tiny_yoso)
    add_conv(model, 3)
    opt = _adamw(model, TrainOptions(lr=1e-3, weight_decay=0.1, lr_scales=(("attention.self.conv.weight", 40.0),)))
    convs = {id(m.conv.weight) for m in model.modules() if getattr(m, "conv", None) is not None}
    (decay, plain, scaled) = opt.param_groups
    assert (decay["lr"], decay["weight_decay"], plain["lr"], plain["weight_decay"]) == (1e-3, 0.1, 1e-3, 0.0)
    assert scaled["lr"] == pytest.approx(0.04) and scaled["weight_decay"] == 0.1
    assert {id(p) for p in scaled["params"]} == convs and not convs & {id(p) for p in decay["params"]}
    assert len(_adamw(model, TrainOptions()).param_groups) == 2  # no scales: BERT's two groups


def test_conv_lr_scale_must_be_positive(tiny_bert, tiny_yoso, mixed_texts, tmp_path, capsys):
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
                 "--out", str(tmp_path / "x"), "--conv-window", "3", "--conv-lr-scale", "0", *CPU]) == 2
    assert "--conv-lr-scale must be > 0" in capsys.readouterr().err
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
                 "--out", str(tmp_path / "y"), "--conv-window", "4", *CPU]) == 2
    assert "conv_window must be an odd positive int" in capsys.readouterr().err


def test_teacher_layer_targets_are_each_layers_output_on_single_window_rows(tiny_bert, tiny_yoso, mixed_texts):
    teacher = BertTeacher.from_dir(tiny_bert)
    tok = load_pretrained(tiny_yoso).tokenizer
    texts = [json.loads(line)["text"] for line in mixed_texts.read_text().splitlines()[:-1]]
    short, long = texts[0], texts[-1]
    rows = tok.encode([short, long])
    assert len(rows[0]) <= teacher.max_positions < len(rows[1])
    n = max(map(len, rows))
    ids = torch.tensor([r + [0] * (n - len(r)) for r in rows])
    mask = (torch.arange(n)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    cls_id, sep_id = tok.wrap([])
    got = teacher_targets(teacher, ids, mask, cls_id=cls_id, sep_id=sep_id, window=0, stride=0, layers=True)
    layers = teacher.config["num_hidden_layers"]
    assert got["t_layers"].shape == (layers - 1, *ids.shape, teacher.config["hidden_size"])
    assert got["t_single"].tolist() == [True, False]
    assert not got["t_layers"][:, 1].any()
    m = len(rows[0])
    full = list(teacher.encoder.layer)
    for j in range(layers - 1):  # oracle: the teacher cut after layer j
        teacher.encoder.layer = torch.nn.ModuleList(full[:j + 1])
        torch.testing.assert_close(got["t_layers"][j, :1, :m], teacher(ids[:1, :m]), atol=1e-5, rtol=1e-5)
    teacher.encoder.layer = torch.nn.ModuleList(full)
    assert not teacher.encoder.layer[0]._forward_hooks  # the taps are removed again


def test_layer_loss_averages_layers_over_the_chosen_rows():
    s = [torch.zeros(2, 3, 4), torch.ones(2, 3, 4)]
    t = [torch.ones(2, 3, 4), torch.ones(2, 3, 4)]
    t[1][1] = 5.0  # row 1 differs a lot, but is not a chosen row
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert layer_loss(s, t, mask, torch.tensor([True, False])).item() == pytest.approx(0.5)
    assert layer_loss(s, t, mask, torch.tensor([False, False])).item() == 0.0
    with pytest.raises(ValueError, match="taps 1 layers"):
        layer_loss(s[:1], t, mask, torch.tensor([True, True]))


def test_distill_with_layer_targets_lowers_the_layer_error(tiny_bert, tiny_yoso, mixed_texts, tmp_path):
    out = tmp_path / "layers"
    assert main(["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
                 "--out", str(out), "--max-length", "128", "--train-hashes", "0", "--epochs", "3",
                 "--batch-size", "4", "--lr", "2e-3", "--warmup", "0", "--log-every", "1", "--w-layers", "1",
                 *CPU]) == 0
    errors = [e["layers_mse"] for e in events(out, "train")]
    assert len(errors) >= 12 and sum(errors[-4:]) < 0.8 * sum(errors[:4])


def test_prepare_model_sets_the_training_only_knobs(tiny_yoso):
    from yoso_serve.model.train.cli import build_parser
    from yoso_serve.model.train.common import prepare_model

    model = load_pretrained(tiny_yoso)
    args = build_parser().parse_args(["distill", "--teacher", "t", "--data", "d", "--out", "o"])
    assert (args.exact_backward, args.dropout) == ("true", 0.0)  # distill's defaults
    prepare_model(args, model.yoso, model.config.num_hidden_layers)
    cores = [m for m in model.modules() if hasattr(m, "exact_backward")]
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert cores and all(m.exact_backward == "true" for m in cores)
    assert drops and all(m.p == 0.0 for m in drops)
    # finetune keeps the checkpoint's dropout unless told, and can ask for the paper's bound
    args = build_parser().parse_args(["finetune", "--model", "m", "--data", "d", "--out", "o",
                                      "--exact-backward", "bound"])
    assert args.dropout is None
    fresh = load_pretrained(tiny_yoso)
    prepare_model(args, fresh.yoso, fresh.config.num_hidden_layers)
    assert all(m.exact_backward == "bound" for m in fresh.modules() if hasattr(m, "exact_backward"))
    assert all(m.p == fresh.config.hidden_dropout_prob for m in fresh.modules() if isinstance(m, torch.nn.Dropout))


def test_resume_reproduces_an_uninterrupted_run(tiny_bert, tiny_yoso, mixed_texts, tmp_path):
    common = ["distill", "--teacher", str(tiny_bert), "--data", str(mixed_texts), "--student", str(tiny_yoso),
              "--max-length", "96", "--train-hashes", "0,8", "--batch-size", "4", "--grad-accum", "2",
              "--schedule", "constant", "--warmup", "0", "--lr", "1e-3", "--save-every", "100", *CPU]
    assert main([*common, "--out", str(tmp_path / "a"), "--max-steps", "6"]) == 0
    assert main([*common, "--out", str(tmp_path / "b"), "--max-steps", "3"]) == 0  # stops mid-epoch
    assert main([*common, "--out", str(tmp_path / "b"), "--max-steps", "6", "--resume"]) == 0
    a = torch.load(tmp_path / "a" / "checkpoints" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoints" / "last.pt", weights_only=False)
    assert (a["step"], a["epoch"], a["batch_in_epoch"]) == (b["step"], b["epoch"], b["batch_in_epoch"]) == (6, 1, 4)
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=0, atol=0, msg=key)
    assert events(tmp_path / "b", "resume")[0]["step"] == 3


def test_mlm_continued_pretraining_lowers_validation_loss(tiny_yoso, tmp_path, sentences, write_jsonl):
    data = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(16, seed=4)])
    out = tmp_path / "mlm"
    assert main(["mlm", "--model", str(tiny_yoso), "--data", str(data), "--val-data", str(data), "--out", str(out),
                 "--epochs", "3", "--batch-size", "4", "--lr", "3e-3", "--mask-prob", "0.3", *CPU]) == 0
    val = [e["val_loss"] for e in events(out, "epoch")]
    assert len(val) == 3 and val[-1] < val[0]
    assert load_pretrained(out / "model").has_mlm_head


def test_mask_tokens_follows_bert_rule():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 1000, (64, 256), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    mask = torch.ones_like(ids)
    mask[:, 200:] = 0
    out, labels = mask_tokens(ids, mask, special_ids=[0, 2, 3, 4], mask_id=4, vocab_size=1000, prob=0.15, generator=g)
    chosen = labels != -100
    assert not chosen[:, 0].any() and not chosen[:, 200:].any()  # specials and padding never chosen
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(out[~chosen], ids[~chosen])
    rate = chosen[:, 1:200].float().mean().item()
    assert 0.13 < rate < 0.17
    masked = (out[chosen] == 4).float().mean().item()
    kept = (out[chosen] == ids[chosen]).float().mean().item()
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13


def test_eval_reports_agreement_long_documents_and_classification(tiny_bert, tiny_yoso, mixed_texts, topic_data,
                                                                  tmp_path, sentences, write_jsonl):
    ft = tmp_path / "ft"
    assert main(["finetune", "--model", str(tiny_yoso), "--data", str(topic_data), "--out", str(ft),
                 "--epochs", "1", "--batch-size", "8", *CPU]) == 0
    long_docs = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in sentences(2, seed=5, lo=150, hi=160)])
    out = tmp_path / "eval"
    assert main(["eval", "--model", str(ft / "model"), "--teacher", str(tiny_bert), "--data", str(mixed_texts),
                 "--long-data", str(long_docs), "--labelled", str(topic_data), "--hashes", "0,8",
                 "--long-hashes", "0", "--max-length", "64", "--out", str(out), *CPU]) == 0
    results = json.loads((out / "results.json").read_text())
    rows = {r["hashes"]: r for r in results["agreement"]}
    assert set(rows) == {0, 8} and rows[0]["texts"] == 28
    # the exact-mode number is the plain mean cosine, computed here independently
    model, teacher = load_pretrained(ft / "model"), BertTeacher.from_dir(tiny_bert)
    texts = [json.loads(line)["text"] for line in mixed_texts.read_text().splitlines()[:-1]]
    cos = [F.cosine_similarity(model.embed(x, hashes=0), teacher.embed(x, torch.ones_like(x))).item()
           for x in (torch.tensor([s]) for s in model.tokenizer.encode(texts, max_length=64))]
    assert rows[0]["mean_cos"] == pytest.approx(sum(cos) / len(cos), abs=1e-5)
    assert -1.0 <= rows[8]["spearman"] <= 1.0 and rows[8]["mean_cos"] != rows[0]["mean_cos"]
    long = results["long_agreement"][0]
    assert long["docs"] == 2 and long["mean_tokens"] > 64 and long["teacher_windowed_s_per_doc"] > 0
    assert results["classification"]["examples"] == 48
    assert len(events(out, "agreement")) == 2


def test_errors_are_one_line_and_exit_2(tiny_yoso, topic_data, tmp_path, capsys):
    base = ["finetune", "--model", str(tiny_yoso), "--epochs", "1", *CPU]
    assert main([*base, "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert "data file not found" in capsys.readouterr().err
    assert main([*base, "--data", str(topic_data), "--out", str(tmp_path / "y"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a CUDA device"):
        autocast_dtype("bf16", torch.device("cpu"))
    assert autocast_dtype("auto", torch.device("cpu")) is None


def test_every_command_parses_the_shared_options(capsys):
    from yoso_serve.model.train.cli import build_parser

    parser = build_parser()
    for command, required in (("finetune", ["--model", "m", "--data", "d"]), ("distill", ["--teacher", "t", "--data", "d"]),
                              ("mlm", ["--model", "m", "--data", "d"])):
        args = parser.parse_args([command, *required, "--out", "o", "--resume", "--grad-accum", "4",
                                  "--precision", "bf16", "--gradient-checkpointing", "--device", "cuda:1"])
        assert (args.resume, args.grad_accum, args.precision, args.gradient_checkpointing, args.device) == \
            (True, 4, "bf16", True, "cuda:1")
    assert parser.parse_args(["eval", "--model", "m", "--out", "o"]).hashes == "0,8,16,32,64"
    with pytest.raises(SystemExit):
        parser.parse_args(["mlm", "--data", "d", "--out", "o"])  # --model or --config is required
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parser.parse_args(["distill", "--help"])
    assert "--max-minutes" in capsys.readouterr().out
