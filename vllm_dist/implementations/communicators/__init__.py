"""Built-in device communicators."""
