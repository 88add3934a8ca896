"""The HTTP front end (aiohttp): OpenAI-compatible, native (SGLang-style) and control routes,
request schemas, SSE streaming, Prometheus metrics and API-key auth.

Entry points: `app.build_app` (an app over a `Runtime`), `server.serve_async` (the whole
server from a `ServerConfig`), `serve_cli` (``actorserve serve``).
"""
