"""``python -m ropekit.bench``: the same as ``ropekit bench``."""

import sys

from .cli import main

sys.exit(main())
