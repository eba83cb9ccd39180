"""The plan/executor core, in vLLM's worker: a request's blocks recorded into plans,
run batched over the step's rows (or as code), values served at hooks and taps. It
reaches vLLM only through :mod:`..boundary`."""
