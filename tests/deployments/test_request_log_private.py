"""The request log's files are owner-only (request_log.py): the current file and each one a
rotation makes are 0600 under a permissive umask (022), and the rotated ones keep it."""

import os

from kvserve.deployments.gateway.request_log import RequestLog


def test_rotated_and_new_request_log_files_are_0600_under_umask_022(tmp_path):
    old = os.umask(0o022)
    try:
        log = RequestLog(str(tmp_path), "store", max_bytes=500, backups=2, name="g1")
        for i in range(60):
            log.record(
                "m", "chat", {"model": "m", "messages": [{"role": "user", "content": f"q{i} " + "x" * 40}]}, True
            )
        log.close()
    finally:
        os.umask(old)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["requests-g1.jsonl", "requests-g1.jsonl.1", "requests-g1.jsonl.2"]  # it did rotate
    assert {f: (tmp_path / f).stat().st_mode & 0o777 for f in files} == {f: 0o600 for f in files}
