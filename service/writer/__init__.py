"""The write engine: one writer that group-commits appends, and the command handlers that decide and append."""
