import sys

from dormant.cli import main

sys.exit(main())
