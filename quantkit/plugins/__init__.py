"""Finding plugins: the built-in list and third-party entry points, looked up by name in one place (`catalog`)."""
