"""The session protocol in one sans-IO file (docs/internals.md section 6); no I/O, no asyncio, no clocks, no threads, no NumPy.

A `ClientConnection` and a `WorkerConnection` take frames in and give events and frames out; the
pumps (client/session.py, server/session.py) move bytes between them and a Link, and act on the
events. Arrays travel as buffers the caller provides (anything C-contiguous with the buffer
protocol); the connection never allocates one itself, it asks the caller's `target`.

Rules (everything that changes the state of a session's protocol lives in this file):
- Frames are sealed and opened through the session's Channel (protocol/channel.py), and go out in
  the order they were sealed: a connection seals lazily, as the pump iterates what it was given,
  so the pump sends one iterator's frames whole before asking for the next.
- Batches carry seq 1, 2, 3, ... in the order submitted. The client keeps every batch until a
  Reply's `ack` reaches its seq (`Acknowledged` says how many batches and upload bytes that freed).
- A batch tells the worker, as `received`, the highest Reply ack whose messages and result bytes
  the client took in whole; the worker forgets the replies up to it (`ReplyLog`) and keeps the
  others, to send again when the session resumes on a new link (protocol/resume.py).
- `GraphUnknown(seq, gid)`: the client resends, in full and in order, every unacknowledged batch
  from `seq` on that has begun to go out, the first with the graph's `Register` put in front, ahead
  of anything not yet sent; a GraphUnknown for a batch already acknowledged is stale and ignored.
  The worker (server/runner.py) discards every batch until that seq comes again.
- Repeat (step templates): the client sends a batch that is the one it sent just before with ids
  shifted as a `Repeat` (messages.repeat_of); the worker expands it against the batch it received
  just before (messages.expand_batch). Frames arrive in the order sealed, so both ends hold the
  same template. A batch of uploads only (`uploads_only`: a DataLoader's next host batch, sent
  between two steps) is no template: the batch before it stays the template on both ends, so the
  step after it still repeats the step before. A resent batch goes in full; a resume forgets both
  templates.
- Layout: uploads (results) travel inline in the MESSAGE frame's plaintext, in message order, while
  they fit in one chunk together; the rest follow in BULK frames of at most the chunk size, in
  message order. The client's chunk size is `chunk_size` (the worker's), or `pipeline_chunk` for a
  batch of at most PIPELINE_BATCH_BYTES over a link that pipelines uploads (the worker opens BULK
  frames of any size, in order: nothing on its side depends on the client's chunk size). A batch
  (reply) too large for one frame with its inline bytes goes all in BULK.
  A reply MESSAGE frame holds at most MAX_REPLY_FRAME_BYTES of msgpack and MAX_REPLY_MESSAGES
  messages; longer replies are split into several, each acking the same batch.
- Flow control: a client has at most MAX_UNACKED_BATCHES batches and MAX_UNACKED_BYTES of upload
  bytes unacknowledged (`within_flow`, the one rule both ends apply); the worker refuses a batch
  whose seq runs more than MAX_UNACKED_BATCHES past the acks it has sent, or whose uploads take the
  unacknowledged bytes past MAX_UNACKED_BYTES (one batch alone may, when nothing else is unacked).
- Anything the peer sends that breaks these rules raises ProtocolError, and the session is over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, assert_never

from emberlink.errors import ProtocolError
from emberlink.protocol import messages as m
from emberlink.protocol.channel import (
    BULK,
    HEADER_SIZE,
    LENGTH_FIELD,
    MAX_PLAINTEXT,
    MESSAGE,
    OVERHEAD,
    SMALL_FRAME,
    Channel,
    Kind,
    pack_frames,
    split_frames,
)
from emberlink.protocol.limits import (
    MAX_REPLY_FRAME_BYTES,
    MAX_REPLY_MESSAGES,
    MAX_UNACKED_BATCHES,
    MAX_UNACKED_BYTES,
)

Frame = bytes | bytearray
"""A sealed frame, or a blob of frames, ready for the Link."""

Buffer = Any
"""An array's bytes: anything C-contiguous with the buffer protocol (a NumPy array, a memoryview)."""

MIN_CHUNK_SIZE = 4096
MAX_CHUNK_SIZE = 4 << 20
SMALL_REPLY_MESSAGES = 64
"""A reply of at most this many messages is encoded once, as one frame (the common case)."""
SMALL_REPLY_BULK = 64 << 10
"""A reply whose results total at most this goes out as one blob, at once."""
PIPELINE_BATCH_BYTES = 1 << 20
"""A batch of at most this many upload bytes (a host batch, not a data set) is laid out in chunks
of the connection's `pipeline_chunk`, where it has one; larger ones in `chunk_size` chunks."""


Prediction = tuple[tuple[m.ClientMessage, ...], m.Repeat, tuple[m.ClientMessage, ...]] | None
"""A batch worked out ahead (`predict`): the template it repeats, the Repeat, and its messages."""


def _prediction(
    template: tuple[m.ClientMessage, ...] | None, repeat: m.Repeat | None, predicted: Prediction
) -> Prediction:
    """The batch that repeats `repeat`'s shifts and patches (no new bindings) on `template`,
    expanded; the prediction made already if it is for this template, or none to make (an id
    would leave its range: no such batch can come, or it will be refused as it comes).

    A patched Repeat is expanded with its own patches even where the next batch will patch other
    ids (batches uploaded beforehand and cycled, every step): the client checks and encodes such
    a batch against the expansion but for the patched ids (`ClientConnection._plan`), and the
    worker repatches it (`WorkerConnection._on_expected`), each cheaper as the batch comes than
    a search or a full decoding; the expansion (~5 µs) is made after a write or a reply, while
    the other end works."""
    if template is None or repeat is None or repeat.bindings is not None:
        return predicted
    if predicted is not None and predicted[0] is template:
        return predicted
    try:
        expanded = m.expand(repeat, template)
    except ProtocolError:
        return predicted
    return (template, repeat, expanded)


def uploads_only(messages: Sequence[m.ClientMessage]) -> bool:
    """Whether a batch is uploads and nothing else (and not empty): it leaves the template of
    the next Repeat as it was, on both ends (the module docstring's "Repeat")."""
    for msg in messages:
        if type(msg) is not m.Upload:
            return False
    return bool(messages)


_PREDICTABLE = (m.Result, m.Done)
"""Answers whose next instance `_expected_reply` may foresee: a Read's Result, a Sync's Done."""
_ANSWERED = {m.Read: m.Result, m.Sync: m.Done}


@dataclass(slots=True)  # (not frozen, as _Foreseen: private, made every step; frozen costs ~1 µs more)
class _ExpectedReply:
    """A reply foreseen (`ClientConnection.predict`): its msgpack bytes, the Reply they decode to,
    the inline bytes that follow them, and, when it holds only inline Results, where each
    Result's bytes go (`(rid, value, view)` from the target, asked ahead), else None."""

    data: bytes
    reply: m.Reply
    tail: int
    targets: tuple[tuple[int, Any, memoryview | None], ...] | None


