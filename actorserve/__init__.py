"""actorserve: an LLM serving runtime whose request lifecycles are explicit."""

__version__ = "0.1.0"
