"""Timing profiles shipped with the mocker engine (``<name>.json``; see ``..profile``)."""
