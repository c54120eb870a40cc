"""Entry point: ``python -m slora_jax.serve --help``."""

from .cli import main

if __name__ == "__main__":
    main()
