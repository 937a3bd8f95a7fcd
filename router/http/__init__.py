"""The HTTP surface: the Starlette app, the Hypercorn server and its workers, admin and status."""
