"""Weight encoding: policy versions as signed manifests plus verified chunks (pure ML, no networking).

- ``manifest``: the manifest schema, chunk verification and storage, the package's errors (no torch: the
  networking code imports it alone).
- ``config``: ``EncodingConfig``, how a trainer encodes the versions it publishes (no torch).
- ``codec``: ``WeightEncoder`` (publisher) and ``VersionAssembler`` (receiver): versions to chunks and back.
- ``patch``: lossless patches at serving precision (the 16-bit values that changed).
- ``quant``: blockwise 8-bit quantisation and the chunked payload stream.
- ``model_io``: ``PolicyWeights``, the weights a receiver holds, in and out of a model.

Names are imported from the module that defines them; nothing is imported here, so importing the package
imports neither torch nor hivemind.
"""
