"""The app in-process against a real PostgreSQL: routes, the writer, projections, the log."""
