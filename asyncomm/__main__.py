"""``python -m asyncomm``: the same as the ``asyncomm`` console script."""

import sys

from asyncomm._tools.cli import main

sys.exit(main())
