"""`python -m runner.cli`: the same as the `m3run` console script."""

from runner.cli import app

if __name__ == "__main__":
    app()
