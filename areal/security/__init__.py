"""Per-run secrets: the trainer's weights signing key and the message-id secret (`keys.py`)."""
