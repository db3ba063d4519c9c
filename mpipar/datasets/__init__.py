"""Data for training: token files (format, writer, reader), the standard-library byte corpus,
synthetic token sets and the MLP teacher tasks. No download is ever needed.

- ``tokens``: the HDF5 token-file format, ``write_token_file``, checksums, ``DataError``,
  ``unigram_entropy`` and ``TokenDataset`` (the reader the training loop uses);
- ``corpus``: ``prepare_corpus`` / ``ensure_corpus`` from the ``*.py`` files of the stdlib;
- ``synthetic``: ``prepare_synthetic`` token sets and ``synthetic_regression`` /
  ``synthetic_classification`` tasks.
"""

from .corpus import (
    CORPUS_NAME,
    default_corpus_path,
    ensure_corpus,
    file_header,
    list_source_files,
    prepare_corpus,
    stdlib_dir,
)
from .synthetic import (
    SYNTHETIC_KINDS,
    prepare_synthetic,
    synthetic_classification,
    synthetic_regression,
)
from .tokens import (
    FIX_HINT,
    FORMAT_VERSION,
    SPLITS,
    DataError,
    TokenDataset,
    token_dtype,
    tokens_sha256,
    unigram_entropy,
    write_token_file,
)

__all__ = [
    "CORPUS_NAME", "FIX_HINT", "FORMAT_VERSION", "SPLITS", "SYNTHETIC_KINDS", "DataError",
    "TokenDataset", "default_corpus_path", "ensure_corpus", "file_header", "list_source_files",
    "prepare_corpus", "prepare_synthetic", "stdlib_dir", "synthetic_classification",
    "synthetic_regression", "token_dtype", "tokens_sha256", "unigram_entropy", "write_token_file",
]
