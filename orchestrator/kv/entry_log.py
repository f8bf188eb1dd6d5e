"""The write log shared by the in-memory prefix index and the approximate recorder.

Both keep, per owner, ``entries``: block hash → number of the write (store or record) that last wrote
it, and ``records``: write number → a tuple whose field ``at`` is that write's ``{block: number}`` of the
blocks it was the last to write, oldest write first. Each entry sits in exactly one record, so eviction
and expiry walk the log in order with nothing outdated to skip or compact."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import Any


def move_out_of_older(entries: dict[int, int], written: Iterable[int],
                      records: MutableMapping[int, Any], at: int) -> None:
    """The blocks of ``written`` that an older write holds leave its record (a record left empty goes)."""
    for h in written:
        older = entries.get(h)
        if older is not None:
            blocks = records[older][at]
            del blocks[h]
            if not blocks:
                del records[older]


def drop_owner(entries: dict[int, int], records: MutableMapping[int, Any], at: int) -> None:
    """An owner's ``entries`` leave the records that hold them (a record left empty goes)."""
    for h, number in entries.items():
        record = records.get(number)
        if record is not None:
            blocks = record[at]
            blocks.pop(h, None)
            if not blocks:
                del records[number]
