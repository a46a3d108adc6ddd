"""``python -m tests.kill_at_checkpoint STEP <train overrides>``: ``python -m specdec.train``,
except that the main process kills itself with SIGKILL (no handler, no cleanup: what
an out-of-memory kill or a lost node does) right after the checkpoint of step STEP
is written. For tests/train/test_scale.py."""

from __future__ import annotations

import os
import signal
import sys

from specdec.train import checkpoints

KILL_AT = int(sys.argv.pop(1))
_save = checkpoints.save


def _save_then_die(accelerator, checkpoint, step, fingerprint):
    path = _save(accelerator, checkpoint, step, fingerprint)
    if step == KILL_AT and accelerator.is_main_process:
        os.kill(os.getpid(), signal.SIGKILL)
    return path


checkpoints.save = _save_then_die

if __name__ == "__main__":
    from specdec.train.__main__ import main

    main()
