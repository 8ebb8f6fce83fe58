"""Measure what idle GET /api/jobs/stream connections cost the real server. Not a test.

Run it once, by hand (pytest does not collect it: no test_ prefix, no test functions):

    cd /work/main && .venv/bin/python tests/measure_streams.py [--streams 1000] [--requests 200]

It starts `marketplace.py serve` on 127.0.0.1 with a temporary database, `--rate-limits off` and the
default heartbeat (30 s), under `ulimit -n 4096` so that it may hold the connections, and:

1. reads the server's VmRSS from /proc/<pid>/status with no stream open;
2. times GET /api/health over 200 sequential requests on one kept-alive connection (p50, p99);
3. opens 1,000 streams (`?categories=code`) over raw sockets and waits until every one has its
   `connected` event, then reads VmRSS again;
4. times GET /api/health the same way with the 1,000 streams open;
5. posts one job of category code and times until every stream has received its `job.new`
   (from the moment the POST was sent, and from its answer);
6. closes the streams and times GET /api/health once more;
7. opens 1,000 streams again in a burst (every socket connects before any is read) and times it: the
   listen backlog (gevent's default, 128) decides how long a reconnection storm waits;

then prints a table and stops the server (SIGTERM) in every case.
"""

import argparse
import http.client
import json
import os
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = 'measure-admin-key-' + 'b' * 32


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def raise_fd_limit(wanted):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def vm_rss_kib(pid):
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith('VmRSS:'):
            return int(line.split()[1])
    raise RuntimeError('no VmRSS line')


def open_files_limit(pid):
    for line in Path(f'/proc/{pid}/limits').read_text().splitlines():
        if line.startswith('Max open files'):
            return int(line.split()[3])
    return None


def start_server(db, port, log):
    # The shell raises the server's own limit (to 4096, or to its hard limit if that is lower), then
    # exec replaces it with Python: the Popen pid is the server's pid.
    wrapper = 'ulimit -n 4096 2>/dev/null || ulimit -n "$(ulimit -Hn)"; exec "$@"'
    command = ['sh', '-c', wrapper, 'sh', sys.executable, str(ROOT / 'marketplace.py'), 'serve',
               '--host', '127.0.0.1', '--port', str(port), '--db', str(db), '--rate-limits', 'off',
               '--max-connections-per-ip', '4000', '--max-connections', '4000']     # every stream comes from 127.0.0.1
    env = {name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}
    env['MARKETPLACE_ADMIN_KEY'] = ADMIN_KEY
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f'the server exited with {process.returncode}')
        try:
            connection = http.client.HTTPConnection('127.0.0.1', port, timeout=1)
            connection.request('GET', '/api/health')
            if connection.getresponse().status == 200:
                connection.close()
                return process
        except OSError:
            time.sleep(0.05)
    raise RuntimeError('the server did not start in 15 s')


def stop_server(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    return process.returncode


def health_latencies(port, count):
    """Seconds per GET /api/health, `count` sequential requests on one kept-alive connection."""
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=10)
    try:
        for _ in range(20):                      # warm up: connection, caches
            connection.request('GET', '/api/health')
            connection.getresponse().read()
        times = []
        for _ in range(count):
            started = time.perf_counter()
            connection.request('GET', '/api/health')
            answer = connection.getresponse()
            answer.read()
            times.append(time.perf_counter() - started)
            assert answer.status == 200, answer.status
            assert answer.getheader('Connection', '').lower() != 'close'
        return times
    finally:
        connection.close()


def percentile(values, fraction):
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(round(fraction * len(ordered) + 0.5)) - 1))]


def open_streams(port, count, burst=False, query='categories=code'):
    """`count` raw sockets, each with the stream's headers and its `connected` event read.

    One by one (connect, send, read the connected event, next), or in a burst: every socket connects
    and sends before any is read, as clients reconnecting all at once after a restart would.
    """
    request = (f'GET /api/jobs/stream?{query} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n'
               'Accept: text/event-stream\r\n\r\n').encode()

    def read_connected(sock):
        received = b''
        while b'event: connected' not in received or not received.endswith(b'\n\n\r\n'):
            data = sock.recv(65536)
            if not data:
                raise RuntimeError('a stream closed before its connected event')
            received += data
        assert received.startswith(b'HTTP/1.1 200 '), received[:100]

    sockets = []
    for _ in range(count):
        sock = socket.create_connection(('127.0.0.1', port), timeout=30)
        sock.sendall(request)
        sockets.append(sock)
        if not burst:
            read_connected(sock)
    if burst:
        for sock in sockets:
            read_connected(sock)
    return sockets


def post_job(port, key):
    body = json.dumps({'title': 'Fan-out probe', 'description': 'Measures the stream fan-out.', 'category': 'code',
                       'paymentAmount': '25.00',
                       'deadline': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(time.time() + 86400))})
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=10)
    try:
        sent = time.monotonic()
        connection.request('POST', '/api/jobs', body, {'Content-Type': 'application/json',
                                                        'Authorization': f'Bearer {key}'})
        answer = connection.getresponse()
        payload = json.loads(answer.read())
        answered = time.monotonic()
        assert answer.status == 201, payload
        return payload['job']['id'], sent, answered
    finally:
        connection.close()


