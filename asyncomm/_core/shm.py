"""Files of shared memory (``/dev/shm``) for processes of one host, their pages reserved.

Used by gloo's data lane (its rings) and by ``GradSync``'s sum: a file whose pages are
reserved when it is made refuses there, with ``OSError``, where ``/dev/shm`` is full, not
with SIGBUS at a later write into a mapping of it.
"""

from __future__ import annotations

import os
import secrets

FOLDER = "/dev/shm"


def reserved_file(prefix: str, nbytes: int, folder: str = FOLDER) -> tuple[int, str]:
    """Create ``folder/prefix-XXXXXXXX`` (mode 0600) holding ``nbytes`` reserved; return its
    descriptor and path.

    Raises:
        OSError: there is no such folder, or not room enough in it (nothing is left).
    """
    while True:
        path = os.path.join(folder, f"{prefix}-{secrets.token_hex(4)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            continue
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        return fd, path
