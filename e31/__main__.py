"""``python -m e31``: the ``e31`` command line."""

import sys

from e31.flows.cli import main

sys.exit(main())
