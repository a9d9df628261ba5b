"""The p2p secondary tier: instances pull KV chunks from each other's host memory.

Design, the decisions and why:

Store = make available to peers. Attached to an engine (`SecondaryTier.attach_host`, called by
the manager with a `HostAccess`), an instance serves its host tier's chunks straight from
their slots: a transfer pins the slot by key (`HostAccess.pin`: a reader on the slot, so the
manager neither evicts nor rewrites it; a slot being written, state -1, is never served) and
unpins it when the bytes are sent. Nothing is copied into a second buffer, so offloading to
p2p costs no memory bandwidth and no capacity; the price is that the manager's slot state is
guarded by one lock, taken once per manager call, not per chunk, which keeps the manager's
bookkeeping within its ≤ 2 µs per chunk (`kvhal bench engine`). A cascaded store job only confirms the chunk is
served and ends inline (`JobBoard.finish`), still a few µs per chunk of job bookkeeping. Without a host tier
(the conformance suite, benches) a store copies the slot into the tier's own LRU store
(`max_bytes`) and that instance serves itself like any peer, so the suite's loads travel the
real network path (listener, HMAC challenge, pull, checksum); its restart and multi-process
tests add a keeper peer process (`conformance/p2p.py`) that pulls each stored chunk from the
storing process and serves it to the test's other instances and processes.

Directory, not probing. Every instance publishes what it serves as a feed: a snapshot, then
events numbered within a random per-start epoch (attached: exactly the host tier's gains and
losses as the manager reports them). Each instance follows every configured peer's feed over
one connection (`client.FeedLink`) into a `Directory`; `lookup` is a dict read. A gap in the
numbers (a subscriber that fell further behind than the feed's backlog) or a heartbeat whose
number differs from what was applied resubscribes (new connection, fresh snapshot). A broken
or silent feed (3 missed heartbeats) drops the peer's entries at once and reconnects with
backoff, so a restarted peer (new epoch) is resynchronised. A stale entry costs one failed
load (the peer answers "miss"), after which the entry is forgotten: then a miss.

Transfer. A load sends `get(key, n)`; the serving peer pins the chunk, sends `chunk(key, n)`,
the raw payload and `end(xxh3-128)`; the puller receives the payload with `recv_into` on a
memoryview of the reserved host slot (no payload copy in Python) and reports ok only after the
key, the length and the digest match. The server writes the three in one gathering `sendmsg`
from the pinned slot; sockets stay blocking with the kernel's SO_RCVTIMEO/SO_SNDTIMEO armed
from each deadline (1 sendmsg + 2 setsockopt + 1 recv per served chunk, measured with strace,
against 4 sends, 5 polls and 5 ioctls with Python's `settimeout`). Bulk and control share plain TCP (`transport.py`, one
small `Transport` interface for a later NIXL/RDMA transport): `kvhal bench p2p` measures zmq
frames against TCP for 2 MiB chunks (zmq 0.5x raw TCP in alternating passes on this loaded
2-core machine); TCP needs no intermediate message copy,
and using one framed TCP protocol for control too gives one codec, one handshake and explicit
connection loss (zmq reconnects and queues silently, which would hide a dead peer from the
directory). pyzmq is used by the bench's comparison only.

Security. Every connection passes a mutual HMAC-SHA256 challenge over the shared `auth_key`
(`auth.py`) before anything else is read or served. Frames are msgpack with a length prefix
(≤ 1 MiB), msgpack's own size caps and a per-message schema of exact fields, types, lengths
and ranges (`wire.py`); never pickle. Malformed, oversized or unexpected frames, wrong keys
or lengths, truncated payloads: the connection is dropped, a counter bumped, nothing else
changes (fuzzed with hypothesis in tests). The key never appears in a repr, log or error.
Authentication only: bytes are not encrypted; run peers on a trusted network.

Prefill/decode disaggregation. An orchestrator drives pulls through each request's
`kv_transfer_params` in vLLM 0.32's key names (`orchestration.py`), which reach the tier
through the engine's generic per-request hook (`SecondaryTier.open_request`, `lookup_for`,
`close_request`, `TierJob.request_id`; the engine does not tell tiers apart). A prefill leg
(`remote_decoder`) parks every chunk of its prompt under the orchestrator's id
(`parking.py`: pinned in the host tier through `HostAccess.pin`, also chunks it found
resident or loaded) and seals the record when the request ended and its last store was
handed over. A decode leg (`remote_prefiller`) answers HIT for its chunks (as vLLM's tier
does) and pulls each from the named peer with `fetch(id, key)`, no directory: the prefiller
answers as soon as the chunk is parked (chunks stream while the prefill computes the next),
refuses at once a chunk its sealed record lacks or that failed, and reaped or finished ids;
an id not heard of yet waits for its leg as long as the fetch waits (the decoder's
`fetch_wait_s`; the prefiller's `arrival_timeout_s` may bound it). The decoder's
`close_request` sends `done(id, gen)`, releasing the pins of the record generation `gen` it
fetched from (a late `done` of an earlier use of a reused id leaves the newer leg alone; a
`done` before the leg opened leaves a tombstone: the late leg parks nothing); a record
nobody fetches is reaped after `unbound_store_timeout_s`, its id refused for 60 s more
(vLLM's rules). A server thread waiting on a fetch checks every 0.2 s that its peer is still
connected, so a killed decoder holds nothing. `remote_kv_source` pulls by key from the named
peer (nothing parked), after asking it which of the request's chunks it holds (`probe.py`:
the lookup answers RETRY, the manager UNDECIDED and vLLM asks again, until the peer answered;
then HIT or MISS, so no chunk the peer lacks is claimed). A malformed `remote_decoder` block
fails the leg's stores (vLLM's rule, `orchestration.py`).

Faults. Every job carries a deadline of `timeout_s` from its submission, applied to every
socket call, so a killed, stopped or slow peer fails the job in time (a failed load is a
miss; the request recomputes). Threads: one accept thread and one per served connection;
one feed thread per peer; `num_threads` pull threads with pooled data connections; `close`
joins them all. TP ranks: in vLLM the tiers run only in the scheduler process (one manager
per instance) and every rank's worker reads the same shared host slot, so one pull's outcome
is what every rank sees; no rank talks to peers on its own.
"""
from .config import P2PConfig, parse_config
from .tier import P2PTier

__all__ = ["P2PConfig", "P2PTier", "parse_config"]
