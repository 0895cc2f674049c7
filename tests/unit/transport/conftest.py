import concurrent.futures

import pytest


@pytest.fixture
def verifier():
    """The chunk-verifier thread a fetch session hashes chunks in (one, as in ``WeightFetcher``)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)
