"""`python -m infer serve`: an OpenAI-compatible server with continuous batching over the
speculative engine.

protocol (request bodies: JSON, schema, refusals; the error body), jobs (a body as the rows it
asks for, checked against the model), text (tokens to text, stop strings), scheduler (the device
loop over `peagle_jax.engine.slots`, its failures), metrics (Prometheus: ours and vLLM's names),
render (OpenAI's response objects and logprobs), respond (a request in flight: whole or
streamed), guard (keys, hosts, body limits, the route label, slow connections), app (the
routes), server (start and stop), cli (the command's flags).
"""
