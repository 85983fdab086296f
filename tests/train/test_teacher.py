"""The softmax teacher: parity with transformers' BertModel, windows for long documents, Python docs text."""

from __future__ import annotations

import pytest
import torch

from yoso_serve.model.train.teacher import BertTeacher, pool


def test_teacher_matches_transformers_bert_with_padding(tiny_bert):
    from transformers import BertModel

    teacher = BertTeacher.from_dir(tiny_bert)
    reference = BertModel.from_pretrained(tiny_bert).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 40, (3, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        ours = teacher(ids, mask)
        theirs = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=2e-5, rtol=1e-5)
    # a padded row equals the same text alone
    alone = teacher(ids[1:2, :9])
    torch.testing.assert_close(ours[1, :9], alone[0], atol=2e-5, rtol=1e-5)
    assert teacher.pooling == "mean"


def test_teacher_is_frozen_and_rejects_overlong_input(tiny_bert):
    teacher = BertTeacher.from_dir(tiny_bert)
    assert not any(p.requires_grad for p in teacher.parameters())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        teacher(torch.ones(1, 65, dtype=torch.long))


def test_windowed_hidden_equals_one_forward_when_it_fits(tiny_bert):
    teacher = BertTeacher.from_dir(tiny_bert)
    ids = [2, *range(5, 45), 3]
    torch.testing.assert_close(teacher.windowed_hidden(ids, cls_id=2, sep_id=3), teacher(torch.tensor([ids]))[0])


def test_windowed_hidden_takes_each_token_from_its_most_central_window(tiny_bert):
    teacher = BertTeacher.from_dir(tiny_bert)
    g = torch.Generator().manual_seed(1)
    content = torch.randint(5, 40, (150,), generator=g).tolist()
    ids = [2, *content, 3]
    window, size = 24, 22  # 22 content tokens per window
    out = teacher.windowed_hidden(ids, cls_id=2, sep_id=3, window=window, stride=11)
    assert out.shape == (152, 32)
    starts = [0, 11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121, 128]

    def run(s):
        return teacher(torch.tensor([[2, *content[s:s + size], 3]]))[0]

    # content position 30 sits in windows 11 (offset 19), 22 (offset 8); the latter is central
    torch.testing.assert_close(out[31], run(22)[9])
    # position 5 is only in window 0, whose left edge is the document's start
    torch.testing.assert_close(out[6], run(0)[6])
    # the last content token comes from the final window (aligned to the end), SEP too
    torch.testing.assert_close(out[150], run(128)[22])
    torch.testing.assert_close(out[151], run(128)[23])
    torch.testing.assert_close(out[0], run(0)[0])
    assert starts[-1] == 150 - size


def test_pool_mean_ignores_padding_and_cls_takes_first():
    h = torch.tensor([[[1.0, 1.0], [3.0, 5.0], [100.0, 100.0]]])
    m = torch.tensor([[1, 1, 0]])
    assert pool(h, m, "mean").tolist() == [[2.0, 3.0]]
    assert pool(h, m, "cls").tolist() == [[1.0, 1.0]]


