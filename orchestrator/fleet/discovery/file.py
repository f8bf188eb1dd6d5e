"""File source: workers listed in a YAML or JSON file, re-read when it changes.

The file holds a list of worker entries (the fields of the config's ``workers`` entries), or a
mapping with a ``workers:`` list. A worker's id defaults to its URL, so editing one entry never
renames another. A change applies once the file reads the same at two polls in a row (one
``interval_s`` later), so a file caught while it is being written in place is never applied; an
empty file (no document) never replaces a list in force: write ``[]`` to remove every worker.
Adding an entry adds a worker; deleting it withdraws the worker (drained, then removed when idle); editing its role switches the role in place; ``draining: true`` on an entry
drains it without removing it. A file that does not parse or validate is reported once and ignored:
the last good list stays in force.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.config import FileDiscoveryConfig, WorkerConfig, _construct_unique_mapping
from orchestrator.fleet.discovery.reconcile import WorkerSpec
from orchestrator.fleet.registry import url_key

log = logging.getLogger("dyad.discovery")


MAX_FILE_BYTES = 16 << 20  # a workers file of 100,000 entries is ~10 MB; anything larger is not one


class WorkersFileError(ValueError):
    pass


class _FastStrictLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """``config.load_yaml``'s loader (a key written twice is refused) on libyaml's scanner when PyYAML has
    it: the pure-Python one spent 4-10 s of CPU per MB with the GIL held, the gateway's loop sharing it."""


_FastStrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _load(text: str, origin: str) -> Any:
    """The file's document: JSON through ``json`` (hundreds of times faster than any YAML loader), else
    YAML; a key written twice is refused either way, not the last one kept."""
    if text.lstrip()[:1] in ("[", "{"):
        def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in pairs:
                if k in out:
                    raise WorkersFileError(f"{origin}: not valid YAML/JSON: duplicate key {k!r}: each key may "
                                           "appear once")
                out[k] = v
            return out

        try:
            return json.loads(text, object_pairs_hook=unique)
        except json.JSONDecodeError:
            pass  # YAML flow style ([{url: x}]) is not JSON
    return yaml.load(text, Loader=_FastStrictLoader)  # noqa: S506 - a SafeLoader (CSafeLoader) subclass


def parse_workers_file(text: str, origin: str = "workers file") -> dict[str, WorkerSpec]:
    """The file's text → workers by id. Raises ``WorkersFileError`` naming the bad entry and field."""
    try:
        raw = _load(text, origin)
    except yaml.YAMLError as e:
        raise WorkersFileError(f"{origin}: not valid YAML/JSON: {e}") from e
    except RecursionError:  # 100,000 nested brackets: the parsers recurse (it ended the source's loop)
        raise WorkersFileError(f"{origin}: nested too deeply to be a list of workers") from None
    if raw is None:
        raw = []
    if isinstance(raw, dict):
        # a mapping without ``workers`` (a typo: ``worker:``, ``Workers:``) read as "no workers" withdrew
        # every worker in force: say what is wrong instead (``[]`` or ``workers: []`` empties the list)
        other = sorted(str(k) for k in raw if k != "workers")
        if other:
            raise WorkersFileError(f"{origin}: {', '.join(other)}: unknown key(s); the file is a list of workers "
                                   "or a mapping with only 'workers'")
        if "workers" not in raw:
            raise WorkersFileError(f"{origin}: workers: missing (write 'workers: []' to remove every worker)")
        raw = raw["workers"]
    if not isinstance(raw, list):
        raise WorkersFileError(f"{origin}: expected a list of workers or a mapping with 'workers'")
    out: dict[str, WorkerSpec] = {}
    urls: dict[str, int] = {}  # url_key → the entry that has it
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict):
            raise WorkersFileError(f"{origin}: workers.{i}: expected a mapping")
        entry = dict(entry)
        draining = entry.pop("draining", None)
        draining = False if draining is None else draining  # ``draining:`` with no value: not draining
        if not isinstance(draining, bool):  # bool("false") is True: a quoted "false" drained the worker
            raise WorkersFileError(f"{origin}: workers.{i}.draining: expected true or false, got {draining!r}"[:300])
        try:
            wc = WorkerConfig.model_validate(entry)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"])
            raise WorkersFileError(f"{origin}: workers.{i}.{loc}: {first['msg']}") from e
        if wc.id is None:
            wc.id = wc.url
        if wc.id in out:
            raise WorkersFileError(f"{origin}: workers.{i}.id: duplicate worker id '{wc.id}'")
        key = url_key(wc.url)
        if key in urls:
            raise WorkersFileError(f"{origin}: workers.{i}.url: the engine at {wc.url} is already workers.{urls[key]}")
        urls[key] = i
        out[wc.id] = WorkerSpec(wc, draining=draining)
    return out


