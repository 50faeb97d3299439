"""``python -m asyncomm.testing``: a rank of a test world (see ``asyncomm.testing._rank``)."""

import asyncomm
from asyncomm.testing._rank import serve

asyncomm.run(serve)
