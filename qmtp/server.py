"""python -m qmtp.server: the OpenAI-compatible HTTP server (qmtp/serve/server.py)."""

from qmtp.serve.server import cli

if __name__ == "__main__":
    cli()