def read_regular_file(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, which must be a regular file (a symlink to one is fine).
    Opened without blocking: a FIFO (a named pipe, a ``<(...)`` path after its one read) made ``open``
    wait for a writer for good, and a device is no workers file; both raise ``OSError`` naming that."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a pipe, a device or a socket)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


class FileSource:
    name = "file"

    def __init__(self, cfg: FileDiscoveryConfig, on_error: Callable[[], None] | None = None) -> None:
        assert cfg.path
        self.on_error = on_error
        self.path = Path(cfg.path)
        self.interval_s = cfg.interval_s
        self._digest: str | None = None  # the contents last applied (or refused)
        self._pending: str | None = None  # changed contents seen once, applied if unchanged at the next poll
        self._applied = False  # whether ``_digest`` is contents that were applied (not refused)
        self.loads = 0
        self.last_error: str | None = None

    def poll(self) -> dict[str, WorkerSpec] | None:
        """The workers when the file changed since the last poll, else None."""
        try:
            data = read_regular_file(self.path, MAX_FILE_BYTES + 1)  # a runaway file is refused, not read
        except OSError as e:
            err = f"cannot read {self.path}: {e.strerror}"
            if err != self.last_error:
                log.warning("discovery: %s (keeping the last good list)", err)
                self._error()
            self.last_error = err
            return None
        digest = hashlib.sha256(data).hexdigest()
        if digest == self._digest:
            self._pending = None
            if self.last_error is not None and self._applied:
                # readable again with the contents in force (restored after a delete, a failed mount):
                # the error is over (it stayed in the status and the next log line was never written)
                log.info("discovery: %s readable again; the list in force is unchanged", self.path)
                self.last_error = None
            return None
        if self._digest is not None and digest != self._pending:
            # Changed since the list in force: apply it once it reads the same at the next poll. A file
            # written in place (``open(path, "w")``: truncated, then written) is caught half-way now and
            # then; its prefix often parses (empty, or the first entries of a YAML list), and applying it
            # would withdraw, i.e. drain and remove, every worker not in it yet.
            self._pending = digest
            return None
        self._pending = None
        self._digest = digest
        try:
            if len(data) > MAX_FILE_BYTES:
                raise WorkersFileError(f"{self.path}: larger than {MAX_FILE_BYTES >> 20} MiB (a workers file "
                                       "lists engines; is this the right file?)")
            if self.loads and not data.strip():
                raise WorkersFileError(f"{self.path}: empty (being rewritten?); write [] to remove every worker")
            workers = parse_workers_file(data.decode(errors="replace"), str(self.path))
        except WorkersFileError as e:
            self.last_error = str(e)
            self._applied = False
            log.warning("discovery: %s (keeping the last good list)", e)
            self._error()
            return None
        self.last_error = None
        self._applied = True
        self.loads += 1
        return workers

    def _error(self) -> None:
        if self.on_error is not None:
            self.on_error()

    async def run(self, report: Callable[[dict[str, WorkerSpec]], None]) -> None:
        while True:
            try:
                workers = await asyncio.to_thread(self.poll)
            except Exception as e:  # noqa: BLE001 - whatever a poll raises, the source polls on
                workers = None
                err = f"{self.path}: {type(e).__name__}: {e}"[:300]
                if err != self.last_error:
                    log.warning("discovery: %s (keeping the last good list)", err)
                    self._error()
                self.last_error = err
            if workers is not None:
                report(workers)
            await asyncio.sleep(self.interval_s)

    def status(self) -> dict[str, Any]:
        return {"source": self.name, "path": str(self.path), "loads": self.loads, "last_error": self.last_error}
