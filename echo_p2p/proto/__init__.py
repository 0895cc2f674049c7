"""Generated protobuf modules of echo_p2p's P2P RPCs (regenerate, never edit the ``*_pb2.py`` files).

``weights_pb2``: the weights transport (``echo_p2p.transport.weights.service``). Regenerate with
``python -m grpc_tools.protoc -I echo_p2p/proto --python_out=echo_p2p/proto echo_p2p/proto/weights.proto``.
Nothing is imported here, so importing the package stays free.
"""
