"""Subcommands of `python -m dflash_jax`: one module per job, each with `register(subparsers)`."""