def _expected_reply(
    last: m.Reply | None, seq: int, sent: tuple[m.ClientMessage, ...] | None, unacked: int
) -> tuple[bytes, m.Reply] | None:
    """The reply to batch `seq` (whose messages are `sent`), and its msgpack bytes, if a batch is
    unacknowledged and it answers its requests as `last` did the batch before (each Read's Result
    the same dtype, shape and size, each Sync a Done); None if that cannot be foreseen. Its ack
    `seq` acks any batch before it too (a DataLoader's upload batch, whose ack the worker lets
    ride on this reply); a reply that is not this one is told apart by its bytes."""
    if last is None or sent is None or not unacked or not last.messages:
        return None
    answers: list[m.WorkerMessage] = []
    before = iter(last.messages)
    for msg in sent:
        kind = _ANSWERED.get(type(msg))
        if kind is None:
            if type(msg) is m.Stats:
                return None
            continue
        was = next(before, None)
        if type(was) is not kind:
            return None
        rid: int = msg.rid  # type: ignore[union-attr]
        if type(was) is m.Result:
            answers.append(m.Result(rid, was.dtype, was.shape, was.nbytes, was.inline))
        else:
            answers.append(m.Done(rid))
    if next(before, None) is not None:
        return None
    reply = m.Reply(seq, tuple(answers))
    return m.encode_reply(reply), reply


def within_flow(batches: int, nbytes: int, more: int, max_batches: int, max_bytes: int) -> bool:
    """Whether one more batch of `more` upload bytes may go out with `batches` batches and `nbytes`
    bytes unacknowledged: under both limits, or (bytes) nothing unacknowledged at all."""
    return batches < max_batches and not (nbytes and nbytes + more > max_bytes)


def chunk_size_of(limits: Mapping[str, int], default: int) -> int:
    """The BULK chunk size a client uses: the worker's announced one, within bounds."""
    return min(max(limits.get("chunk_size", default), MIN_CHUNK_SIZE), MAX_CHUNK_SIZE)


def _bytes_of(buffer: Buffer) -> memoryview:
    return memoryview(buffer).cast("B")


# -- events ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Acknowledged:
    """A Reply's ack freed `batches` kept batches carrying `nbytes` upload bytes (client), and
    the staging buffers of those that had one (`Staged`): no frame will be sealed from them
    again, so their bytes are the caller's to reuse."""

    batches: int
    nbytes: int
    staged: tuple[Staged, ...] = ()


@dataclass(frozen=True, slots=True)
class ResultArrived:
    """A Read's value has arrived whole, in what the caller's target gave for it (client)."""

    rid: int
    value: Any


@dataclass(frozen=True, slots=True)
class ResultProgress:
    """`nbytes` more bytes of a result arriving in BULK frames; `remaining` still to come (client)."""

    rid: int
    nbytes: int
    remaining: int


@dataclass(frozen=True, slots=True)
class ReplyReady:
    """A Sync (`value` None) or Stats (`value` the figures) is answered (client)."""

    rid: int
    value: dict[str, m.StatValue] | None


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """The worker answered request `rid` with an error (client)."""

    rid: int
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """The worker ended the session, saying why (client)."""

    error: m.Error


@dataclass(frozen=True, slots=True)
class GraphUnknownResent:
    """The worker lacked graph `gid` for batch `seq`: that batch and the later ones go again (client)."""

    seq: int
    gid: bytes


ClientEvent = (
    Acknowledged
    | ResultArrived
    | ResultProgress
    | ReplyReady
    | RequestFailed
    | SessionEnded
    | GraphUnknownResent
)


@dataclass(frozen=True, slots=True)
class BatchArrived:
    """A batch's MESSAGE frame, expanded and checked (worker). Its inline uploads' bytes are
    `plaintext[start:]`, in message order. The pump says where each BULK upload's bytes go
    (`WorkerConnection.expect`); the batch is whole when that is nothing, or at `BulkComplete`."""

    batch: m.Batch
    plaintext: bytes | memoryview
    start: int


@dataclass(frozen=True, slots=True)
class BulkComplete:
    """The last BULK byte of the batch that arrived last is in (worker)."""


WorkerEvent = BatchArrived | BulkComplete


# -- the client ------------------------------------------------------------------------------------


class ClientCounters(Protocol):
    """The figures a client connection keeps (client/session.py's Counters has them)."""

    batches_sent: int
    batches_resent: int
    batches_repeated: int
    graph_cache_misses: int


@dataclass(slots=True)
class _Counters:
    batches_sent: int = 0
    batches_resent: int = 0
    batches_repeated: int = 0
    graph_cache_misses: int = 0


@dataclass(frozen=True, slots=True)
class Staged:
    """A batch's upload bytes, already laid out back to back in `buffer` from `start` on (the
    client copied each upload there as it was made: RemoteExecutor.host_array), with room before
    them for the batch's head: sealed as one plaintext where it lies, with no join."""

    buffer: memoryview  # writable, one byte an item
    start: int


@dataclass(slots=True)
class OutBatch:
    """A batch as the client keeps it until acknowledged: its messages and the uploads' arrays."""

    seq: int
    messages: list[m.ClientMessage]
    bulks: list[Buffer]
    nbytes: int
    staged: Staged | None = None


@dataclass(slots=True)
class _Arriving:
    """Where the bytes of a Result (client) or an Upload (worker) announced for BULK frames go."""

    rid: int
    value: Any
    view: memoryview | None  # None: opened into scratch and forgotten
    remaining: int


ResultTarget = Callable[[m.Result], tuple[Any, memoryview | None]]
"""The client's: `(value, view of its bytes)` for a Result, view None when nobody wants it (an
empty result arrives whatever its view)."""


@dataclass(slots=True)
class _Foreseen:
    """The client's next batch worked out ahead (`ClientConnection.predict`) from a prediction: if
    the batch framed next after `template` is `seq`, goes with `received`, and its messages are
    `raw` (as submitted: no upload marked inline), it goes as `head` (a Batch of `repeat` alone)
    with its uploads' bytes inline after it, or, where `inline` says which go inline (one flag per
    upload with bytes), the others in BULK frames after it; and is `messages` once laid out (the
    next template)."""

    template: tuple[m.ClientMessage, ...]
    raw: tuple[m.ClientMessage, ...]  # `messages` itself where no upload is marked inline
    messages: tuple[m.ClientMessage, ...]
    repeat: m.Repeat
    seq: int
    received: int
    chunk_size: int
    head: bytes
    inline: tuple[bool, ...] | None  # None: every upload inline
    # A patched Repeat's: where its patches lie among the messages' ids (`messages.patch_sites`)
    # and the ids it patches there; a batch with other ids there is the same Repeat patching them
    # (batches uploaded beforehand and cycled), checked and encoded as it comes (`_plan`).
    sites: tuple[tuple[int, int, int], ...] | None = None
    ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()
    before: bytes = b""  # `messages.repeat_batch_parts`: the head less its patches' array
    after: bytes = b""


