"""The weights transport: policy versions from trainers to inference peers, peer-assisted and verified.

- ``publisher``: the trainer side (encode, sign, serve, announce each version).
- ``fetch``: the receiver side (find trusted records, fetch, verify, apply atomically, serve what it holds),
  a package: ``fetch.fetcher.WeightFetcher`` is its API; its docstring maps the modules.
- ``service``: what a process serves (``WeightLibrary``, ``WeightsServicer``) and its P2P endpoint;
  ``stream`` reads one chunk stream on the client side.

Trust decisions are ``echo_p2p.guard.trust``; encoding and decoding are ``echo_p2p.weights``. Nothing is
imported here: importing the package stays free of hivemind and torch.
"""
