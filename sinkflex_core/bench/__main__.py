"""``python -m sinkflex_core.bench``."""

import sys

from . import main

sys.exit(main())
