"""Training the global student: its losses and the one trainer every method uses."""