def _patch_layout(
    patches: tuple[tuple[int, int], ...], messages: tuple[m.ClientMessage, ...]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int, int], ...] | None]:
    """A patched Repeat's patch positions, its ids there, and where those lie among its expanded
    `messages` (`messages.patch_sites`): what both ends keep to take a batch that patches other
    ids at the same positions (batches uploaded beforehand and cycled)."""
    positions = tuple(at for at, _ in patches)
    return positions, tuple(tid for _, tid in patches), m.patch_sites(messages, positions)


def _foresee(
    predicted: Prediction, template: tuple[m.ClientMessage, ...] | None, seq: int, received: int, room: int
) -> _Foreseen | None:
    """The batch `seq` that repeats `predicted` after `template`, sent with `received` and laid out
    with `room` (chunk size): as `_frames` would send it, if each upload with bytes of it is laid
    out as the template's was (inline where the layout rule, `_layout`, puts it inline; in BULK
    frames where it does not: a host batch over a link that pipelines uploads); None otherwise."""
    if predicted is None or predicted[0] is not template:
        return None
    chunk_size = room
    raw: list[m.ClientMessage] = []
    inline: list[bool] = []
    for msg in predicted[2]:
        if type(msg) is m.Upload and msg.nbytes:
            fits = msg.nbytes <= room
            if msg.inline is not fits:
                return None
            if fits:
                room -= msg.nbytes
                msg = m.Upload(msg.tid, msg.dtype, msg.shape, msg.nbytes)
            inline.append(fits)
        raw.append(msg)
    _, repeat, messages = predicted
    head = m.encode_repeat_batch(seq, repeat, received)
    flags = None if all(inline) else tuple(inline)
    same = messages if not inline else tuple(raw)
    if repeat.patches is None or repeat.bindings is not None:
        return _Foreseen(template, same, messages, repeat, seq, received, chunk_size, head, flags)
    positions, ids, sites = _patch_layout(repeat.patches, messages)
    before, after = m.repeat_batch_parts(seq, repeat, received)
    return _Foreseen(
        template,
        same,
        messages,
        repeat,
        seq,
        received,
        chunk_size,
        head,
        flags,
        sites,
        ids,
        positions,
        before,
        after,
    )


