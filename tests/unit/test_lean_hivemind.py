"""``net.lean_hivemind``: hivemind's DHT node, libp2p and validators import without torch, and every name of
hivemind's package ``__init__``s still resolves to the real object (each check in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO

HEAVY = "[m for m in ('torch', 'scipy', 'transformers') if m in sys.modules]"


def _run(code: str) -> str:
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=str(REPO)
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def test_the_dht_node_p2p_and_validators_import_without_torch():
    out = _run(
        "import sys\n"
        "from echo_p2p.net.lean_hivemind import use_lean_hivemind\n"
        "assert use_lean_hivemind()\n"
        "from hivemind.dht.node import DHTNode\n"
        "from hivemind.dht.crypto import RSASignatureValidator\n"
        "from hivemind.dht.schema import SchemaValidator\n"
        "from hivemind.p2p import P2P, PeerID\n"
        "from hivemind.utils import MSGPackSerializer, get_dht_time\n"
        "import hivemind\n"
        "print('VERSION', hivemind.__version__)\n"
        f"print('HEAVY', {HEAVY})\n"
    )
    assert "HEAVY []" in out, out
    assert "VERSION 1." in out, out


def test_names_of_the_package_inits_resolve_to_the_real_objects_on_first_use():
    out = _run(
        "import sys\n"
        "from echo_p2p.net.lean_hivemind import use_lean_hivemind\n"
        "use_lean_hivemind()\n"
        "import hivemind\n"
        "from hivemind.utils import MPFuture\n"
        "import hivemind.utils.mpfuture as real\n"
        "from hivemind.dht.dht import DHT\n"
        "print('SAME', MPFuture is real.MPFuture, hivemind.DHT is DHT, hivemind.dht.DHT is DHT)\n"
        "print('OPTIMIZER', hivemind.Optimizer.__name__)\n"
        f"print('HEAVY', {HEAVY})\n"
        "try:\n"
        "    hivemind.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print('MISSING', exc)\n"
    )
    assert "SAME True True True" in out, out
    assert "OPTIMIZER Optimizer" in out, out
    assert "'torch'" in out.split("HEAVY", 1)[1], out  # torch comes with the names that need it, not before
    assert "MISSING module 'hivemind' has no attribute 'no_such_name'" in out, out


def test_a_process_that_imported_hivemind_keeps_the_real_package():
    out = _run(
        "import sys, hivemind\n"
        "from echo_p2p.net.lean_hivemind import LeanPackage, use_lean_hivemind\n"
        "print('INSTALLED', use_lean_hivemind(), isinstance(sys.modules['hivemind'], LeanPackage))\n"
    )
    assert "INSTALLED False False" in out, out
