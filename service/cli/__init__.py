"""The `taskledger` command line: `main` builds the parser from one module per
program (serve, tokens, tail, worker, runner, watch, admin), each adding its
commands with `register(subparsers)`; `common` holds what they share. Every
call they make over HTTP goes through `taskledger.client`.

A new command: a `register` in the module of its program (or a new module that
`main` imports by name), and a test in tests/e2e that runs it as a process
against a real `taskledger serve` (tests/conftest.py: `server`)."""
