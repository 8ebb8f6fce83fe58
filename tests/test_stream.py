"""GET /api/jobs/stream (Server-Sent Events): against the real server on 127.0.0.1, and in-process.

The stream is read over a raw socket by a background thread that decodes the chunked body, parses
the events and stamps each with time.monotonic() on arrival; a test takes events from a queue with a
timeout, so no test can hang on a silent stream.
"""

import json
import queue
import signal
import socket
import threading
import time
from collections import namedtuple
from datetime import timedelta, timezone
from urllib.parse import quote

import pytest
import requests

from conftest import ADMIN_KEY, LiveServer, job_body
from test_server import Output, new_account, new_job, post, stop

import marketplace as mp
import wiring

READ_TIMEOUT = 5         # seconds to wait for any one event: only to avoid hanging, never asserted
HEARTBEAT = 0.3          # --stream-heartbeat of most servers here

Event = namedtuple('Event', 'event id data retry at')
END = 'end of body'      # what EventStream.next() answers once the response body is complete


# An SSE reader ---------------------------------------------------------------

def parse_sse_blocks(text):
    """Split SSE text into complete event blocks (each a list of lines) and the unparsed rest."""
    text = text.replace('\r\n', '\n').replace('\r', '\n')
    blocks = []
    while '\n\n' in text:
        block, text = text.split('\n\n', 1)
        blocks.append(block.split('\n'))
    return blocks, text


def event_from_block(lines, at=None):
    """One dispatched event; every event must carry a data line that parses as JSON."""
    fields = {'event': 'message', 'id': None, 'retry': None}
    data_lines = []
    for line in lines:
        if not line or line.startswith(':'):
            continue
        name, _, value = line.partition(':')
        value = value[1:] if value.startswith(' ') else value
        if name == 'data':
            data_lines.append(value)
        elif name in ('event', 'id'):
            fields[name] = value
        elif name == 'retry':
            fields['retry'] = int(value)
    assert data_lines, f'an event without a data line: {lines!r}'
    raw = '\n'.join(data_lines)
    try:
        data = json.loads(raw)
    except ValueError:
        raise AssertionError(f'the data line of a {fields["event"]} event is not JSON: {raw!r}') from None
    return Event(fields['event'], fields['id'], data, fields['retry'], at)


def parse_sse(body):
    """All the events of a complete SSE body (bytes)."""
    blocks, rest = parse_sse_blocks(body.decode('utf-8'))
    assert rest == '', f'the body ends inside an event: {rest!r}'
    return [event_from_block(block) for block in blocks]


