"""Pure-ML building blocks: tokenizers, policy loading (full precision or bitsandbytes 8/4-bit) and the
sampling engines (transformers; vLLM lazily).

Used by the inference peer (engines), the trainer (policy loading, tokenizer) and the tests.
Must not import hivemind or any networking code. Importing this package is cheap: torch and transformers
are imported by the submodules (``echo_p2p.ml.models``, ``echo_p2p.ml.engine``...), never here.
"""
