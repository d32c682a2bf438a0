"""The HTTP service, its command-line interface and authentication."""
