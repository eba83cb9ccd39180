"""The wire keys of ``SamplingParams.extra_args`` and the payload's version: imported
by the package root, which must stay free of torch (the plugin entry point is cheap).
Their values are read by one rule, in :mod:`.request_args`."""

PAYLOAD_KEY = "nnsight"  # the intervention: a code block or a JSON spec
STREAM_KEY = "nnsight_stream"  # flag: deliver saves with every step's output
EDITS_KEY = "nnsight_edits"  # names of the installed edits a request selects
LOWER_KEY = "nnsight_lower"  # False runs the request's blocks as code (engine/lower.py)
VERSION = 1
