"""``python -m gateway`` runs the ``gateway`` command."""

from gateway.cli import run

run()
