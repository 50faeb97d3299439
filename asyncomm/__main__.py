"""``python -m asyncomm``: the same as the ``asyncomm`` console script."""

import sys

from asyncomm._tools.cli import main

if __name__ == "__main__":  # importable: ``from asyncomm.__main__ import main``
    sys.exit(main())
