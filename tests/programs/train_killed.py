"""`python tests/programs/train_killed.py STEP FLAGS...`: `python -m train FLAGS...` whose process
kills itself with SIGKILL (no clean-up at all) once STEP steps are done and checkpointed."""

import os
import signal
import sys

from train.__main__ import main
from train.trainer import Hook


class KillAfter(Hook):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, trainer, rec):
        if trainer.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[2:], hooks=[KillAfter(int(sys.argv[1]))]))
