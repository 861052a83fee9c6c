"""Folding the communication order table: runs of consecutive layer blocks identical up to the
layer index become one block marked ``(x4 layers)``, then runs of consecutive microbatches that
communicate alike one block marked ``(x4 microbatches)``; a folded row can list the rows it
stands for (the report expands them). The rows are :func:`~.table.table_rows`'.
"""

from __future__ import annotations

import re

__all__ = ["group_rows"]

_WORDS = {"en": ("layers", "microbatches"), "zh": ("层", "个微批次")}
_LAYER = re.compile(r"layers\.\d+")


def _layer_of(row: dict) -> str | None:
    m = _LAYER.search(row.get("module") or "")
    return m.group(0) if m else None


def _shape(row: dict, keys: tuple) -> tuple:
    return tuple(_LAYER.sub("layers.*", str(row[k])) for k in keys[1:])


def group_rows(rows: list[dict], lang: str, keys: tuple, members: bool = False) -> list[dict]:
    """Fold runs of consecutive layer blocks identical up to the layer index, then runs of
    consecutive microbatches that communicate alike (``(x4 microbatches)``); ``members``: each
    folded row also lists the rows it stands for (one per layer and microbatch)."""
    return _fold_microbatches(_fold_layers(rows, lang, keys, members), lang, keys, members)


def _fold_microbatches(rows: list[dict], lang: str, keys: tuple, members: bool
                       ) -> list[dict]:
    blocks: list[list[dict]] = []
    for row in rows:  # a block: consecutive rows of one microbatch (or one row outside them)
        mb = row.get("microbatch")
        if blocks and mb is not None and blocks[-1][0].get("microbatch") == mb:
            blocks[-1].append(row)
        else:
            blocks.append([row])
    out: list[dict] = []
    i = 0
    while i < len(blocks):
        shape = [_shape(r, keys) for r in blocks[i]]
        j = i + 1
        while blocks[i][0].get("microbatch") is not None and j < len(blocks) \
                and blocks[j][0].get("microbatch") is not None \
                and [_shape(r, keys) for r in blocks[j]] == shape:
            j += 1
        for pos, row in enumerate(blocks[i]):
            row = dict(row)
            if j - i > 1:
                row["microbatches"] = j - i
                row["trigger_location"] += f" (x{j - i} {_WORDS[lang][1]})"
                if members:
                    row["members"] = [m for k in range(i, j)
                                      for m in blocks[k][pos].get("members", [blocks[k][pos]])]
            row["index"] = len(out) + 1
            out.append(row)
        i = j
    return out


def _fold_layers(rows: list[dict], lang: str, keys: tuple, members: bool) -> list[dict]:
    blocks: list[list[dict]] = []
    for row in rows:  # a block: consecutive rows of one layer (or one row outside layers)
        layer = _layer_of(row)
        if blocks and layer is not None and _layer_of(blocks[-1][0]) == layer:
            blocks[-1].append(row)
        else:
            blocks.append([row])
    out: list[dict] = []
    i = 0
    while i < len(blocks):
        j = i + 1
        if _layer_of(blocks[i][0]) is not None:
            shape = [_shape(r, keys) for r in blocks[i]]
            while j < len(blocks) and _layer_of(blocks[j][0]) is not None \
                    and [_shape(r, keys) for r in blocks[j]] == shape:
                j += 1
        n = j - i
        for pos, row in enumerate(blocks[i]):
            row = dict(row)
            if members:
                row["members"] = [blocks[k][pos] for k in range(i, j)]
            if n > 1:
                row["count"] = n
                for k in ("trigger_location", "async"):
                    row[k] = _LAYER.sub("layers.*", row[k])
                row["trigger_location"] += f" (x{n} {_WORDS[lang][0]})"
            row["index"] = len(out) + 1
            out.append(row)
        i = j
    return out
