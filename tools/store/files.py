"""The SQLite database's files on disk, whatever the process's umask: the file made (or tightened to) 0600
before SQLite opens it, so that SQLite gives its -wal and -shm the same mode, and a folder made for it 0700.
Knows file modes and owners; not SQLite's connections or what the file holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

FILE_MODE = 0o600  # the database, its -wal, -shm and rollback journal: the owner's alone
FOLDER_MODE = 0o700  # a folder made for the database
COMPANIONS = ("-wal", "-shm", "-journal")  # the files SQLite keeps beside the database


def private_database(path: Path) -> None:
    """Make `path`'s missing folders 0700 and the file itself 0600 (created empty when missing), and tighten
    to 0600 the file and its companions this user owns that an earlier version left readable by others.
    An existing folder that holds nothing but this database's files is tightened to 0700; another existing
    folder is left as it is (it may be shared), with a warning when others can read it."""
    _folders(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    for suffix in COMPANIONS:
        companion = path.with_name(path.name + suffix)
        with contextlib.suppress(FileNotFoundError):  # SQLite makes them when it needs them
            st = os.lstat(companion)
            mine = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
            if mine and stat.S_IMODE(st.st_mode) != FILE_MODE:
                os.chmod(companion, FILE_MODE)


def _folders(folder: Path) -> None:
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(made, FOLDER_MODE)
        os.chmod(made, FOLDER_MODE)  # mkdir's mode passes through the umask
    if missing:
        return
    st = os.stat(folder)
    if not stat.S_IMODE(st.st_mode) & 0o077:
        return
    own = st.st_uid == os.geteuid() and not st.st_mode & stat.S_ISVTX
    if own and all(_belongs(entry) for entry in os.listdir(folder)):
        os.chmod(folder, FOLDER_MODE)
        return
    log.warning(
        "store: the database's folder %s is open to other users (mode %o); the files in it are not",
        folder,
        stat.S_IMODE(st.st_mode),
    )


def _belongs(name: str) -> bool:
    """A name the database's own files take (hotel.sqlite3 and its companions)."""
    return name.endswith((".sqlite3", *(".sqlite3" + s for s in COMPANIONS)))