class ClientConnection:
    """The client's end of one session: batches in, frames out; frames in, events out."""

    def __init__(
        self,
        channel: Channel,
        chunk_size: int,
        graphs: Mapping[bytes, bytes],
        target: ResultTarget,
        *,
        templates: bool = True,
        counters: ClientCounters | None = None,
        pipeline_chunk: int = 0,
    ) -> None:
        self.channel = channel
        self.chunk_size = chunk_size
        # The chunk size of a batch of at most PIPELINE_BATCH_BYTES (0: `chunk_size`): over a link
        # that pipelines uploads (client/session.py), each of its BULK frames goes as it is sealed.
        self.pipeline_chunk = pipeline_chunk
        self.templates = templates
        self.counters: ClientCounters = counters if counters is not None else _Counters()
        self.closing = False  # a Close was submitted: the session ends with it
        self._graphs = graphs
        self._target = target
        self._next_seq = 1
        self._unacked: dict[int, OutBatch] = {}
        self._queue: deque[OutBatch] = deque()
        self._sent_upto = 0  # highest seq whose frames have begun to be sealed
        self._template: tuple[m.ClientMessage, ...] | None = None
        # (template, Repeat, what that Repeat expands the template to): the next batch if it
        # repeats the last one's shifts (`predict`); keyed on the template it was made from.
        self._predicted: Prediction = None
        self._foreseen: _Foreseen | None = None  # the next batch as it would go (`predict`)
        self._repeat: m.Repeat | None = None  # the Repeat the last batch went as
        self._sent_seq = 0  # the last batch sealed that is `_template` (not uploads only)
        # The last reply decoded in full, if it held only Results and Dones, and the reply the
        # next one is likely to be (that one with the last batch's ack and request ids) with its
        # msgpack bytes (`predict`).
        self._last_reply: m.Reply | None = None
        self._expected: _ExpectedReply | None = None
        self._results: deque[_Arriving] = deque()
        self._received = 0  # the last Reply ack taken in whole
        self._receiving = 0  # the ack of the reply whose result bytes are still arriving

    @property
    def received(self) -> int:
        """The highest Reply ack taken in whole (told to the worker with every batch and on resume)."""
        return self._received

    @property
    def submitted(self) -> int:
        """The highest seq submitted."""
        return self._next_seq - 1

    @property
    def unacked(self) -> int:
        """How many batches wait for an ack."""
        return len(self._unacked)

    def submit(
        self, messages: list[m.ClientMessage], bulks: list[Buffer], nbytes: int, staged: Staged | None = None
    ) -> int:
        """Queue one batch (`bulks`: one buffer per Upload with bytes, in order; `staged`: where
        their bytes already lie back to back, if they do); its seq."""
        batch = OutBatch(self._next_seq, messages, bulks, nbytes, staged)
        self._next_seq += 1
        if messages and type(messages[-1]) is m.Close:
            self.closing = True
        self._unacked[batch.seq] = batch
        self._queue.append(batch)
        return batch.seq

    def pending(self) -> bool:
        """Whether a batch waits to go out."""
        return bool(self._queue)

    def next_frames(self) -> Iterator[Frame] | None:
        """The frames of the next queued batch (sealed as iterated), or None when none waits."""
        if not self._queue:
            return None
        return self.next_frames_of()[2]

    def next_frames_of(self) -> tuple[int, int, Iterator[Frame]]:
        """`(seq, upload bytes, frames)` of the next queued batch; one must be queued (`pending`)."""
        batch = self._queue.popleft()
        resent = batch.seq <= self._sent_upto
        if resent:
            self.counters.batches_resent += 1
        self._sent_upto = max(self._sent_upto, batch.seq)
        self.counters.batches_sent += 1
        return batch.seq, batch.nbytes, self._frames(batch, resent)

    def _chunk_of(self, nbytes: int) -> int:
        """The chunk size of a batch of `nbytes` upload bytes (see `pipeline_chunk`)."""
        pipeline = self.pipeline_chunk
        return pipeline if pipeline and nbytes <= PIPELINE_BATCH_BYTES else self.chunk_size

    def _layout(
        self, batch: OutBatch, room: int
    ) -> tuple[tuple[m.ClientMessage, ...], list[memoryview], list[memoryview]]:
        """The batch's messages with the uploads that travel inline marked, those uploads' bytes
        and the others' (inline: in message order, every upload that still fits in `room`
        together with the inline ones before it)."""
        if not batch.bulks:
            return tuple(batch.messages), [], []
        messages: list[m.ClientMessage] = []
        tail: list[memoryview] = []
        later: list[memoryview] = []
        arrays = iter(batch.bulks)
        for msg in batch.messages:
            if type(msg) is m.Upload and msg.nbytes:
                data = _bytes_of(next(arrays))
                if msg.nbytes <= room:
                    room -= msg.nbytes
                    tail.append(data)
                    msg = m.Upload(msg.tid, msg.dtype, msg.shape, msg.nbytes, True)
                else:
                    later.append(data)
            messages.append(msg)
        return tuple(messages), tail, later

    def _plan(
        self, batch: OutBatch, resent: bool, chunk: int
    ) -> tuple[tuple[m.ClientMessage, ...], list[memoryview], list[memoryview], m.Repeat | None, bytes]:
        """How `batch` goes out with chunks of `chunk` bytes: its messages laid out, its inline
        uploads' bytes and the others', the Repeat it goes as (or None), and the encoded head of
        its MESSAGE frame."""
        template = self._template
        fast = self._foreseen
        if (
            fast is not None
            and fast.seq == batch.seq
            and fast.template is template
            and fast.received == self._received
            and fast.chunk_size == chunk
            and self.templates
            and not resent
        ):
            head, laid, again = fast.head, fast.messages, fast.repeat
            sent = tuple(batch.messages)
            ids = None
            same = m.same_messages(fast.raw, sent)
            if not same and fast.sites is not None:  # other ids at the patches (batches cycled)
                ids = m.ids_if_repatched(fast.raw, sent, fast.sites)
                same = ids is not None
                if ids is not None and ids != fast.ids:
                    laid = sent if fast.raw is laid else m.repatch(laid, fast.sites, ids)
                    head = b""  # made below: this Repeat with other ids
            if same:
                # The batch `predict` worked out, checked: no layout, no search, no encoding but
                # of the other ids' patches.
                if not head and ids is not None:
                    positions = fast.positions
                    again = m.Repeat(
                        again.id_shift, again.rid_shift, None, tuple(zip(positions, ids, strict=True))
                    )
                    head = b"".join((fast.before, m.encode_patches(positions, ids), fast.after))
                later: list[memoryview] = []
                if fast.inline is None:
                    tail = [_bytes_of(b) for b in batch.bulks]
                else:
                    tail = []
                    for b, inline in zip(batch.bulks, fast.inline, strict=True):
                        (tail if inline else later).append(_bytes_of(b))
                if len(head) + sum(len(t) for t in tail) <= MAX_PLAINTEXT:
                    return laid, tail, later, again, head
        messages, tail, later = self._layout(batch, chunk)
        wire = messages
        repeat = None
        if self.templates and not resent and template is not None:
            predicted = self._predicted
            if predicted is not None and predicted[0] is template and m.same_messages(predicted[2], messages):
                repeat = predicted[1]  # the shifts of the batch before again: checked, not searched
            else:
                repeat = m.repeat_of(template, messages, self._repeat)
            if repeat is not None:
                wire = (repeat,)
        head = m.encode_batch(m.Batch(batch.seq, wire, self._received))
        if tail and len(head) + sum(len(t) for t in tail) > MAX_PLAINTEXT:
            messages, tail, later = self._layout(batch, 0)  # a huge batch: every upload in BULK
            repeat = None
            head = m.encode_batch(m.Batch(batch.seq, messages, self._received))
        return messages, tail, later, repeat, head

    def _frames(self, batch: OutBatch, resent: bool) -> Iterator[Frame]:
        channel = self.channel
        chunk = self._chunk_of(batch.nbytes)
        messages, tail, later, repeat, head = self._plan(batch, resent, chunk)
        self._foreseen = None
        if repeat is not None:
            self.counters.batches_repeated += 1
        if not uploads_only(messages):
            self._template = messages
            self._repeat = repeat
            self._sent_seq = batch.seq
        if not tail:
            yield channel.seal(head, MESSAGE)
        else:
            staged = batch.staged
            size = sum(len(t) for t in tail)
            start = 0 if staged is None or later or size < SMALL_FRAME else staged.start - len(head)
            if start > 0:  # every upload inline, already back to back after room for the head
                assert staged is not None
                staged.buffer[start : staged.start] = head
                parts: list[m.BytesLike] = [staged.buffer[start : staged.start + size]]
            else:
                parts = [head, *tail]
            yield channel.seal_parts(parts, MESSAGE)
        for data in later:
            yield from channel.seal_chunks(data, chunk)

    def predict(self) -> None:
        """Work out, while nothing waits (the pump calls it once a batch is out), the batch that
        repeats the last one's shifts, so that the next batch, if it is that one, goes as the same
        Repeat at the cost of a comparison. Measured on the jitted tiny step's batches (four
        messages, 2,000 replayed through a connection pair): next_frames_of and packing went from
        18.6 to 13.1 µs of CPU a batch. That batch is also laid out and its head encoded here
        (`_Foreseen`), so that sending it costs a comparison: the jitted tiny step over tcp, from
        the user's thread entering next_frames_of to its seal, 13.7 -> 7.6 µs.

        And the reply to the batch just sent, when it is the only one unacknowledged and the last
        reply answered the same requests: then, if the reply's msgpack bytes are those, it is
        taken without decoding (`open_reply`). Measured on the small MLP's jitted step over tcp
        (bench/step_trace.py): decoding a loss's reply is ~40 µs of the thread that wakes for it
        (cold caches after the step's 400 KB write and the wait), the comparison ~1 µs.

        Batches uploaded beforehand and cycled patch other ids every step: the last Repeat is
        expanded with its own patches, and `_plan` takes a batch that is that expansion but for
        the ids at the patches' positions (`messages.ids_if_repatched`, one pass) as the same
        Repeat patching its ids, encoding only the new patches (as the worker takes such a
        batch in). Measured on the small MLP's step on batches uploaded beforehand (2-core
        machine, client and a NumPy worker on a core each, perf_counter_ns around `_plan` on
        the user's thread, medians of 380 steps, this tree against the one before, back to
        back): 27.0-33.9 -> 13-17 µs; the connection alone on the same batches (no I/O, 3,000
        steps, the trees alternated twice): submit, next_frames_of and sealing 26.6-31.4 ->
        15.0-15.1 µs (the resident loader's batches, 13.9-14.0 -> 11.7-11.8 µs, with the
        bindings' identity check and the channel's inlined seal), for ~15 µs more of
        `predict` after the write, while the worker runs the step."""
        template, repeat = self._template, self._repeat
        predicted = self._predicted = _prediction(template, repeat, self._predicted)
        if self.templates:
            uploads = 0
            if predicted is not None and predicted[0] is template:
                uploads = sum(x.nbytes for x in predicted[2] if type(x) is m.Upload)
            self._foreseen = _foresee(
                predicted, template, self._next_seq, self._sent_seq, self._chunk_of(uploads)
            )
        expected = _expected_reply(self._last_reply, self._sent_seq, self._template, len(self._unacked))
        self._expected = None if expected is None else self._expecting(*expected)

    def _expecting(self, data: bytes, reply: m.Reply) -> _ExpectedReply:
        """The foreseen `reply`, with its Results' targets asked for now when all are inline: the
        jitted tiny step's loss then costs the thread that takes it a copy (its target, its
        decoding and its checks are done here, while the worker works)."""
        tail = 0
        targets: list[tuple[int, Any, memoryview | None]] | None = []
        for msg in reply.messages:
            if type(msg) is m.Result and msg.inline:
                tail += msg.nbytes
                if targets is not None:
                    targets.append((msg.rid, *self._target(msg)))
            else:
                targets = None
        return _ExpectedReply(data, reply, tail, None if targets is None else tuple(targets))

    def receive(self, blob: m.BytesLike) -> list[ClientEvent]:
        """Take in one blob of the worker's frames; what happened, in order."""
        events: list[ClientEvent] = []
        view = memoryview(blob).cast("B")
        if (
            len(view) > HEADER_SIZE
            and view[1] == MESSAGE
            and int.from_bytes(view[LENGTH_FIELD]) == len(view) - HEADER_SIZE
        ):
            # One MESSAGE frame, a step's reply: opened as it is (`Channel.open` checks its whole
            # header, as `split_frames` would first).
            self._on_reply(view, events)
            return events
        for frame in split_frames(view):
            if frame[1] == BULK:
                self._on_bulk(frame, events)
            else:
                self._on_reply(frame, events)
        return events

    def open_reply(self, frame: memoryview) -> tuple[m.Reply, bytes, int]:
        """Open and decode one reply MESSAGE frame, changing nothing but the channel: the Reply,
        its plaintext and where its inline results' bytes start (tests read the wire with it)."""
        kind, plaintext = self.channel.open(frame)
        if kind is not MESSAGE:
            raise ProtocolError(f"expected a MESSAGE frame, got {kind.name}")
        expected = self._expected
        if expected is not None and plaintext.startswith(expected.data):
            # msgpack is self-delimiting: these bytes decode to exactly that reply
            reply, start = expected.reply, len(expected.data)
            if len(plaintext) - start != expected.tail:
                m.check_reply_tail(reply, len(plaintext) - start)  # (raises, saying why)
        else:
            reply, start = m.decode_reply_prefix(plaintext)
            m.check_reply_tail(reply, len(plaintext) - start)
        return reply, plaintext, start

    def _on_reply(self, frame: memoryview, events: list[ClientEvent]) -> None:
        if self._results:
            raise ProtocolError("worker sent a reply before the bytes of its previous result")
        reply, plaintext, start = self.open_reply(frame)
        expected, self._expected = self._expected, None
        if expected is not None and reply is expected.reply and expected.targets is not None:
            # the reply foreseen, all inline Results (so predictable again): their bytes copied
            self._last_reply = reply
            self._acknowledge(reply.ack, events)
            data = memoryview(plaintext)
            for (rid, value, view), msg in zip(expected.targets, reply.messages, strict=True):
                nbytes = msg.nbytes  # type: ignore[union-attr]
                if view is not None:
                    view[:] = data[start : start + nbytes]
                    events.append(ResultArrived(rid, value))
                start += nbytes
            self._received = max(self._received, reply.ack)
            return
        self._last_reply = reply if all(type(x) in _PREDICTABLE for x in reply.messages) else None
        self._acknowledge(reply.ack, events)
        for msg in reply.messages:
            if type(msg) is m.Result and msg.inline:
                value, view = self._target(msg)
                if view is not None:
                    view[:] = memoryview(plaintext)[start : start + msg.nbytes]
                    events.append(ResultArrived(msg.rid, value))
                start += msg.nbytes
            else:
                self._on_message(msg, events)
        if self._results:
            self._receiving = reply.ack  # taken in whole once its results' bytes are in
        elif reply.ack > self._received:
            self._received = reply.ack

    def _on_message(self, msg: m.WorkerMessage, events: list[ClientEvent]) -> None:
        match msg:
            case m.Result():
                value, view = self._target(msg)
                if msg.nbytes == 0:
                    events.append(ResultArrived(msg.rid, value))
                else:
                    self._results.append(_Arriving(msg.rid, value, view, msg.nbytes))
            case m.Done():
                events.append(ReplyReady(msg.rid, None))
            case m.StatsReply():
                events.append(ReplyReady(msg.rid, dict(msg.stats)))
            case m.Error():
                if msg.rid == 0:
                    events.append(SessionEnded(msg))
                else:
                    events.append(RequestFailed(msg.rid, msg.code, msg.message))
            case m.GraphUnknown():
                if self._resend(msg):
                    events.append(GraphUnknownResent(msg.seq, msg.gid))
            case _:
                assert_never(msg)

    def _acknowledge(self, ack: int, events: list[ClientEvent]) -> None:
        batches = nbytes = 0
        staged: list[Staged] = []
        unacked = self._unacked
        while unacked:
            seq = next(iter(unacked))
            if seq > ack:
                break
            batch = unacked.pop(seq)
            nbytes += batch.nbytes
            batches += 1
            # Its buffer is free once no frame of it can be sealed again: acknowledged (never
            # resent, not on a resume either) and begun. A worker acks a batch only once it has
            # all of it; one that acked a batch not yet begun would still be sent it, from that
            # buffer, so that one is not freed (one that acks a batch half sent gets the rest of
            # it from a buffer the client may have reused: bytes it was about to be sent anyway).
            if batch.staged is not None and seq <= self._sent_upto:
                staged.append(batch.staged)
        if batches:
            events.append(Acknowledged(batches, nbytes, tuple(staged)))

    def _on_bulk(self, frame: memoryview, events: list[ClientEvent]) -> None:
        if not self._results:
            raise ProtocolError("BULK frame without a result announcing it")
        target = self._results[0]
        n = self.channel.open_bulk(frame, target.view, target.remaining, "result")
        target.remaining -= n
        events.append(ResultProgress(target.rid, n, target.remaining))
        if target.remaining == 0:
            self._results.popleft()
            if target.view is not None:
                events.append(ResultArrived(target.rid, target.value))
            if not self._results and self._receiving > self._received:
                self._received = self._receiving

    def _resend(self, msg: m.GraphUnknown) -> bool:
        """Register the graph batch `msg.seq` lacks and queue it and the later ones that went out
        again, first; False when that batch was acknowledged already (stale)."""
        first = self._unacked.get(msg.seq)
        if first is None:
            return False
        body = self._graphs.get(msg.gid)
        if body is None:
            raise ProtocolError(f"worker asked for graph {msg.gid.hex()}, which this client never sent")
        self.counters.graph_cache_misses += 1
        first.messages.insert(0, m.Register(msg.gid, body))
        resend = [b for seq, b in self._unacked.items() if msg.seq <= seq <= self._sent_upto]
        seqs = {b.seq for b in resend}
        self._queue = deque(resend + [b for b in self._queue if b.seq not in seqs])
        return True

    def link_lost(self) -> list[int]:
        """The link dropped: results cut short are forgotten (the worker sends them again after a
        resume); the rids whose bytes were arriving."""
        rids = [t.rid for t in self._results]
        self._results.clear()
        return rids

    def resume(self, channel: Channel, applied: int) -> list[ClientEvent]:
        """Carry on over a new link whose worker applied batches up to `applied`: every later batch
        goes again, in full, in order."""
        self.link_lost()
        self.channel = channel
        self._template = self._repeat = self._predicted = None  # the worker's went with the old link
        self._foreseen = self._expected = None
        events: list[ClientEvent] = []
        self._acknowledge(applied, events)
        self._queue = deque(self._unacked.values())
        return events


