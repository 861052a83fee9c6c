"""Megatron's indexed dataset: token documents in ``P.bin``, their index in ``P.idx``.

The format is the one megatron-core's ``IndexedDatasetBuilder`` writes and ``IndexedDataset``
reads (written here from the format, not from its code). ``P.bin`` is every sequence's token ids
back to back, in one integer dtype, nothing else. ``P.idx``, all little-endian::

    b"MMIDIDX\\x00\\x00"           9 bytes, magic
    version                      uint64, 1
    dtype code                   uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                        6 float64, 7 float32, 8 uint16
    sequence count n             uint64
    document count d             uint64: entries of the document index (documents + 1)
    sequence lengths             n x int32, in tokens
    sequence pointers            n x int64, byte offsets into P.bin
    document index               d x int64: sequence numbers where documents begin/end, from 0
                                 to n (a document is sequences [idx[i], idx[i + 1]))
    (multimodal files only)      n x int8 sequence modes

Megatron's ``preprocess_data.py`` writes one sequence per document (without sentence splitting)
and picks the token dtype by vocabulary size (:func:`optimal_dtype`): ``uint16`` below 65500,
else ``int32``.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

__all__ = ["MAGIC", "DTYPES", "optimal_dtype", "IndexedDatasetWriter", "IndexedDataset",
           "idx_path", "bin_path"]

MAGIC = b"MMIDIDX\x00\x00"
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
"""The dtype codes of the ``.idx`` header."""
_CODES = {np.dtype(t): code for code, t in DTYPES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes


def optimal_dtype(vocab_size: int) -> type:
    """Megatron's token dtype for a vocabulary: ``uint16`` when ``vocab_size < 65500``, else
    ``int32``."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


class IndexedDatasetWriter:
    """Write ``prefix.bin`` as documents are added, then ``prefix.idx`` on :meth:`finalize`.

    One :meth:`add_document` call is one document of one sequence or more (``lengths``), as
    megatron-core's ``IndexedDatasetBuilder.add_document``; a document may be empty (no
    sequences), as Megatron's preprocessing writes for an empty text.
    """

    def __init__(self, prefix: str | Path, dtype: type = np.int32) -> None:
        if np.dtype(dtype) not in _CODES or np.dtype(dtype).kind not in "iu":
            raise ValueError(f"dtype {np.dtype(dtype)} is not an integer dtype of the indexed "
                             f"format: " + ", ".join(str(np.dtype(t)) for t in DTYPES.values()
                                                     if np.dtype(t).kind in "iu"))
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        self._bin = open(bin_path(prefix), "wb")
        self.lengths: list[int] = []
        self.doc_index: list[int] = [0]

    def add_document(self, ids, lengths: list[int] | None = None) -> None:
        """Append one document: token ``ids`` (any integer sequence), split into sequences of
        ``lengths`` (default: one sequence, or none when ``ids`` is empty)."""
        arr = np.asarray(ids)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {int(arr.min())}..{int(arr.max())} do not fit "
                             f"{self.dtype} (the vocabulary decides the dtype)")
        lengths = ([arr.size] if arr.size else []) if lengths is None else list(lengths)
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths {lengths} do not add up to the document's "
                             f"{arr.size} tokens")
        self._bin.write(arr.astype(self.dtype).tobytes(order="C"))
        self.lengths.extend(int(n) for n in lengths)
        self.doc_index.append(len(self.lengths))

    def finalize(self) -> None:
        """Close ``prefix.bin`` and write ``prefix.idx``."""
        self._bin.close()
        lengths = np.array(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1].astype(np.int64)) * self.dtype.itemsize
        with open(idx_path(self.prefix), "wb") as f:
            f.write(MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODES[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(self.doc_index)))
            f.write(lengths.tobytes(order="C") + pointers.tobytes(order="C"))
            f.write(np.array(self.doc_index, dtype=np.int64).tobytes(order="C"))

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.finalize()
        else:  # no half-written dataset left behind
            self._bin.close()
            bin_path(self.prefix).unlink(missing_ok=True)


