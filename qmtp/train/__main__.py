"""python -m qmtp.train: the trainer (qmtp/train/trainer.py)."""

import sys

from qmtp.train.trainer import main

sys.exit(main())
