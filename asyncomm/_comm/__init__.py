"""The communicator: ``Comm`` (``comm``), and what it knows of its peers (``peers``)."""

from asyncomm._comm.comm import Comm

__all__ = ["Comm"]