class EventStream:
    """One GET /api/jobs/stream over a raw socket."""

    def __init__(self, server, query='', last_event_id=None):
        self.sock = socket.create_connection(('127.0.0.1', server.port), timeout=READ_TIMEOUT)
        head = f'GET /api/jobs/stream{"?" + query if query else ""} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n' \
               'Accept: text/event-stream\r\n'
        if last_event_id:
            head += f'Last-Event-ID: {last_event_id}\r\n'
        self.sock.sendall((head + '\r\n').encode())
        self.buffer = b''
        self.status, self.headers = self._read_head()
        self.events = queue.Queue()
        self.tcp_closed = threading.Event()     # the server closed the connection
        self.body_ended_at = None
        self.body = b''
        if self.status != 200:
            length = int(self.headers.get('content-length', '0'))
            while len(self.buffer) < length:
                self._recv()
            self.body = self.buffer[:length]
            return
        assert self.headers.get('transfer-encoding') == 'chunked', self.headers
        self.sock.settimeout(60)
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _recv(self):
        data = self.sock.recv(65536)
        if not data:
            raise EOFError
        self.buffer += data

    def _read_head(self):
        while b'\r\n\r\n' not in self.buffer:
            self._recv()
        head, self.buffer = self.buffer.split(b'\r\n\r\n', 1)
        status_line, *header_lines = head.decode('latin-1').split('\r\n')
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(':')
            headers[name.strip().lower()] = value.strip()
        return int(status_line.split()[1]), headers

    def _chunks(self):
        """The payloads of the chunked body, as they arrive; ends after the last (empty) chunk."""
        while True:
            while b'\r\n' not in self.buffer:
                self._recv()
            size_line, self.buffer = self.buffer.split(b'\r\n', 1)
            size = int(size_line.split(b';')[0], 16)
            while len(self.buffer) < size + 2:
                self._recv()
            payload, self.buffer = self.buffer[:size], self.buffer[size + 2:]
            if size == 0:
                return
            yield payload

    def _pump(self):
        text = b''
        try:
            for payload in self._chunks():
                at = time.monotonic()
                text += payload
                blocks, rest = parse_sse_blocks(text.decode('utf-8'))
                text = rest.encode('utf-8')
                for block in blocks:
                    self.events.put(event_from_block(block, at))
            self.body_ended_at = time.monotonic()
            self.events.put(END if not text else AssertionError(f'the body ends inside an event: {text!r}'))
            while True:               # after the body: does the server close the connection?
                self._recv()
        except EOFError:
            self.tcp_closed.set()
            self.events.put(EOFError('the connection closed'))
        except Exception as exc:      # noqa: BLE001 - handed to the test through the queue
            self.events.put(exc)

    def next(self, timeout=READ_TIMEOUT):
        """The next event (or END); fails if none arrives within `timeout` seconds."""
        try:
            item = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f'no event within {timeout} s') from None
        if isinstance(item, BaseException):
            raise AssertionError(f'the stream failed: {item!r}')
        return item

    def next_not_heartbeat(self, timeout=READ_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            event = self.next(max(0.01, deadline - time.monotonic()))
            if event == END or event.event != 'heartbeat':
                return event

    def jobs_until_quiet(self, after_iso):
        """The job ids of the job.new events before the first heartbeat stamped after `after_iso`.

        A stream sends a heartbeat only when its queue is empty, and publish() queues a job before the
        POST is answered; so a heartbeat stamped after a job's createdAt means every job posted up to that
        one that the stream wanted has already been sent.
        """
        ids = []
        while True:
            event = self.next()
            assert event != END, 'the stream ended'
            if event.event == 'heartbeat':
                if event.data['time'] > after_iso:
                    return ids
                continue
            assert event.event == 'job.new', event
            ids.append(event.id)

    def connected(self):
        """The first event, which must be `connected` with the retry hint."""
        event = self.next()
        assert event != END
        assert (event.event, event.retry, event.id) == ('connected', 3000, None), event
        return event

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# Helpers ---------------------------------------------------------------------

def start(tmp_path, name, *args):
    """A LiveServer with its output drained in the background (a full pipe would block it)."""
    server = LiveServer(tmp_path / f'{name}.db', ['--sweep-interval', '3600', *args]).start()
    server.log = Output(server)
    return server


@pytest.fixture
def server(tmp_path):
    """A server whose idle streams beat every 0.3 s."""
    server = start(tmp_path, 'stream', '--stream-heartbeat', str(HEARTBEAT))
    yield server
    stop(server)


@pytest.fixture
def key(server):
    return new_account(server, 'requester')[1]


@pytest.fixture
def streams():
    """Streams opened by a test; all closed after it."""
    opened = []
    yield opened
    for stream in opened:
        stream.close()


def open_stream(streams, server, query='', last_event_id=None):
    stream = EventStream(server, query, last_event_id)
    streams.append(stream)
    assert stream.status == 200, stream.body
    assert stream.headers['content-type'] == 'text/event-stream; charset=utf-8'
    assert stream.headers['cache-control'] == 'no-cache'
    return stream


def cancel(server, key, job):
    answer = post(f'{server.url}/api/jobs/{job["id"]}/cancel', {}, key)
    assert answer.status_code == 200, answer.text
    assert answer.json()['job']['status'] == 'cancelled'


# Connecting, live jobs, latency ----------------------------------------------

def test_connected_first_then_a_matching_job_before_any_later_heartbeat(server, key, streams):
    stream = open_stream(streams, server, 'categories=code')
    connected = stream.connected()
    assert connected.data == {'filters': {'categories': ['code'], 'min_pay': None},
                              'heartbeatSeconds': HEARTBEAT, 'maxSeconds': 600.0}

    sent = time.monotonic()
    answer = post(server.url + '/api/jobs', job_body(title='Port the parser', paymentAmount='42.50'), key)
    answered, answered_iso = time.monotonic(), mp.now_iso()
    assert answer.status_code == 201, answer.text
    job = answer.json()['job']

    # The job is queued on the stream before the POST is answered, and a heartbeat goes out only when the queue
    # is empty: a heartbeat stamped after the answer, ahead of the job, would mean the job waited (say, for a
    # poll). That is what is asserted, not a latency in ms, which load on the machine alone can stretch.
    event = stream.next()
    while event != END and event.event == 'heartbeat':
        assert event.data['time'] <= answered_iso, f'a heartbeat at {event.data["time"]} came before the job'
        event = stream.next()
    assert event.event == 'job.new'
    assert event.id == job['id']
    assert event.data['id'] == job['id']
    assert event.data['title'] == 'Port the parser'
    assert event.data['category'] == 'code'
    assert event.data['paymentAmount'] == '42.50'
    assert event.data['status'] == 'open'
    assert event.data['url'] == f'{server.url}/jobs/{job["id"]}'
    assert 'description' not in event.data
    latency = event.at - answered
    print(f'\njob.new arrived {latency * 1000:+.1f} ms after the POST answer '
          f'({(event.at - sent) * 1000:.1f} ms after the POST was sent)')


def test_a_job_of_another_category_is_not_sent(server, key, streams):
    stream = open_stream(streams, server, 'categories=code')
    stream.connected()
    other = new_job(server, key, category='design')
    # The next event is a heartbeat from after the post, not a job.
    event = stream.next()
    assert event.event == 'heartbeat', event
    assert stream.jobs_until_quiet(other['createdAt']) == []
    wanted = new_job(server, key, category='code')
    assert stream.next_not_heartbeat().id == wanted['id']


def test_a_job_below_min_pay_is_not_sent(server, key, streams):
    stream = open_stream(streams, server, 'min_pay=20')
    connected = stream.connected()
    assert connected.data['filters'] == {'categories': [], 'min_pay': '20.00'}
    cheap = new_job(server, key, paymentAmount='19.99')
    event = stream.next()
    assert event.event == 'heartbeat', event
    assert stream.jobs_until_quiet(cheap['createdAt']) == []
    exact = new_job(server, key, paymentAmount='20.00', category='data')
    event = stream.next_not_heartbeat()
    assert (event.event, event.id, event.data['paymentAmount']) == ('job.new', exact['id'], '20.00')


def test_idle_streams_get_heartbeats_with_json_data(server, streams):
    stream = open_stream(streams, server)
    stream.connected()
    beats = [stream.next(timeout=2) for _ in range(3)]
    assert [beat.event for beat in beats] == ['heartbeat'] * 3
    for beat in beats:
        assert set(beat.data) == {'time'}
        assert mp.parse_time(beat.data['time'])      # an ISO time
        assert beat.id is None
    gaps = [later.at - earlier.at for earlier, later in zip(beats, beats[1:])]
    assert all(0.15 < gap < 10 * HEARTBEAT for gap in gaps), gaps     # upper: generous (timers run late under load)


def test_every_event_has_a_json_data_line(tmp_path):
    """connected, job.new, heartbeat and timeout, read as raw text."""
    server = start(tmp_path, 'data', '--stream-heartbeat', '0.2', '--stream-max-seconds', '1')
    try:
        key = new_account(server, 'requester')[1]
        chunks = []
        with requests.get(server.url + '/api/jobs/stream', stream=True, timeout=(5, 5)) as answer:
            assert answer.status_code == 200
            new_job(server, key)
            for chunk in answer.iter_content(chunk_size=None):
                chunks.append(chunk)
        events = parse_sse(b''.join(chunks))     # asserts a JSON data line in every event
        kinds = [event.event for event in events]
        assert kinds[0] == 'connected' and kinds[1] == 'job.new' and kinds[-1] == 'timeout'
        assert kinds.count('heartbeat') >= 2
        raw_blocks = b''.join(chunks).decode().strip('\n').split('\n\n')
        assert len(raw_blocks) == len(events)
        for block in raw_blocks:
            data_lines = [line for line in block.split('\n') if line.startswith('data: ')]
            assert len(data_lines) == 1, block
            assert isinstance(json.loads(data_lines[0][len('data: '):]), dict)
    finally:
        stop(server)


# Maximum duration ------------------------------------------------------------

def test_a_stream_ends_with_timeout_after_its_maximum_duration(tmp_path, streams):
    server = start(tmp_path, 'max', '--stream-max-seconds', '1.5', '--stream-heartbeat', '0.4')
    try:
        stream = open_stream(streams, server, 'categories=code')
        opened = time.monotonic()
        assert stream.connected().data['maxSeconds'] == 1.5
        event = stream.next_not_heartbeat(timeout=4)
        assert event.event == 'timeout'
        assert event.data == {'reason': 'the maximum duration was reached', 'reconnect': True}
        assert 1.3 < event.at - opened < 4.5             # upper: generous (a timer runs late under load)
        assert stream.next(timeout=2) == END          # nothing after timeout: the response is complete
        assert stream.tcp_closed.wait(2), 'the server kept the connection open after the timeout event'
    finally:
        stop(server)


# Replay: since and Last-Event-ID ---------------------------------------------

def test_since_replays_matching_open_jobs_oldest_first(server, key, streams):
    before = new_job(server, key, title='before since')
    time.sleep(0.01)
    first = new_job(server, key, title='first')
    new_job(server, key, title='other category', category='design')
    closed = new_job(server, key, title='cancelled')
    cancel(server, key, closed)
    second = new_job(server, key, title='second', category='data')
    third = new_job(server, key, title='third')

    # since = the createdAt of `before`: only jobs created strictly after it
    stream = open_stream(streams, server, 'categories=code,data&since=' + quote(before['createdAt']))
    stream.connected()
    replayed = [stream.next() for _ in range(3)]
    assert [(e.event, e.id) for e in replayed] == [('job.new', first['id']), ('job.new', second['id']),
                                                  ('job.new', third['id'])]
    assert [e.data['title'] for e in replayed] == ['first', 'second', 'third']
    assert stream.jobs_until_quiet(third['createdAt']) == []
    live = new_job(server, key, title='live')
    assert stream.next_not_heartbeat().id == live['id']


def test_since_accepts_an_offset(server, key, streams):
    job = new_job(server, key)
    moment = mp.parse_time(job['createdAt']) - timedelta(milliseconds=1)
    since = moment.astimezone(timezone(timedelta(hours=2))).isoformat()   # ...+02:00
    stream = open_stream(streams, server, 'since=' + quote(since))
    stream.connected()
    assert stream.next().id == job['id']


@pytest.mark.parametrize('since', ['yesterday', '2026-13-01T00:00:00Z', '12:00'])
def test_a_bad_since_is_a_json_400(server, since):
    answer = requests.get(server.url + '/api/jobs/stream', params={'since': since}, timeout=5)
    assert answer.status_code == 400
    assert answer.headers['content-type'] == 'application/json; charset=utf-8'
    body = answer.json()
    assert body['code'] == 'invalid_parameter'
    assert body['status'] == 400
    assert 'since' in body['fields']


def test_last_event_id_resumes_after_that_job_without_losing_one(server, key, streams):
    stream = open_stream(streams, server, 'categories=code')
    stream.connected()
    jobs = [new_job(server, key, title=f'job {n}') for n in (1, 2, 3)]
    received = [stream.next_not_heartbeat() for _ in jobs]
    assert [e.id for e in received] == [job['id'] for job in jobs]
    stream.close()

    missed = new_job(server, key, title='posted while disconnected')
    new_job(server, key, title='not for this stream', category='design')

    again = open_stream(streams, server, 'categories=code', last_event_id=received[1].id)
    again.connected()
    assert [again.next().id for _ in range(2)] == [jobs[2]['id'], missed['id']]
    assert again.jobs_until_quiet(missed['createdAt']) == []
    live = new_job(server, key, title='live')
    event = again.next_not_heartbeat()
    assert (event.event, event.id) == ('job.new', live['id'])


def test_last_event_id_in_uppercase_resumes_too(server, key, streams):
    first, second = new_job(server, key), new_job(server, key)
    stream = open_stream(streams, server, last_event_id=first['id'].upper())
    stream.connected()
    assert stream.next().id == second['id']
    assert stream.jobs_until_quiet(second['createdAt']) == []


# Fan-out ---------------------------------------------------------------------

def test_each_stream_gets_exactly_its_jobs(server, key, streams):
    filters = {'code': 'categories=code', 'design': 'categories=design',
               'code-data-20': 'categories=code,data&min_pay=20', 'all': ''}
    opened = {name: open_stream(streams, server, query) for name, query in filters.items()}
    for stream in opened.values():
        stream.connected()
    posted = {name: new_job(server, key, title=name, category=category, paymentAmount=pay)
              for name, category, pay in [('code25', 'code', '25.00'), ('design5', 'design', '5.00'),
                                          ('data10', 'data', '10.00'), ('data30', 'data', '30.00'),
                                          ('code15', 'code', '15.00'), ('research50', 'research', '50.00')]}
    last = posted['research50']['createdAt']
    expected = {'code': ['code25', 'code15'], 'design': ['design5'], 'code-data-20': ['code25', 'data30'],
                'all': ['code25', 'design5', 'data10', 'data30', 'code15', 'research50']}
    for name, stream in opened.items():
        assert stream.jobs_until_quiet(last) == [posted[title]['id'] for title in expected[name]], name


# SIGTERM ---------------------------------------------------------------------

def test_sigterm_sends_timeout_to_every_open_stream_and_exits_0(tmp_path, streams):
    server = start(tmp_path, 'term')      # default heartbeat (30 s): the close must wake the streams
    try:
        opened = [open_stream(streams, server, query) for query in ('', 'categories=code', 'min_pay=100')]
        for stream in opened:
            stream.connected()
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        for stream in opened:
            event = stream.next(timeout=5)
            assert event.event == 'timeout', event
            assert event.data == {'reason': 'the server is stopping', 'reconnect': True}
            assert event.at - signalled < 2
            assert stream.next(timeout=5) == END
        assert server.process.wait(10) == 0
        assert time.monotonic() - signalled < 10
        assert all(stream.tcp_closed.wait(2) for stream in opened)
        assert server.log.text().rstrip().endswith('stopped')
    finally:
        stop(server)


# In-process ------------------------------------------------------------------

@pytest.fixture
def short_app(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'inproc.db'), rate_limits='off', admin_key=ADMIN_KEY,
                           public_url='http://market.test', stream_max_seconds=0.2)
    app = wiring.make_app(settings)
    yield app
    app.service.close()


