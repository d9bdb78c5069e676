"""File names derived from data: bag ids, series UIDs and slide stems never become paths as they are.

A bag id comes from a feature table, a DICOM header or a file name, so it can hold ``/``, ``..``,
a drive letter, a backslash, NUL, 300 characters or any Unicode. :func:`safe_filename` maps it to
one path component, ``<slug>-<hash>``: the slug is a readable ASCII rendering (at most
:data:`SLUG_CHARS` characters of ``[A-Za-z0-9._-]``, never starting with a dot) and the hash is the
first :data:`HASH_CHARS` hex digits of the SHA-256 of the id's bytes, so two ids that slug alike
(``a/b`` and ``a_b``) still get different names. The original id stays in the tables (bag
predictions, the store); the file name is only a handle. :func:`bag_file` joins it under a folder
(always a direct child of it).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from pathlib import Path

__all__ = ["SLUG_CHARS", "HASH_CHARS", "id_digest", "safe_filename", "bag_file"]

SLUG_CHARS = 48
HASH_CHARS = 12
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def id_digest(bag_id: str) -> str:
    """SHA-256 (hex) of an id's bytes; ids decoded from non-UTF-8 file names (lone surrogates,
    ``os.fsdecode``) hash by their original bytes instead of raising."""
    return hashlib.sha256(str(bag_id).encode("utf-8", "surrogateescape")).hexdigest()


def safe_filename(bag_id: str, suffix: str = "") -> str:
    """One safe, collision-free path component for ``bag_id`` (``suffix`` such as ``".png"`` appended).

    >>> safe_filename("../../etc/passwd", ".png")
    'etc_passwd-3754d6cb3a38.png'
    """
    if suffix and (not re.fullmatch(r"(\.[A-Za-z0-9]+)+", suffix)):
        raise ValueError(f"file suffix {suffix!r}: expected something like '.png' or '.tar.gz'")
    ascii_text = unicodedata.normalize("NFKD", str(bag_id)).encode("ascii", "ignore").decode("ascii")
    slug = _UNSAFE.sub("_", ascii_text).lstrip("._-")[:SLUG_CHARS].rstrip("._-") or "bag"
    return f"{slug}-{id_digest(bag_id)[:HASH_CHARS]}{suffix}"


def bag_file(folder: str | Path, bag_id: str, suffix: str = "") -> Path:
    """``folder / safe_filename(bag_id, suffix)``: always a direct child of ``folder``."""
    return Path(folder) / safe_filename(bag_id, suffix)
