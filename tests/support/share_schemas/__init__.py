"""ShareGroupHeartbeat (76) definitions for the scripted share-group broker (tests only: the
proxy passes ShareGroupHeartbeat through without reading it)."""
