"""``python -m aitlrt.cli``: the ``aitlrt`` command."""

from aitlrt.cli import main

main()
