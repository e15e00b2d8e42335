"""`quantkit serve`: the OpenAI-compatible HTTP API over the engine (`protocol`: fields and bodies;
`app`: the routes; `server`: the process under uvicorn)."""
