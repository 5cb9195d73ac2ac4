"""Built-in coordinators."""
