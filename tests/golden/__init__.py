"""Golden wire captures from real clients talking to a real broker (see README.md here)."""
