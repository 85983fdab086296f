"""The output folder: Parquet parts that appear only when complete, the manifest, and what a rerun resumes.

Layout of ``DIR``::

    manifest.json         model digest, settings, counts, bad rows (written atomically, at the start
                          and at the end of every run)
    parts/part-*.parquet  one row per document; a part is written under a hidden temporary name and
                          renamed when complete, so a kill never leaves a partial part visible
    _staging/             the Ray engine's checked input of the current run (deleted when it ends)
    .run, .lock           the token of the run that owns the folder, and the lock that fences it

A part's name is a digest of the ids it holds, in order: the same batch written twice (a Ray task
retried after its worker died) lands on the same name, never beside it. A rerun reads the ``id``
column of every part and embeds only the ids not there yet. A folder written with another model or
other settings is refused (the message names what differs) unless ``--overwrite``.

Every run claims the folder with a new token (under an exclusive lock) before it reads what is written,
and a part is renamed into place only under a shared lock while the token is still its run's. A worker
that outlives its run (its driver killed, Ray still finishing a task) therefore cannot add a part after a
rerun has counted the parts: its rename is refused and the rerun embeds those documents once, itself.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .sources import CorpusError, id_key

MANIFEST = "manifest.json"
PARTS = "parts"
STAGING = "_staging"
RUN = ".run"
LOCK = ".lock"
FORMAT = 1


def part_schema(dimension: int, pieces: bool):
    """The columns of a part: id, vector (float32 × dimension), tokens run, the hash counts that ran
    (``x-hashes``' form: ``32``, or ``32+0`` when a chunked document's windows ran different counts);
    with pieces, each piece's vector and its token and character ranges ``[start, stop)``, and whether
    the text ran past the model's length (the one pass reads its first tokens only, as /embed_pieces)."""
    import pyarrow as pa

    fields = [pa.field("id", pa.string(), nullable=False),
              pa.field("vector", pa.list_(pa.float32(), dimension), nullable=False),
              pa.field("tokens", pa.int32(), nullable=False),
              pa.field("hashes", pa.string(), nullable=False)]
    if pieces:
        fields += [pa.field("piece_vectors", pa.list_(pa.list_(pa.float32(), dimension)), nullable=False),
                   pa.field("piece_tokens", pa.list_(pa.list_(pa.int32(), 2)), nullable=False),
                   pa.field("piece_chars", pa.list_(pa.list_(pa.int32(), 2)), nullable=False),
                   pa.field("truncated", pa.bool_(), nullable=False)]
    return pa.schema(fields)


def rows_table(rows: list[dict], pieces: bool):
    """A pyarrow Table of ``rows`` (dicts from work.py) in :func:`part_schema`'s layout."""
    import pyarrow as pa

    dimension = len(rows[0]["vector"])
    schema = part_schema(dimension, pieces)
    vectors = np.stack([r["vector"] for r in rows]).astype(np.float32, copy=False)
    columns = {"id": pa.array([r["id"] for r in rows], pa.string()),
               "vector": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dimension),
               "tokens": pa.array([r["tokens"] for r in rows], pa.int32()),
               "hashes": pa.array([r["hashes"] for r in rows], pa.string())}
    if pieces:
        columns["piece_vectors"] = pa.array([r["piece_vectors"] for r in rows], schema.field("piece_vectors").type)
        columns["piece_tokens"] = pa.array([r["piece_tokens"] for r in rows], schema.field("piece_tokens").type)
        columns["piece_chars"] = pa.array([r["piece_chars"] for r in rows], schema.field("piece_chars").type)
        columns["truncated"] = pa.array([r["truncated"] for r in rows], pa.bool_())
    return pa.Table.from_pydict(columns, schema=schema)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic(final: Path, write, commit=None) -> None:
    """``write(tmp)`` to a hidden temporary name beside ``final``, flushed to disk, then renamed; ``commit``,
    if given, is a context manager the rename runs inside (it may raise to refuse it)."""
    tmp = final.with_name(f".{final.name}.tmp-{uuid.uuid4().hex}")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if commit is None:
            os.replace(tmp, final)
        else:
            with commit():
                os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(final.parent)


