"""Files written whole or not at all: the one atomic JSON write of the project.

``write_json_atomic(path, data)`` writes a temporary file beside ``path`` (same folder, so the rename stays
on one file system), flushes and fsyncs it, then renames it over ``path``: a reader (or a ``kill -9`` at any
moment) sees the old file or the new one, never half of one. A failed write removes its temporary file and
leaves ``path`` as it was.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike, data: Any, indent: int | None = None, fsync: bool = True,
                      mkdir: bool = False, default: Any = None) -> None:
    """Atomically replace ``path`` with ``data`` as JSON.

    ``fsync``: flush to disk before the rename (state that must survive a crash); ``mkdir``: create the
    parent folder first; ``default``: json.dump's converter for other types (results holding numpy scalars).
    Raises OSError (nothing written) when the folder is missing or not writable.
    """
    path = Path(path)
    if mkdir:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=indent, default=default)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise
