"""The shared HTTP edge: the app, server and CLI, auth, errors, SSE, metrics, OpenAPI, app state, body types, and the generation plumbing every surface uses."""
