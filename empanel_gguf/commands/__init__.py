"""Subcommands of the `empanel-gguf` command line: one module each, each with `main(argv)`."""