# -- the worker ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Expected:
    """A predicted batch as the worker takes it in: the template it repeats, the Repeat, the
    messages it expands to, the bytes of their inline uploads (the frame's tail), every upload's
    bytes in order (flow control), and, for a patched Repeat, where its patches lie among the
    messages' ids (`messages.patch_sites`: the same Repeat patching other ids is made from these
    messages)."""

    template: tuple[m.ClientMessage, ...]
    repeat: m.Repeat
    messages: tuple[m.ClientMessage, ...]
    inline: int
    uploads: tuple[int, ...]
    sites: tuple[tuple[int, int, int], ...] | None
    # A patched Repeat's patch positions and ids, and `messages.repatched_prefix` of it, made here
    # (after a reply) rather than as the next batch comes.
    positions: tuple[int, ...] = ()
    ids: tuple[int, ...] = ()
    prefix: bytes | None = None

    @classmethod
    def of(
        cls,
        predicted: tuple[tuple[m.ClientMessage, ...], m.Repeat, tuple[m.ClientMessage, ...]],
        last: _Expected | None,
    ) -> _Expected:
        """The predicted batch's; its byte counts those of `last` when it repeats the batch `last`
        expected (a shift or a patch changes no upload's size or layout)."""
        template, repeat, messages = predicted
        patches = repeat.patches
        sites = None
        positions: tuple[int, ...] = ()
        ids: tuple[int, ...] = ()
        prefix = None
        if patches is not None:
            positions, ids, sites = _patch_layout(patches, messages)
            prefix = m.repatched_prefix(repeat)
        if last is not None and last.messages is template:
            inline, uploads = last.inline, last.uploads
        else:
            inline = m.inline_bytes(messages)
            uploads = tuple(x.nbytes for x in messages if type(x) is m.Upload)
        return cls(template, repeat, messages, inline, uploads, sites, positions, ids, prefix)


