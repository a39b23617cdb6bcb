"""Subcommands of the `xstage-dit` command, one module each."""
