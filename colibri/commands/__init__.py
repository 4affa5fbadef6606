"""The `colibri` subcommands, one module per group: `add_<name>(subparsers)` declares the
arguments, `cmd_<name>(args)` calls the library and prints (colibri/cli.py is the dispatcher)."""
