"""``python -m dormant``: the same command line as ``dormant``."""

import sys

from dormant.cli import main

sys.exit(main())
