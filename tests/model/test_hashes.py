"""model/hashes.py, the one home of the hash-count rules: each rule by who asks, and "auto" by length."""

from __future__ import annotations

import pytest

from yoso_serve.model.config import EncoderConfig
from yoso_serve.model.hashes import AUTO, HashesError, auto_crossover, hashes_header, resolve_hashes

LSH = EncoderConfig(use_expectation=False, num_hash=32)
EXACT = EncoderConfig(use_expectation=True, num_hash=32)
SOFTMAX = EncoderConfig(attention_type="softmax", use_expectation=False, num_hash=8)


def test_none_takes_the_deployment_default_then_the_onnx_count_then_the_model_count():
    assert resolve_hashes(LSH, None) == 32 and resolve_hashes(EXACT, None) == 0
    assert resolve_hashes(LSH, None, fixed=16) == 16
    assert resolve_hashes(LSH, None, default=4) == 4
    assert resolve_hashes(SOFTMAX, None) == 0


@pytest.mark.parametrize("source", ["call", "request", "setting"])
@pytest.mark.parametrize("bad", [-1, True, False, 2.0, "fast"])
def test_only_ints_from_zero_or_auto_are_counts(source, bad):
    with pytest.raises(HashesError, match=r"hashes must be an int >= 0 \(0 = exact YOSO-E\) or 'auto'"):
        resolve_hashes(LSH, bad, source=source)


def test_a_request_out_of_range_names_max_hashes():
    for bad in (17, -1, True):
        with pytest.raises(HashesError, match=r"hashes must be in \[0, 16\] \(max_hashes\)"):
            resolve_hashes(LSH, bad, source="request", max_hashes=16)
    with pytest.raises(HashesError, match="--hashes 300 is above --max-hashes 256; lower --hashes"):
        resolve_hashes(None, 300, source="setting", max_hashes=256)
    with pytest.raises(HashesError, match="the model's default hash count 32 is above --max-hashes 16"):
        resolve_hashes(LSH, AUTO, source="setting", max_hashes=16, n_tokens=4096)
    assert resolve_hashes(LSH, 16, source="request", max_hashes=16) == 16


def test_another_attention_type_takes_zero_from_code_and_no_count_from_people():
    # The encoder's own resolved default is 0 ("no hashing"), handed back in by callers: accepted.
    assert resolve_hashes(SOFTMAX, 0) == 0
    with pytest.raises(HashesError, match=r"hashes=8 only applies to attention_type=yoso.*'softmax'"):
        resolve_hashes(SOFTMAX, 8)
    # A client or an operator who names a count expects it to do something: refused, 0 included.
    for count in (0, 8):
        with pytest.raises(HashesError, match=rf"hashes={count} only applies to attention_type=yoso.*'softmax'"):
            resolve_hashes(SOFTMAX, count, source="request")
        with pytest.raises(HashesError, match="--hashes only applies to attention_type=yoso"):
            resolve_hashes(SOFTMAX, count, source="setting")
    # auto is the server's choice, open to every model: no hashing at any length.
    assert resolve_hashes(SOFTMAX, AUTO, source="request", exact_below=256, n_tokens=1000) == 0


def test_auto_is_exact_below_the_crossover_and_the_model_count_from_it():
    rule = dict(source="request", exact_below=256)
    assert resolve_hashes(LSH, AUTO, **rule) == AUTO  # no length: checked, not resolved
    assert [resolve_hashes(LSH, AUTO, **rule, n_tokens=n) for n in (1, 255, 256, 4096)] == [0, 0, 32, 32]
    # a model whose default is exact stays exact at every length
    assert {resolve_hashes(EXACT, AUTO, **rule, n_tokens=n) for n in (10, 4096)} == {0}
    # the server's default is auto: an absent count resolves the same way
    assert resolve_hashes(LSH, None, source="request", default=AUTO, exact_below=256, n_tokens=12) == 0
    # an explicit count is honoured whatever the length
    assert resolve_hashes(LSH, 8, **rule, n_tokens=12) == 8 and resolve_hashes(LSH, 0, **rule, n_tokens=4000) == 0


def test_auto_on_an_onnx_graph_is_its_exported_count():
    assert resolve_hashes(LSH, AUTO, source="request", fixed=16, exact_below=256, n_tokens=3) == 16
    with pytest.raises(HashesError, match=r"hashes must be 16: this ONNX model was exported with 16 hashes"):
        resolve_hashes(LSH, 8, source="request", fixed=16)
    with pytest.raises(HashesError, match="hashes must be 16, the count this ONNX model was exported with"):
        resolve_hashes(LSH, 8, fixed=16)
    with pytest.raises(HashesError, match="--hashes 8 but this ONNX model was exported with 16 hashes"):
        resolve_hashes(None, 8, source="setting", fixed=16)


def test_a_model_call_needs_a_count_not_auto():
    with pytest.raises(HashesError, match="decided per input by its own length"):
        resolve_hashes(LSH, AUTO)


def test_the_crossover_is_the_same_on_every_runtime_that_runs_exact():
    # hybrid runs exact inputs on torch, so auto resolves as on torch; onnx cannot run exact (the settings
    # refuse an auto with a crossover there, service/runtimes.py)
    assert auto_crossover(256, "torch") == 256 and auto_crossover(256, "hybrid") == 256
    assert auto_crossover(256, "onnx") == 0


def test_the_header_says_what_ran_per_input_when_they_differ():
    assert hashes_header([32, 32, 32]) == "32"
    assert hashes_header([0, 32, 0]) == "0,32,0"
    # input 0 in one window, input 1 chunked into three windows whose last is short, input 2 short
    assert hashes_header([32, 32, 32, 0, 0], owners=[0, 1, 1, 1, 2]) == "32,32+0,0"
    assert hashes_header([0, 0], owners=[0, 0]) == "0"
