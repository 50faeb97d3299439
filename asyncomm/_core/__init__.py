"""The core: errors, reduce ops, handles and their deadlines, the progress engines, the
backend and link interfaces, the wire format, settings and the reserved tags.

Nothing here imports from the layers above (``_backends``, ``_messaging``,
``_observe``, ``_overlap``, the communicator, ``_tools``).
"""