class Kept(Protocol):
    """A reply as the worker keeps it for a resume (server/runner.py's Outgoing)."""

    @property
    def ack(self) -> int: ...
    @property
    def messages(self) -> Sequence[m.WorkerMessage]: ...
    def release(self) -> None: ...


K = TypeVar("K", bound=Kept)


MAX_KEPT_REPLIES = 2 * MAX_UNACKED_BATCHES
"""Most replies a session keeps for a resume. A client confirms, with every batch, the last reply
it took in whole (`received`), and may not send a batch more than MAX_UNACKED_BATCHES ahead of
the acks it has received, so an honest client never leaves more than MAX_UNACKED_BATCHES replies
unconfirmed; twice that is the margin. One that never confirms would otherwise make the worker
keep every reply of its session: 100,000 Syncs a blob kept ~100 MB of uncharged Done messages
until the session ended, and the worker's RSS stayed 27% above its baseline after it."""


class ReplyLog(Generic[K]):
    """The replies a client has not yet confirmed having taken in whole (a later batch's
    `received`), to send again on a new link; at most MAX_KEPT_REPLIES, the oldest forgotten (and
    released) past that. A reply that says only `GraphUnknown` is not kept: the batches it asks
    for go again anyway."""

    def __init__(self) -> None:
        self._kept: deque[K] = deque()
        self.forgotten = 0
        """The ack of the last reply forgotten unconfirmed (0: none): a resume from before it
        cannot be served whole (`covers`)."""

    def __len__(self) -> int:
        return len(self._kept)

    def __iter__(self) -> Iterator[K]:
        return iter(self._kept)

    def keep(self, out: K) -> None:
        for msg in out.messages:  # (a loop, not any() of a generator: this runs every step)
            if type(msg) is not m.GraphUnknown:
                break
        else:
            return
        kept = self._kept
        kept.append(out)
        if len(kept) > MAX_KEPT_REPLIES:
            oldest = kept.popleft()
            oldest.release()  # one posted while detached is in no outbox: nothing else would
            self.forgotten = oldest.ack

    def covers(self, received: int) -> bool:
        """Whether every reply after ack `received` is still kept (a resume from it is whole)."""
        return received >= self.forgotten

    def confirm(self, received: int) -> None:
        """Forget every reply up to ack `received`."""
        kept = self._kept
        while kept and kept[0].ack <= received:
            kept.popleft()

    def clear(self) -> None:
        self._kept.clear()


