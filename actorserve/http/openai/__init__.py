"""OpenAI's chat completions, completions and models routes, and what a chat request's reasoning means."""
