"""The front door: the `tessera` command (cli/main.py), `tessera up` (the local stack) and deploy."""
