"""kvbaton: the multi-turn P/D conversation router (ASGI app, CLI, per-turn flow)."""
