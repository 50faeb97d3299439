"""``python -m asyncomm.testing``: a rank of a test world (see ``asyncomm.testing._rank``)."""

from asyncomm.testing._rank import main

main()
