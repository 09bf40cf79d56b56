"""The OpenAI-compatible server (`verispec serve`): app.py the HTTP API, scheduler.py the thread
that drives the batched engine, metrics.py Prometheus metrics, static/ the playground page."""

from verispec.server.app import create_app, serve

__all__ = ["create_app", "serve"]
