"""OpenAI's Responses API: the routes, bodies, items, streamed events and background runs."""
