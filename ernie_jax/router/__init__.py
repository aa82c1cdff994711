"""The router in front of prefill, decode and mixed servers (router/app.py)."""
