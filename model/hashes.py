"""Every hash-count rule in one place: which counts a model, a deployment and a request may use, and
what ``"auto"`` runs for one input (after vLLM's ``PoolingParams.verify``).

A hash count is ``m > 0`` (m LSH samples, O(N·m)), ``0`` (YOSO-E, the exact expectation, O(N²)) or
``"auto"``: per input, exact when the input's own token count is below a crossover, the model's LSH
count at and above it. Only the input's own length decides, never the padded batch it lands in, so a
text gets the same vector in any batch composition. The crossover's default, :data:`AUTO_EXACT_BELOW`,
is measured by bench/crossover.py for the default model on the CPU (docs/benchmarks.md); it is the one
place to change when the kernels move it.

Who asks changes one rule and the wording (``source``):

* ``"call"``: Python code (the encoder's forward, the ONNX models, the export). For a model of another
  attention type, 0 is accepted: it is the "no hashing" value its ``default_hashes`` itself returns,
  and callers hand resolved defaults back in.
* ``"request"``: a client's JSON. Any count for a model of another attention type is refused, 0
  included: a client that names a count believes it changes something, and a 422 tells it otherwise.
* ``"setting"``: ``--hashes`` at start, refused like a request's, worded for the operator.
"""

from __future__ import annotations

from typing import Literal, Union

AUTO = "auto"
# The largest hash count anything here accepts by default: the server's --max-hashes default, and the bound of
# the training and conversion tools (more is never served, and a forward or an ONNX export of it takes hours).
MAX_HASHES = 256

# Inputs with fewer tokens (specials included) than this run exact YOSO-E under "auto". Measured by
# bench/crossover.py on the bundled default model, CPU (docs/benchmarks.md#exact-vs-lsh-crossover).
AUTO_EXACT_BELOW = 288

Hashes = Union[int, Literal["auto"]]
Source = Literal["call", "request", "setting"]


class HashesError(ValueError):
    """A hash count the model, its runtime or the deployment cannot run; the message names the limit."""


def resolve_hashes(config, hashes: Hashes | None = None, *, source: Source = "call",
                   default: Hashes | None = None, max_hashes: int | None = None, fixed: int | None = None,
                   exact_below: int = 0, n_tokens: int | None = None) -> Hashes:
    """The hash count a call, request or setting runs with; raises :class:`HashesError`.

    config: the model's EncoderConfig (None for a setting checked before the model is loaded).
    hashes: what was asked; None takes ``default`` (a deployment's), else ``fixed``, else the model's.
    fixed: the count an ONNX graph was exported with: the only one it runs, "auto" included.
    exact_below, n_tokens: "auto" resolves for an input of ``n_tokens`` tokens: 0 below
    ``exact_below``, the model's count otherwise; without ``n_tokens`` it stays "auto" (checked only).
    """
    asked = hashes is not None and hashes != AUTO
    if hashes is not None:
        _check_asked(config, hashes, source, max_hashes)
    else:
        hashes = default if default is not None else fixed
        if hashes is None:
            hashes = config.default_hashes
    if hashes == AUTO:
        if n_tokens is None or config is None:
            if source == "call":
                raise HashesError("hashes='auto' is decided per input by its own length, which a model call "
                                  "does not know; pass an int (0 = exact YOSO-E)")
            return AUTO
        served = fixed if fixed is not None else config.default_hashes
        hashes = 0 if fixed is None and n_tokens < exact_below else served
    if max_hashes is not None and hashes > max_hashes:
        raise HashesError(_over_max(hashes, max_hashes, source, asked))
    if fixed is not None and hashes != fixed:
        raise HashesError(_not_fixed(hashes, fixed, source))
    return hashes


def auto_crossover(exact_below: int, runtime: str) -> int:
    """The crossover "auto" uses on ``runtime``: the same on every runtime that can run exact (torch, and
    hybrid, which routes exact inputs to torch), so a text's resolved count never depends on who serves
    it. ``onnx`` runs only its exported count: the service refuses at start an ``auto`` whose crossover it
    would have to ignore (service/settings.py), so there the crossover is 0 whenever auto is served."""
    return 0 if runtime == "onnx" else exact_below


def hashes_header(counts: list[int], owners: list[int] | None = None) -> str:
    """What ``x-hashes`` says ran, from the count of each sequence run and the input each belongs to
    (``owners``, ascending; default one sequence per input): one number when every sequence ran the
    same count; otherwise one entry per input in input order, comma-separated, an entry listing its
    windows' distinct counts joined by ``+`` when a chunked input's windows differ (``0,32,32+0``)."""
    if len(set(counts)) == 1:
        return str(counts[0])
    per_input: dict[int, dict[int, None]] = {}
    for owner, count in zip(range(len(counts)) if owners is None else owners, counts):
        per_input.setdefault(owner, {})[count] = None
    return ",".join("+".join(map(str, windows)) for windows in per_input.values())


def _check_asked(config, hashes, source: Source, max_hashes: int | None) -> None:
    if hashes == AUTO:
        return  # every model takes auto: for another attention type it resolves to 0, "no hashing"
    if isinstance(hashes, bool) or not isinstance(hashes, int) or hashes < 0:
        if source == "request" and max_hashes is not None:
            raise HashesError(_over_max(hashes, max_hashes, source, True))
        flag = "--hashes" if source == "setting" else "hashes"
        raise HashesError(f"{flag} must be an int >= 0 (0 = exact YOSO-E) or 'auto', got {hashes!r}")
    kind = None if config is None else config.attention_type
    if kind is None or kind == "yoso" or (source == "call" and hashes == 0):
        return
    if source == "call":
        raise HashesError(f"hashes={hashes} only applies to attention_type=yoso; this model's attention_type "
                          f"is {kind!r} (pass hashes=None)")
    who = "--hashes" if source == "setting" else f"hashes={hashes}"
    raise HashesError(f"{who} only applies to attention_type=yoso; this model's attention_type is {kind!r}: "
                      f"leave it unset (or 'auto')")


def _over_max(hashes, max_hashes: int, source: Source, asked: bool) -> str:
    if not asked:  # the model's own count, reached through a default or auto
        return (f"the model's default hash count {hashes} is above --max-hashes {max_hashes}; raise "
                f"--max-hashes or set --hashes")
    if source == "setting":
        return (f"--hashes {hashes} is above --max-hashes {max_hashes}; lower --hashes or raise --max-hashes")
    return f"hashes must be in [0, {max_hashes}] (max_hashes) or 'auto', got {hashes!r}"


def _not_fixed(hashes: int, fixed: int, source: Source) -> str:
    if source == "setting":
        return (f"--hashes {hashes} but this ONNX model was exported with {fixed} hashes (the graph fixes "
                f"the count); drop --hashes or re-export with --hashes {hashes}")
    if source == "request":
        return (f"hashes must be {fixed}: this ONNX model was exported with {fixed} hashes "
                f"(exported_hashes), got {hashes}")
    return (f"hashes must be {fixed}, the count this ONNX model was exported with (the graph fixes it); "
            f"got {hashes}. Re-export with --hashes {hashes} to change it")
