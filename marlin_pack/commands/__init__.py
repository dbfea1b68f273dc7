"""The ``marlin-pack`` commands, one module per concern; :mod:`marlin_pack.cli` makes the typer app of them.

``console``: the two consoles everything is printed on (untrusted text shown escaped); ``params``: the words
shared by several commands and their parsing; then one module per command or group of commands. None of
them imports vLLM or torch at import time: ``marlin-pack --help`` imports neither.
"""
