"""The ``asyncflow`` command: starts the processes and talks to the API."""
