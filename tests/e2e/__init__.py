"""Whole programs: a served process, the CLI, the browser, several processes or replicas."""
