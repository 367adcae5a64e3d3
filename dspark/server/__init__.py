"""dspark's OpenAI-compatible HTTP server (`dspark serve`; docs/SERVING.md).

Importing this package is cheap: FastAPI and uvicorn are imported by the modules that need
them (app.py and below), so `dspark --help` works without the serve extra.
"""
