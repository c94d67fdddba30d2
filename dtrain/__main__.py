"""``python -m dtrain``: the command line (see ``dtrain.cli``)."""
from dtrain.cli import main

if __name__ == "__main__":
    main()
