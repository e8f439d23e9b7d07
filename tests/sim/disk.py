"""The simulated state directory's disk, under the real journal (``dflockd_server.journal``).

The files are real, in a temporary directory of the run (what the journal writes is byte for
byte what a server writes); what is simulated is what a disk and a machine do to them: a full
disk (a write fails, ``ENOSPC``), a failing disk (an fsync fails, ``EIO``; or only a
directory's), and a crash of the machine, which loses what the page cache held and the disk had
not taken: the journal falls back to what its last successful fsync covered, its last record
now and then torn in the middle. A kill of the process loses nothing (the kernel keeps what was
written).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

from tests.sim.loop import Loop

__all__ = ["Disk"]


class Disk:
    """One state directory (see the module's doc)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.dir = tempfile.mkdtemp(prefix="dflock-sim-")
        self.journal = os.path.join(self.dir, "journal")
        self.full = False
        self.failing = False
        self.dir_failing = False
        """Only a directory's fsync fails (what a compaction meets after its rename)."""
        self.synced: dict[int, int] = {}
        """Inode -> its size at its last successful fsync."""

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # what the journal calls instead of os.write, os.fsync and a directory's fsync
    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.full:
            self.loop.count("write failed")
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)

    def fsync_file(self, fd: int) -> None:
        if self.failing:
            self.loop.count("fsync failed")
            raise OSError(errno.EIO, "Input/output error")
        st = os.fstat(fd)
        self.synced[st.st_ino] = st.st_size

    def fsync_dir(self, path: str) -> None:
        if self.failing or self.dir_failing:
            self.loop.count("directory fsync failed")
            raise OSError(errno.EIO, "Input/output error")

    # the machine
    def crash(self) -> None:
        """The machine goes down: the journal keeps what its last fsync covered (and, now and
        then, a torn piece of what followed)."""
        try:
            st = os.stat(self.journal)
        except FileNotFoundError:
            return
        kept = self.synced.get(st.st_ino, 0)
        if st.st_size > kept and self.loop.chance(0.5):
            kept += self.loop.rng.randint(1, st.st_size - kept)  # a torn tail
            self.loop.count("torn tail")
        if kept < st.st_size:
            os.truncate(self.journal, kept)
            self.loop.note(f"disk: the journal lost {st.st_size - kept} unsynced byte(s)")
            self.loop.count("page cache lost")
        self.synced = {st.st_ino: kept}
