"""``python -m usp.bench.maxlen``: :func:`usp.bench.maxlen.cli.main`."""

from usp.bench.maxlen.cli import main

if __name__ == "__main__":
    main()
