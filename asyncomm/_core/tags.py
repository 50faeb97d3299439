"""Every tag asyncomm keeps for itself, in one table.

Two spaces. *Backend tags* name the raw point-to-point messages of a backend (``comm.send``/``recv``
take ``0 <= tag <= comm.max_tag``); the top ``RESERVED`` tags of each backend's range are asyncomm's
own. *Channel tags* are virtual: they travel in frame heads (``comm.channel`` takes
``0 <= tag <= MAX_CHANNEL``); the tags above are asyncomm's own traffic.
"""

from __future__ import annotations

from typing import Final

# -- backend tags ------------------------------------------------------------------

RESERVED: Final = 1024  # the top of every backend's tag range, kept for asyncomm
GLOO_TAG_LIMIT: Final = 2**31 - 1  # gloo's tag is a 32-bit slot
GLOO_ABORT: Final = GLOO_TAG_LIMIT  # the receive that ends a group's pending operations
GLOO_DATA: Final = GLOO_TAG_LIMIT - RESERVED + 1  # the payloads of large sends (gloo_p2p) ...
GLOO_DATA_TAGS: Final = 512  # ... on this many tags from there, round robin per peer
# On asyncomm's private twin communicator, which carries only its own traffic:
LINK_MESSAGE: Final = 1  # a link message: a frame, or the head of one sent in pieces
LINK_DATA: Final = 2  # a buffer of a frame sent in pieces

# -- channel tags --------------------------------------------------------------------

MAX_CHANNEL: Final = (1 << 62) - 1  # the largest tag a user's channel may have
ACTOR_REQUEST: Final = MAX_CHANNEL + 1  # actor calls
ACTOR_REPLY: Final = MAX_CHANNEL + 2  # their replies
BYE: Final = MAX_CHANNEL + 3  # a link's goodbye (see ``_core.link``, the note on closing)
DRAIN: Final = BYE + 1  # fills a gloo listener's last receives (``gloo_link``)
RELEASE: Final = BYE + 2  # asks a peer to end receives only its message can end
PING: Final = BYE + 3  # asks whether a peer is still there (dropped on arrival)
LEAVING: Final = BYE + 4  # a rank closes without waiting for its peers
