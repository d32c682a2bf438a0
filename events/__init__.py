"""Facts: event types, the append-only store, and the pure domain decisions."""
