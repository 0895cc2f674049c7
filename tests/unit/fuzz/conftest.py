import asyncio

import pytest

from echo_p2p.net.identity import load_or_create_identity


@pytest.fixture(scope="module")
def loop():
    """One event loop per fuzz module: the handlers' asyncio primitives stay bound to it across examples."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def identity():
    """A real RSA identity (signing manifests, owner keys of directory records)."""
    identity = load_or_create_identity(None)
    yield identity
    identity.cleanup()
