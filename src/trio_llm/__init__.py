"""trio-llm: an LLM inference server on trio and Vulkan whose models time-share one GPU."""

__version__ = "0.1.0"
