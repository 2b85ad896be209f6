"""m3run: the training worker, the supervisor that keeps it alive, and the `m3run` CLI."""

__version__ = "0.1.0"
