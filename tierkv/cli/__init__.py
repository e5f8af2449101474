"""The ``tierkv`` command line: :mod:`tierkv.cli.main` holds the table of subcommands
and the entry point, :mod:`tierkv.cli.exits` the exit statuses, and one module per
subcommand (``replay``, ``bench``, ``sim``, ``plan``, ``demo``, ``rig``, ``doctor``)
its parser and handler. Nothing is imported here.
"""