class OutputStore:
    """One output folder (``DIR``)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.parts = self.path / PARTS
        self.manifest_path = self.path / MANIFEST
        self.staging = self.path / STAGING
        self.token: str | None = None  # this run's, once prepare() claimed the folder

    @contextmanager
    def _locked(self, exclusive: bool):
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _claim(self) -> str:
        """Make this run the folder's owner: from now on only its parts are renamed into place."""
        token = uuid.uuid4().hex
        with self._locked(exclusive=True):
            _atomic(self.path / RUN, lambda tmp: tmp.write_text(token, encoding="utf-8"))
        return token

    @contextmanager
    def _owned(self, token: str):
        with self._locked(exclusive=False):
            try:
                current = (self.path / RUN).read_text(encoding="utf-8")
            except OSError:
                current = None
            if current != token:
                raise CorpusError(f"another run of yoso-embed took over {self.path}; this one stops writing")
            yield

    # --- a run's start ---------------------------------------------------------------------
    def prepare(self, settings: dict, overwrite: bool) -> dict | None:
        """Make the folder ready for a run with ``settings``: refuse (CorpusError) a non-empty folder written
        with other settings, or one yoso-embed did not write, unless ``overwrite`` (which deletes what an
        earlier run wrote); drop temporary files a kill left. Returns the earlier manifest (None if fresh)."""
        if self.path.exists() and not self.path.is_dir():
            raise CorpusError(f"--out {self.path} is a file; give a folder")
        earlier = self.read_manifest()
        if overwrite:
            earlier = None
        elif earlier is not None:
            differ = [k for k in sorted(set(settings) | set(earlier.get("settings", {})))
                      if settings.get(k) != earlier.get("settings", {}).get(k)]
            if differ:
                said = "; ".join(f"{k}: {earlier.get('settings', {}).get(k)!r} there, {settings.get(k)!r} now"
                                 for k in differ)
                raise CorpusError(f"--out {self.path} holds vectors made with other settings ({said}); rerun "
                                  "with the same model and settings to finish it, choose another --out, or pass "
                                  "--overwrite to replace it")
        elif self.path.is_dir() and any(p.name not in (RUN, LOCK, STAGING, PARTS) for p in self.path.iterdir()) \
                or self.part_files():
            raise CorpusError(f"--out {self.path} is not empty and has no {MANIFEST} (yoso-embed did not write "
                              "it); choose an empty or new folder, or pass --overwrite to write into it anyway")
        self.parts.mkdir(parents=True, exist_ok=True)
        self.token = self._claim()
        if overwrite:
            self.clear()
            self.parts.mkdir()
        for stale in self.parts.glob(".*.tmp-*"):
            stale.unlink(missing_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        return earlier

    def clear(self) -> None:
        """Delete what yoso-embed writes here (parts, manifest, staging); other files stay."""
        shutil.rmtree(self.parts, ignore_errors=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.manifest_path.unlink(missing_ok=True)

    def read_manifest(self) -> dict | None:
        if not self.manifest_path.is_file():
            return None
        try:
            manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CorpusError(f"--out {self.path}: {MANIFEST} cannot be read ({exc}); pass --overwrite to start "
                              "again") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorpusError(f"--out {self.path}: {MANIFEST} is not a yoso-embed manifest of format {FORMAT}; "
                              "pass --overwrite to start again")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
        _atomic(self.manifest_path, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    # --- what is written ---------------------------------------------------------------------
    def part_files(self) -> list[Path]:
        return sorted(self.parts.glob("part-*.parquet"))

    def written(self) -> tuple[set[bytes], int, int]:
        """(the keys of the ids in the parts, rows, rows whose id is in an earlier part too). The last is 0
        unless a part was lost track of; a rerun then still embeds nothing twice, and the count says so."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys: set[bytes] = set()
        rows = repeated = 0
        for part in self.part_files():
            try:
                ids = pq.read_table(part, columns=["id"]).column("id").to_pylist()
            except (OSError, pa.ArrowException) as exc:
                raise CorpusError(f"{part} cannot be read ({exc}); it was complete when renamed, so the disk "
                                  "changed it: delete the part and rerun to embed its documents again") from None
            for doc_id in ids:
                key = id_key(doc_id)
                repeated += key in keys
                keys.add(key)
            rows += len(ids)
        return keys, rows, repeated

    def write_part(self, rows: list[dict], pieces: bool, token: str | None = None) -> Path:
        """Write ``rows`` as one part, visible only once complete and only while ``token`` (default: this
        store's, from prepare) still owns the folder; its name is a digest of its ids."""
        import pyarrow.parquet as pq

        digest = hashlib.blake2b(digest_size=10)
        for r in rows:
            digest.update(r["id"].encode("utf-8") + b"\0")
        final = self.parts / f"part-{digest.hexdigest()}.parquet"
        table = rows_table(rows, pieces)
        token = token or self.token
        _atomic(final, lambda tmp: pq.write_table(table, tmp, compression="zstd"), lambda: self._owned(token))
        return final
