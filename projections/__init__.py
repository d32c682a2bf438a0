"""Views folded from the log: task, job, blocker and round views, and their rebuilds."""
