"""`python -m m3run.runner.cli`: the same as the `m3run` console script."""

from m3run.runner.cli import app

if __name__ == "__main__":
    app()
