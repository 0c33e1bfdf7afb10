"""Asyncflow core: flow definitions, the saga state machine, storage and messaging."""