class WorkerConnection(Generic[K]):
    """The worker's end of one session: frames in, batches out; replies in, frames out.

    `plaintext_buffer(n)`, asked for frames of at least `buffer_from` plaintext bytes, gives a
    buffer to open one into (the backend's pinned host memory), or None for a fresh one. `replies`
    keeps what the client has not confirmed (the pump keeps each reply it applies there)."""

    def __init__(
        self,
        channel: Channel,
        chunk_size: int,
        plaintext_buffer: Callable[[int], memoryview | None] | None = None,
        buffer_from: int = 0,
    ) -> None:
        self.channel = channel
        self.chunk_size = chunk_size
        self.acked = 0  # the highest ack sealed in a reply
        self.replies: ReplyLog[K] = ReplyLog()
        self._plaintext_buffer = plaintext_buffer
        self._buffer_from = buffer_from
        self._template: tuple[m.ClientMessage, ...] | None = None
        # (template, Repeat, the template expanded by it): the next batch, expanded ahead, if it
        # repeats the last one's shifts (`predict`); keyed on the template it was made from.
        self._predicted: Prediction = None
        self._expected: _Expected | None = None  # what the worker needs of the predicted batch
        self._repeat: m.Repeat | None = None  # the Repeat the last batch came as
        # Whether the last batch patched other ids than the Repeat before it (batches uploaded
        # beforehand and cycled): its successor's bytes are then not foreseen (`predict`).
        self._repatched = False
        self._seq = 0  # the seq of the last batch
        self._template_seq = 0  # the seq of the last batch that is `_template` (not uploads only)
        # The predicted batch's exact bytes if it follows the last one at once, its client having
        # taken in the reply to that one (a loop reading every step's loss), with its seq, its
        # received and the Repeat: (bytes, seq, received, repeat).
        self._next_batch: tuple[bytes, int, int, m.Repeat] | None = None
        self._targets: deque[_Arriving] = deque()
        self._expecting = False  # a batch arrived and `expect` has not been told where its bulk goes
        self._unacked_bytes: dict[int, int] = {}  # seq -> upload bytes, for batches after `acked`
        self._held = 0  # their sum

    @property
    def receiving_bulk(self) -> bool:
        """Whether the batch that arrived last still waits for BULK bytes."""
        return bool(self._targets) or self._expecting

    def receive_frame(self, frame: memoryview) -> WorkerEvent | None:
        """Take in one frame (channel.split_frames of a blob); what it completed, if anything."""
        if frame[1] == BULK:
            return self._on_bulk(frame)
        return self._on_batch(frame)

    def _open_large(self, frame: memoryview, n: int) -> tuple[Kind, bytes | memoryview]:
        assert self._plaintext_buffer is not None
        buffer = self._plaintext_buffer(n)
        if buffer is None:
            return self.channel.open(frame)
        kind, _ = self.channel.open_into(frame, buffer)
        return kind, buffer[:n]

    def _on_batch(self, frame: memoryview) -> BatchArrived:
        if self._targets or self._expecting:
            raise ProtocolError("a batch arrived before the bulk bytes of the previous one")
        n = len(frame) - OVERHEAD
        plaintext: bytes | memoryview
        if self._plaintext_buffer is None or n < self._buffer_from:
            kind, plaintext = self.channel.open(frame)
        else:
            kind, plaintext = self._open_large(frame, n)
        if kind is not MESSAGE:
            raise ProtocolError(f"expected a MESSAGE frame, got {kind.name}")
        expected = self._expected
        if expected is not None and expected.template is self._template:
            arrived = self._on_expected(expected, plaintext)
            if arrived is not None:
                return arrived
        batch, start = m.decode_batch_prefix(plaintext)
        self._check_seq(batch.seq)
        repeat = batch.messages[0] if len(batch.messages) == 1 else None
        batch = m.expand_batch(batch, self._template)
        m.check_tail(batch, len(plaintext) - start)
        self._seq = batch.seq
        if uploads_only(batch.messages):  # the template stays: the next step repeats the last one
            if self._next_batch is not None and self._expected is not None:
                self._foresee_next()
        else:
            self._template_seq = batch.seq
            self._repeat = repeat if type(repeat) is m.Repeat and repeat.bindings is None else None
            self._repatched = False
            self._template = batch.messages
        if batch.received:
            self.replies.confirm(batch.received)
        self._count_uploads(batch.seq, [x.nbytes for x in batch.messages if type(x) is m.Upload])
        self._expecting = True
        return BatchArrived(batch, plaintext, start)

    def _on_expected(self, expected: _Expected, plaintext: bytes | memoryview) -> BatchArrived | None:
        """The batch if it is the Repeat expected (`predict`): its messages expanded already, its
        inline bytes and flow counted ahead; None (nothing changed) for any other, which
        `_on_batch` decodes in full."""
        start = len(plaintext) - expected.inline  # the tail is exactly the inline uploads' bytes
        if start <= 0:
            return None
        repeat, messages = expected.repeat, expected.messages
        head = plaintext[:start]
        next_batch = self._next_batch
        repatched = False
        if next_batch is not None and next_batch[3] is repeat and head == next_batch[0]:
            # The exact bytes foreseen (`_foresee_next`): a patched Repeat too, with the same
            # patches as the last (a resident DataLoader's step), is taken in with one comparison.
            seq, received = next_batch[1], next_batch[2]
        elif expected.sites is None:
            found = m.decode_repeat(head, repeat)
            if found is None:
                return None
            seq, received = found
        else:  # patched: the same patches, or other ids at their positions (batches cycled)
            refound = m.decode_repatched(head, repeat, expected.prefix)
            if refound is None:
                return None
            seq, received, ids = refound
            if ids != expected.ids:
                repatched = True
                messages = m.repatch(messages, expected.sites, ids)
                patches = tuple(zip(expected.positions, ids, strict=True))
                repeat = m.Repeat(repeat.id_shift, repeat.rid_shift, None, patches)
        self._repatched = repatched
        self._check_seq(seq)
        self._seq = self._template_seq = seq
        self._repeat = repeat
        self._template = messages
        if received:
            self.replies.confirm(received)
        self._count_uploads(seq, expected.uploads)
        self._expecting = True
        return BatchArrived(m.Batch(seq, messages, received), plaintext, start)

    def _check_seq(self, seq: int) -> None:
        if seq > self.acked + MAX_UNACKED_BATCHES:
            raise ProtocolError(
                f"client sent batch {seq} while batch {self.acked} is the last acknowledged: "
                f"more than {MAX_UNACKED_BATCHES} batches without waiting for acks"
            )

    def _count_uploads(self, seq: int, uploads: Sequence[int]) -> None:
        """Count a batch's upload bytes (`uploads`, in order) as unacknowledged; ProtocolError past
        MAX_UNACKED_BYTES."""
        held = before = self._held - self._unacked_bytes.pop(seq, 0)  # a batch sent again replaces itself
        for nbytes in uploads:
            if held and held + nbytes > MAX_UNACKED_BYTES:
                raise ProtocolError(
                    f"client sent more than {MAX_UNACKED_BYTES} bytes of uploads without waiting for acks"
                )
            held += nbytes
        if held != before:
            self._unacked_bytes[seq] = held - before
        self._held = held

    def expect(self, targets: Sequence[tuple[memoryview | None, int]]) -> bool:
        """Where the BULK uploads of the batch that arrived last go, in order: `(view, nbytes)`,
        view None for bytes to discard. True when it is whole already."""
        self._expecting = False
        if targets:
            self._targets.extend(_Arriving(0, None, view, n) for view, n in targets if n)
        return not self._targets

    def _on_bulk(self, frame: memoryview) -> BulkComplete | None:
        if not self._targets:
            raise ProtocolError("BULK frame without an upload announcing it")
        target = self._targets[0]
        n = self.channel.open_bulk(frame, target.view, target.remaining, "upload")
        target.remaining -= n
        if target.remaining:
            return None
        self._targets.popleft()
        return None if self._targets else BulkComplete()

    def predict(self) -> None:
        """Expand, while nothing waits (the pump calls it once a reply is out), the batch that
        repeats the last one's shifts, and count its bytes, so that the next batch, if it is that
        Repeat, is taken in at the cost of one small unpack (`_on_expected`). Measured as the
        client's: receive_frame of a jitted tiny step's batch went from 18.1 to 12.8 µs of CPU;
        with the byte counts and `messages.decode_repeat`, from 20.9 to 12.6 µs (median of the
        worker's calls over tcp, three runs interleaved with the comparison). A patched Repeat is
        expanded even when the next will patch other ids (batches cycled): `_on_expected` then
        repatches the expansion. The next batch's exact bytes are made too, as a client that read
        this reply sends it, so that it is taken in with one comparison; for a patched Repeat too,
        unless the last batch patched other ids than the one before (batches cycled: those bytes
        would not come). A resident DataLoader's step patches the same ids every step: its batch
        went from `messages.decode_repatched` to one comparison."""
        template, repeat = self._template, self._repeat
        predicted = self._predicted = _prediction(template, repeat, self._predicted)
        last = self._expected
        if predicted is not None and (last is None or last.messages is not predicted[2]):
            self._expected = last = _Expected.of(predicted, last)
        self._next_batch = None
        if (
            last is not None
            and (last.sites is None or not self._repatched)
            and last.template is template
            and self._seq
        ):
            self._foresee_next()

    def _foresee_next(self) -> None:
        """The expected Repeat's exact bytes as the batch right after the last one, sent by a client
        that took in the reply to the template's batch (`_next_batch`)."""
        expected = self._expected
        assert expected is not None
        seq = self._seq + 1
        data = m.encode_repeat_batch(seq, expected.repeat, self._template_seq)
        self._next_batch = (data, seq, self._template_seq, expected.repeat)

    @property
    def unacked_bytes(self) -> int:
        """Upload bytes of batches received and not yet acked in a reply sealed."""
        return self._held

    def discard_partial(self) -> None:
        """Forget a batch whose bulk bytes were still arriving (the client sends it again)."""
        self._targets.clear()
        self._expecting = False

    def _acknowledge(self, ack: int) -> None:
        if ack <= self.acked:
            return
        self.acked = ack
        if self._unacked_bytes:
            for seq in [s for s in self._unacked_bytes if s <= ack]:
                self._held -= self._unacked_bytes.pop(seq)

    def reply(self, ack: int, messages: list[m.WorkerMessage], arrays: list[Buffer]) -> Iterator[Frame]:
        """The blobs of one reply acking batch `ack` (`arrays`: one per Result, in order); acks
        count as told from now on (the client cannot know one before it is sent)."""
        self._acknowledge(ack)
        if len(messages) == 1:
            one = messages[0]
            if type(one) is m.Result and 0 < one.nbytes <= min(self.chunk_size, SMALL_FRAME):
                # A step's reply: one Result, inline (as below, but laid out directly).
                head = m.encode_result_inline(ack, one)
                return iter((self.channel.seal(head + _bytes_of(arrays[0]), MESSAGE),))
        results = 0
        if len(messages) <= SMALL_REPLY_MESSAGES:
            for x in messages:
                if type(x) is m.Result:
                    results += x.nbytes
        if len(messages) <= SMALL_REPLY_MESSAGES and results <= SMALL_REPLY_BULK:
            # The common small reply: one blob of one frame, its results inline (a step's loss
            # goes back in the frame that answers it).
            head, tail, later = _reply_layout(ack, messages, arrays, self.chunk_size)
            if len(head) <= MAX_REPLY_FRAME_BYTES:
                channel = self.channel
                blob: Frame = (
                    channel.seal_parts([head, *tail], MESSAGE) if tail else channel.seal(head, MESSAGE)
                )
                if later:
                    frames: list[Frame] = [blob]
                    for data in later:
                        frames.extend(channel.seal_chunks(data, self.chunk_size))
                    blob = b"".join(frames)
                return iter((blob,))
        return pack_frames(self._reply_frames(ack, messages, arrays))

    def _reply_frames(
        self, ack: int, messages: list[m.WorkerMessage], arrays: list[Buffer]
    ) -> Iterator[Frame]:
        channel = self.channel
        pending = iter(arrays)
        parts: Iterable[tuple[list[m.WorkerMessage], bytes]]
        if len(messages) <= SMALL_REPLY_MESSAGES:  # one frame, encoded once
            encoded = m.encode_reply(m.Reply(ack, tuple(messages)))
            parts = (
                ((messages, encoded),)
                if len(encoded) <= MAX_REPLY_FRAME_BYTES
                else _reply_parts(ack, messages)
            )
        else:
            parts = _reply_parts(ack, messages)
        for part, _ in parts:
            part_arrays = [next(pending) for msg in part if type(msg) is m.Result]
            head, tail, later = _reply_layout(ack, part, part_arrays, self.chunk_size)
            if tail and len(head) + sum(len(t) for t in tail) > MAX_PLAINTEXT:
                head, tail, later = _reply_layout(ack, part, part_arrays, 0)  # a huge reply: all in BULK
            yield channel.seal_parts([head, *tail], MESSAGE) if tail else channel.seal(head, MESSAGE)
            for data in later:
                yield from channel.seal_chunks(data, self.chunk_size)

    def final(self, error: m.Error, ack: int) -> Frame:
        """The frame that ends the session with `error`."""
        self._acknowledge(ack)
        return self.channel.seal(m.encode_reply(m.Reply(ack, (error,))), MESSAGE)

    def resume(self, channel: Channel, applied: int, received: int) -> Frame:
        """Carry on over a new link to a client that took in replies up to `received`: the frame
        that tells it the last batch applied (the replies in `replies` then go again)."""
        self.channel = channel
        self.replies.confirm(received)
        self.discard_partial()
        # The first batch on the new link repeats none.
        self._template = self._repeat = self._predicted = self._expected = self._next_batch = None
        self._unacked_bytes.clear()
        self._held = 0
        self.acked = max(self.acked, applied)
        return channel.seal(m.encode_reply(m.Reply(applied, ())), MESSAGE)


