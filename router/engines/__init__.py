"""The engines: the client seam, the pool and placement, health, engine identity, discovery."""
