"""The `taskledger` command line."""
