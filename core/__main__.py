"""``python -m hookfit``: the ``hookfit`` command, for environments without its script."""

import sys

from hookfit.tools.cli import main

sys.exit(main())
