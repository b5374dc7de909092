"""``python -m ultraep.cli``: the ``ultraep`` command."""

import sys

from ultraep.cli import main

sys.exit(main())
