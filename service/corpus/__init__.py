"""The bulk job: a whole corpus through the server's engine into a resumable Parquet dataset, in this process
or on Ray Data (``yoso-embed``; import as ``yoso_serve.service.corpus``)."""

from .job import embed_corpus
from .sources import CorpusError

__all__ = ["CorpusError", "embed_corpus"]
