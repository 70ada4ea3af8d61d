"""Which model the server runs: ``--model`` resolved to a version (resolver.py) through the MLflow registry
(client.py), loaded into an engine and swapped when the alias moves (source.py)."""
