"""``python -m sinkflex_core.train`` (and ``torchrun ... -m sinkflex_core.train``)."""

import sys

from .trainer import main

sys.exit(main())