def wait_for_job(sockets, job_id, timeout=60):
    """When (time.monotonic) each socket had received the job's `job.new` event."""
    marker = f'id: {job_id}\nevent: job.new\n'.encode()
    selector = selectors.DefaultSelector()
    buffers = {}
    for sock in sockets:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        buffers[sock] = b''
    arrived = {}
    deadline = time.monotonic() + timeout
    while len(arrived) < len(sockets) and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            now = time.monotonic()
            if not data:
                selector.unregister(sock)
                continue
            buffers[sock] += data
            if marker in buffers[sock] and sock not in arrived:
                arrived[sock] = now
                selector.unregister(sock)
    selector.close()
    return arrived


def create_key(port):
    connection = http.client.HTTPConnection('127.0.0.1', port, timeout=10)
    try:
        connection.request('POST', '/api/accounts', json.dumps({'name': 'measure'}),
                           {'Content-Type': 'application/json'})
        answer = connection.getresponse()
        payload = json.loads(answer.read())
        assert answer.status == 201, payload
        return payload['apiKey']
    finally:
        connection.close()


def ms(seconds):
    return f'{seconds * 1000:.2f} ms'


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--streams', type=int, default=1000)
    parser.add_argument('--requests', type=int, default=200)
    args = parser.parse_args()

    own_limit = raise_fd_limit(args.streams + 256)
    if own_limit < args.streams + 64:
        sys.exit(f'this process may open only {own_limit} files; {args.streams} streams need more')
    rows = []
    with tempfile.TemporaryDirectory(prefix='measure-streams-') as tmp:
        port = free_port()
        log = open(Path(tmp) / 'server.log', 'wb')
        process = start_server(Path(tmp) / 'measure.db', port, log)
        sockets = []
        try:
            pid = process.pid
            server_limit = open_files_limit(pid)
            key = create_key(port)
            time.sleep(0.5)
            rss_idle = vm_rss_kib(pid)
            without = health_latencies(port, args.requests)

            started = time.monotonic()
            sockets = open_streams(port, args.streams)
            opened_in = time.monotonic() - started
            time.sleep(0.5)
            rss_streams = vm_rss_kib(pid)
            with_streams = health_latencies(port, args.requests)

            job_id, sent, answered = post_job(port, key)
            arrived = wait_for_job(sockets, job_id)
            times = sorted(arrived.values())
            rss_after_fanout = vm_rss_kib(pid)

            for sock in sockets:
                sock.close()
            sockets = []
            time.sleep(0.5)
            after_close = health_latencies(port, args.requests)

            started = time.monotonic()
            sockets = open_streams(port, args.streams, burst=True)
            burst_in = time.monotonic() - started
            for sock in sockets:
                sock.close()
            sockets = []
            exit_code = stop_server(process)

            rows += [
                ('server open-files limit', f'{server_limit}'),
                ('VmRSS, no streams', f'{rss_idle / 1024:.1f} MiB'),
                (f'VmRSS, {args.streams} idle streams', f'{rss_streams / 1024:.1f} MiB'),
                ('VmRSS per stream', f'{(rss_streams - rss_idle) / args.streams:.1f} KiB'),
                ('VmRSS after the fan-out', f'{rss_after_fanout / 1024:.1f} MiB'),
                (f'open {args.streams} streams one by one', f'{opened_in:.2f} s'),
                (f'open {args.streams} streams in a burst', f'{burst_in:.2f} s'),
                ('health p50 / p99, no streams', f'{ms(statistics.median(without))} / {ms(percentile(without, 0.99))}'),
                (f'health p50 / p99, {args.streams} streams',
                 f'{ms(statistics.median(with_streams))} / {ms(percentile(with_streams, 0.99))}'),
                ('health p50 / p99, streams closed',
                 f'{ms(statistics.median(after_close))} / {ms(percentile(after_close, 0.99))}'),
                ('POST /api/jobs answered after', ms(answered - sent)),
                ('streams that got job.new', f'{len(arrived)} of {args.streams}'),
                ('job.new at all streams, from POST sent', ms(times[-1] - sent) if times else 'n/a'),
                ('job.new at all streams, from POST answer', ms(times[-1] - answered) if times else 'n/a'),
                ('job.new first / median stream, from POST sent',
                 f'{ms(times[0] - sent)} / {ms(statistics.median(times) - sent)}' if times else 'n/a'),
                ('server exit code after SIGTERM', f'{exit_code}'),
            ]
        finally:
            for sock in sockets:
                sock.close()
            stop_server(process)
            log.close()
    width = max(len(name) for name, _ in rows)
    print(f'{"measure":<{width}}  value')
    print(f'{"-" * width}  {"-" * 22}')
    for name, value in rows:
        print(f'{name:<{width}}  {value}')


if __name__ == '__main__':
    main()
