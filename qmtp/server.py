"""python -m qmtp.server: the OpenAI-compatible HTTP server (qmtp/serve/server_cli.py, qmtp/serve/server.py)."""

from qmtp.serve.server_cli import cli

if __name__ == "__main__":
    cli()
