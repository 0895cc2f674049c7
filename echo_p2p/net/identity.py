"""A peer's identity: one RSA key that is both its libp2p identity and its DHT record signing key.

Owned here: creating, loading and validating identity files (libp2p's protobuf ``PrivateKey`` format,
the same file hivemind's ``--identity_path`` uses), deriving the peer id, and checking that a DHT
record's owner key belongs to the peer id written inside it. Because the signing key is the libp2p key,
nobody can announce records under another peer's id. Callers: the peers, the bootstrap, the DHT factory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

import base58

from echo_p2p.paths import expand_path


class IdentityError(RuntimeError):
    """An identity file that cannot be read, parsed or written."""


@dataclass
class Identity:
    """An RSA private key with its file on disk (a temporary one for ephemeral identities)."""

    path: str
    private_key: object  # hivemind.utils.crypto.RSAPrivateKey
    ephemeral: bool = False
    _tmpdir: str | None = field(default=None, repr=False)
    _finalizer: weakref.finalize | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # the temporary folder goes when ``cleanup`` is called, or else when the identity is garbage-collected
        # or the interpreter exits (holders that sign records without a DHT never call ``cleanup``)
        self._finalizer = (
            weakref.finalize(self, shutil.rmtree, self._tmpdir, True) if self._tmpdir is not None else None
        )

    @property
    def peer_id(self) -> str:
        """The libp2p peer id (base58), derived from the public key exactly as p2pd does."""
        return peer_id_from_rsa(self.private_key.get_public_key())

    @property
    def owner_key(self) -> bytes:
        """The ``[owner:ssh-rsa ...]`` marker that hivemind's RSASignatureValidator binds to this key."""
        from hivemind.dht.crypto import RSASignatureValidator

        return RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(
            b"_key_", self.private_key.get_public_key().to_bytes()
        )

    def public_key_bytes(self) -> bytes:
        """The OpenSSH encoding of the public key (what manifests and trust files carry)."""
        return self.private_key.get_public_key().to_bytes()

    def cleanup(self) -> None:
        """Remove an ephemeral identity's temporary folder (persistent identities are kept)."""
        if self._finalizer is not None:
            self._finalizer()  # runs once: rmtree of the temporary folder


def load_or_create_identity(path: str | None) -> Identity:
    """Load the identity at ``path``, create it (mode 0400) when missing, or make an ephemeral one if None."""
    from hivemind.p2p import P2P

    if path is None:
        tmpdir = tempfile.mkdtemp(prefix="echo-id-")
        tmp_path = os.path.join(tmpdir, "identity.key")
        P2P.generate_identity(tmp_path)
        return Identity(tmp_path, _read_private_key(tmp_path), ephemeral=True, _tmpdir=tmpdir)
    path = os.path.abspath(expand_path(path))
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
            P2P.generate_identity(path)
        except OSError as exc:
            raise IdentityError(f"cannot create identity file {path}: {exc.strerror or exc}") from exc
    return Identity(path, _read_private_key(path))


def _read_private_key(path: str):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from hivemind.proto import crypto_pb2
    from hivemind.utils.crypto import RSAPrivateKey

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise IdentityError(f"cannot read identity file {path}: {exc.strerror or exc}") from exc
    try:
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("only RSA identities are supported")
        key = serialization.load_der_private_key(proto.data, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except Exception as exc:  # protobuf / cryptography raise many types on garbage
        raise IdentityError(f"identity file {path} is not a valid libp2p RSA private key ({exc})") from exc
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)
    private_key._private_key = key
    return private_key


def peer_id_from_rsa(public_key) -> str:
    """libp2p peer id of an RSA public key (hivemind ``RSAPublicKey``): multihash(sha256(pb(DER)))."""
    from cryptography.hazmat.primitives import serialization
    from hivemind.proto import crypto_pb2

    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = hashlib.sha256(encoded).digest()
    return base58.b58encode(bytes([0x12, len(digest)]) + digest).decode()


def peer_id_from_owner_key(owner_key: bytes) -> str | None:
    """Peer id of the key in a ``[owner:ssh-rsa ...]`` subkey, or None when it does not parse."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPublicKey

    found = RSASignatureValidator._PUBLIC_KEY_RE.findall(owner_key) if isinstance(owner_key, bytes) else []
    if len(found) != 1:
        return None
    try:
        return peer_id_from_rsa(RSAPublicKey.from_bytes(found[0]))
    except Exception:
        return None
