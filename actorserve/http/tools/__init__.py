"""Tool calling: what a request's tools mean, the tools in the prompt, and the parsers that find calls in generated text."""
