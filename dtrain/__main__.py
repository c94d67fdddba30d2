"""``python -m dtrain``: the command line (see ``dtrain.cli``).

``--help`` and ``--version`` are answered here, before ``dtrain.cli`` imports torch and Hydra.
"""
import sys

from dtrain.help import UnknownTopic, quick_answer


def main() -> None:
    """Prints ``--help``/``--version`` at once; otherwise runs :func:`dtrain.cli.main`."""
    try:
        answer = quick_answer(sys.argv[1:])
    except UnknownTopic as error:
        print(f"dtrain: error: {error}", file=sys.stderr)
        sys.exit(2)
    if answer is not None:
        print(answer, end="")
        sys.exit(0)
    from dtrain.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