def _reply_layout(
    ack: int, part: list[m.WorkerMessage], arrays: list[Buffer], room: int
) -> tuple[bytes, list[memoryview], list[memoryview]]:
    """`(msgpack reply, inline results' bytes, BULK results' bytes)` of `part`, whose Results carry
    `arrays` (one each, empty ones included): inline in message order while they fit in `room`
    bytes together; empty ones carry no bytes either way."""
    inline: list[int] = []
    tail: list[memoryview] = []
    later: list[memoryview] = []
    results = iter(arrays)
    for i, msg in enumerate(part):
        if type(msg) is m.Result:
            array = next(results)
            if msg.nbytes:
                if msg.nbytes <= room:
                    room -= msg.nbytes
                    tail.append(_bytes_of(array))
                    inline.append(i)
                else:
                    later.append(_bytes_of(array))
    return m.encode_reply_inline(ack, tuple(part), inline), tail, later


def _reply_parts(ack: int, messages: list[m.WorkerMessage]) -> Iterator[tuple[list[m.WorkerMessage], bytes]]:
    """The reply's messages in runs whose encoded Reply fits MAX_REPLY_FRAME_BYTES (and at most
    MAX_REPLY_MESSAGES messages), each with its encoding; one empty Reply when there are none.
    A run's length is guessed from the size of a sample, so a large reply is encoded about once."""
    start, total = 0, len(messages)
    while True:
        count = min(MAX_REPLY_MESSAGES, total - start)
        if count > SMALL_REPLY_MESSAGES:
            sample = len(m.encode_reply(m.Reply(ack, tuple(messages[start : start + SMALL_REPLY_MESSAGES]))))
            count = max(1, min(count, int(MAX_REPLY_FRAME_BYTES * 0.9 * SMALL_REPLY_MESSAGES / sample)))
        while True:
            part = messages[start : start + count]
            encoded = m.encode_reply(m.Reply(ack, tuple(part)))
            if len(encoded) <= MAX_REPLY_FRAME_BYTES or count == 1:
                break
            count = max(1, count // 2)
        yield part, encoded
        start += count
        if start >= total:
            return


__all__ = [
    "MAX_KEPT_REPLIES",
    "Acknowledged",
    "BatchArrived",
    "BulkComplete",
    "ClientConnection",
    "ClientEvent",
    "GraphUnknownResent",
    "OutBatch",
    "ReplyLog",
    "ReplyReady",
    "RequestFailed",
    "ResultArrived",
    "ResultProgress",
    "SessionEnded",
    "Staged",
    "WorkerConnection",
    "WorkerEvent",
    "chunk_size_of",
    "within_flow",
]