class IndexedDataset:
    """Read ``prefix.bin`` / ``prefix.idx`` (paraloom's or Megatron's), memory-mapped.

    Every inconsistency (magic, version, dtype code, sizes, pointers, document index) is a
    ``ValueError`` naming the file and ``flag``, so a bad dataset is refused before ranks start.
    """

    def __init__(self, prefix: str | Path, flag: str = "--data-path") -> None:
        self.prefix = str(prefix)
        idx, binf = idx_path(prefix), bin_path(prefix)
        missing = [str(p) for p in (idx, binf) if not p.is_file()]
        if missing:
            raise ValueError(f"{flag} {self.prefix!r}: {' and '.join(missing)} not found (an "
                             f"indexed dataset is PREFIX.bin + PREFIX.idx, as `paraloom "
                             f"preprocess --output-prefix PREFIX` or Megatron's "
                             f"preprocess_data.py write)" + _suffix_hint(self.prefix))
        raw = idx.read_bytes()
        bad = lambda why: ValueError(f"{flag} {self.prefix!r}: {idx} is not a Megatron index "
                                     f"file: {why}")
        if len(raw) < _HEADER or raw[:len(MAGIC)] != MAGIC:
            raise bad(f"it starts {raw[:len(MAGIC)]!r}, not {MAGIC!r}" if len(raw) >= len(MAGIC)
                      else f"{len(raw)} bytes, shorter than the {_HEADER}-byte header")
        version, code, n, d = struct.unpack_from("<QBQQ", raw, len(MAGIC))
        if version != 1:
            raise bad(f"version {version}, only version 1 exists")
        if code not in DTYPES:
            raise bad(f"dtype code {code}, valid codes are 1..8")
        self.dtype = np.dtype(DTYPES[code])
        body = 4 * n + 8 * n + 8 * d
        if len(raw) not in (_HEADER + body, _HEADER + body + n):  # + n: multimodal modes
            raise bad(f"{len(raw)} bytes, but {n} sequences and {d} document index entries "
                      f"need {_HEADER + body} (truncated or not an index)")
        at = _HEADER
        self.sequence_lengths = np.frombuffer(raw, np.int32, n, at)
        self.sequence_pointers = np.frombuffer(raw, np.int64, n, at + 4 * n)
        self.document_indices = np.frombuffer(raw, np.int64, d, at + 12 * n)
        lengths = self.sequence_lengths.astype(np.int64)
        want = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * self.dtype.itemsize
        if (lengths < 0).any() or not np.array_equal(self.sequence_pointers, want[:n]):
            raise bad("its sequence pointers do not follow from the sequence lengths")
        di = self.document_indices
        if d < 1 or di[0] != 0 or di[-1] != n or (np.diff(di) < 0).any():
            raise bad(f"its document index must rise from 0 to the sequence count {n}")
        size = binf.stat().st_size
        if size != int(lengths.sum()) * self.dtype.itemsize:
            raise ValueError(f"{flag} {self.prefix!r}: {binf} has {size} bytes but its index "
                             f"says {int(lengths.sum())} tokens of {self.dtype} "
                             f"({int(lengths.sum()) * self.dtype.itemsize} bytes)")
        self.tokens = (np.memmap(binf, dtype=self.dtype, mode="r") if size
                       else np.zeros(0, self.dtype))
        """Every token id of ``P.bin`` in order (memory-mapped, read-only)."""

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.astype(np.int64).sum())

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence ``i``'s token ids."""
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[i])])

    def document(self, j: int) -> np.ndarray:
        """Document ``j``'s token ids (its sequences joined)."""
        lo, hi = int(self.document_indices[j]), int(self.document_indices[j + 1])
        if lo == hi:
            return np.zeros(0, self.dtype)
        start = int(self.sequence_pointers[lo]) // self.dtype.itemsize
        count = int(self.sequence_lengths[lo:hi].astype(np.int64).sum())
        return np.asarray(self.tokens[start:start + count])


def _suffix_hint(prefix: str) -> str:
    """A hint when the prefix names a file of the dataset instead of the dataset."""
    for suffix in (".bin", ".idx"):
        stem = prefix.removesuffix(suffix)
        if stem != prefix and idx_path(stem).is_file() and bin_path(stem).is_file():
            return f"; give the prefix without {suffix!r}: {stem!r}"
    return ""
