"""corral: serve many GGUF models through the Ollama and OpenAI APIs."""

__version__ = "0.1.0"
