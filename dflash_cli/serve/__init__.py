"""`dflash serve`: the built pair behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""
