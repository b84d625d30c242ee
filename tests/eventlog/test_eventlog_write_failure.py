"""A write that fails (disk full, file size limit) leaves the log ending at a complete
record: an unbuffered write can stop short, and the bytes after a torn record would be
unreadable even once space comes back. The writer cuts the segment back to where the
failed flush began and keeps the records buffered for the next try."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kvstream.eventlog.reader import LogReader

_WRITER = textwrap.dedent("""
    import resource, sys
    from kvstream.eventlog import LogWriter
    limit = int(sys.argv[2])
    w = LogWriter(sys.argv[1], flush="close")
    w.flush()                      # the header is on disk
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: writes get EFBIG
    ok = 0
    try:
        for i in range(50):
            w.write_message("e0", b"kv", i, bytes(40), recv_ns=1_000 + i)
            if i % 4 == 3:         # flush 4 records at a time: a flush straddles the limit
                w.flush()
                ok = i + 1
    except OSError as exc:
        print(ok, exc.errno)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    w.write_message("e0", b"kv", 999, bytes(40), recv_ns=9_999)
    w.close()                      # the kept buffer and the new record go out now
""")


def test_a_flush_that_hits_the_size_limit_is_cut_back_and_retried(tmp_path):
    path = tmp_path / "full.kvlog"
    r = subprocess.run([sys.executable, "-c", _WRITER, str(path), "1200"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    flushed, err = map(int, r.stdout.split())
    assert err == 27  # EFBIG
    reader = LogReader(path)
    seqs = [rec.seq for rec in reader]
    assert reader.damage == []  # no torn record in the middle
    # Every record flushed before the failure, then the 4 whose flush failed (kept and
    # retried by close()), then the one written after: nothing lost, nothing torn.
    assert seqs == list(range(flushed + 4)) + [999], seqs
