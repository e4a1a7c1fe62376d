"""`python -m infer serve`: an OpenAI-compatible server with continuous batching over the
speculative engine.

protocol (request bodies, error bodies), text (tokens to text, stop strings), scheduler (the
device loop over `peagle_jax.engine.slots`), metrics (Prometheus), app (the FastAPI endpoints),
server (start and stop), cli (the command's flags).
"""