@pytest.mark.parametrize('query, field', [('categories=nope', 'categories'), ('min_pay=-1', 'min_pay'),
                                          ('since=soon', 'since')])
def test_in_process_bad_query_is_a_json_400(short_app, query, field):
    status, headers, body = mp.call_app(short_app, 'GET', '/api/jobs/stream?' + query)
    assert status == 400
    assert headers['Content-Type'] == 'application/json; charset=utf-8'
    assert body['code'] == 'invalid_parameter'
    assert body['status'] == 400
    assert list(body['fields']) == [field]


def test_in_process_stream_is_connected_then_timeout(short_app):
    started = time.monotonic()
    status, headers, body = mp.call_app(short_app, 'GET', '/api/jobs/stream?categories=code,data&min_pay=10.5')
    took = time.monotonic() - started
    assert status == 200
    assert headers['Content-Type'] == 'text/event-stream; charset=utf-8'
    events = parse_sse(body)
    assert [event.event for event in events] == ['connected', 'timeout']
    assert events[0].retry == 3000
    assert events[0].data == {'filters': {'categories': ['code', 'data'], 'min_pay': '10.50'},
                              'heartbeatSeconds': 30.0, 'maxSeconds': 0.2}
    assert events[1].data == {'reason': 'the maximum duration was reached', 'reconnect': True}
    assert 0.15 < took < 10         # it ended at its maximum (upper: only generous; the heartbeat is 30 s)


def test_in_process_since_replays_before_timeout(short_app):
    status, _, answer = mp.call_app(short_app, 'POST', '/api/accounts', {'name': 'requester'})
    key = answer['apiKey']
    jobs = []
    for category in ('code', 'design', 'code'):
        status, _, answer = mp.call_app(short_app, 'POST', '/api/jobs', job_body(category=category), key)
        assert status == 201, answer
        jobs.append(answer['job'])
    status, _, body = mp.call_app(short_app, 'GET', '/api/jobs/stream?categories=code&since=2000-01-01T00:00:00Z')
    events = parse_sse(body)
    assert [(e.event, e.id) for e in events] == [('connected', None), ('job.new', jobs[0]['id']),
                                                ('job.new', jobs[2]['id']), ('timeout', None)]
    assert events[1].data['url'] == f'http://market.test/jobs/{jobs[0]["id"]}'
