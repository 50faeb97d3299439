"""Messaging: the router (one per communicator, over a link), channels and actors.

Built from a ``Link`` and small interfaces; never from the communicator itself.
"""
