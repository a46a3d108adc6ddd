"""``python -m tests.late_rank <train overrides>``: ``python -m specdec.train``, except that the
process of rank 1 reaches the data cache 4 s after the others, as after a slow start-up:
the others must not write parts before every process has looked at the cache. For
tests/train/test_scale.py."""

from __future__ import annotations

import os
import time

import specdec.train.job as job

_self_distilled = job.self_distilled


def _late(*args, **kwargs):
    if os.environ.get("RANK") == "1":
        time.sleep(4)
    return _self_distilled(*args, **kwargs)


job.self_distilled = _late

if __name__ == "__main__":
    from specdec.train.__main__ import main

    main()
