"""k25's OpenAI-compatible server: `k25 serve` (run.py), the app (app.py), admission
control (admission.py), request parsing (protocol.py) and metrics (metrics.py).

Nothing is imported here, so that the CLI does not load the web stack for other commands."""
