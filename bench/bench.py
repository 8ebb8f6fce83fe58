"""`make bench`: the real server on a temporary database of 20,000 jobs (--jobs N), driven by wrk on
127.0.0.1 one endpoint after another, against a ceiling measured in the same run: a bare Bottle app on
gevent's server (bench/ceiling.py), with and without TCP_NODELAY. POST /api/jobs with 32 concurrent posters
(group commit) and with one (a lone write's latency). Then 2,000 idle /api/jobs/stream connections, and
GET /api/health measured again while they are open. --only TEXT measures the endpoints whose name has TEXT.

Every figure that depends on the machine is also given as a ratio to the ceiling, measured in pairs run
back to back (the ceiling, then the endpoint; the median of --rounds pairs). The table goes to the terminal
and, as JSON, to artifacts/bench.json (--out). Needs wrk (Debian: apt-get install wrk).
"""

import argparse
import json
import os
import platform
import random
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import marketplace as mp  # noqa: E402
import wiring  # noqa: E402

ADMIN_KEY = 'bench-admin-key-' + 'k' * 32
# The jobs' text: each job names one of 200 topics (so a topic is in 0.5 % of 20,000 jobs, as a specific search
# would be) and a few of 20 common words (each in about 15 % of the jobs, as a broad search would be).
COMMON = ('parser invoice dashboard migration latency cache scraper translate summary benchmark pipeline '
          'schema refactor telemetry webhook tokenizer dataset report audit deploy').split()
TOPICS = [f'{a}{b}' for a in ('kafka', 'redis', 'stripe', 'django', 'spark', 'react', 'vulkan', 'ledger', 'gitlab',
                              'onnx') for b in ('sync', 'export', 'importer', 'plugin', 'monitor', 'backfill',
                                                'adapter', 'bridge', 'gateway', 'linter', 'fuzzer', 'crawler',
                                                'indexer', 'profiler', 'emulator', 'resolver', 'renderer',
                                                'validator', 'scheduler', 'optimizer')]
# And one of 50 tags (each in 2 % of the jobs: the search).
TAGS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau upsilon '
        'phi chi psi omega bravo charlie echo foxtrot golf hotel india juliett kilo lima mike november oscar papa '
        'quebec romeo sierra tango uniform victor whiskey xray yankee zulu amber cobalt').split()
SPECIFIC_QUERY, TAG_QUERY, BROAD_QUERY = TOPICS[42], TAGS[7], COMMON[0]
LANGUAGES = ('python', 'rust', 'go', 'typescript', 'english', 'german')
POLLING = 'polling agents: 200 clients, the same 3 reads, a post a second'
POLLING_CONDITIONAL = 'polling agents sending If-None-Match'
TARGETS = {   # measure: (kind, threshold) — ratio to the ceiling at least, or a limit not to reach
    'GET /api/health': ('ratio', 0.85),
    'GET /api/jobs/:id': ('ratio', 0.60),
    'GET /api/jobs?limit=50': ('ratio', 0.50),
    'GET /api/jobs?category=data&sort=pay_desc': ('ratio', 0.30),
    f'GET /api/jobs/search?q={SPECIFIC_QUERY}': ('ratio', 0.30),
    f'GET /api/jobs/search?q={TAG_QUERY}': ('ratio', 0.30),
    'POST /api/jobs, 32 posters': ('ratio', 0.25),
    'one kept-alive client: GET /api/health p50': ('below_ms', 3.0),
    '2,000 idle streams: memory added': ('below_mb', 150.0),
    '2,000 idle streams: GET /api/health p50': ('below_ms', 10.0),
    POLLING: ('ratio', 0.80),
}


def free_port():
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def wait_for(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(('127.0.0.1', port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f'nothing listens on port {port} after {timeout} s')


def memory_kib(pid, field):
    """VmRSS (now) or VmHWM (peak) of a process, in KiB."""
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
        if line.startswith(field + ':'):
            return int(line.split()[1])
    raise RuntimeError(f'no {field} for process {pid}')


def load_jobs(db_path, count, seed=7):
    """`count` open jobs, posted as POST /api/jobs would (create_job), in one transaction."""
    settings = mp.Settings(db=str(db_path), admin_key=ADMIN_KEY)
    svc = mp.Service(settings, wiring.FACES)
    account = svc.db.row("SELECT id, name, role FROM accounts WHERE role = 'admin'")
    rng = random.Random(seed)
    deadline = mp.iso(mp.now() + timedelta(days=30))
    started = time.monotonic()
    with svc.db.transaction():
        for n in range(count):
            words, topic = rng.sample(COMMON, 3), TOPICS[n % len(TOPICS)]
            fields = mp.read_job_body({
                'title': f'{words[0].capitalize()} the {topic} for customer {n}',
                'description': f'Work on the {words[1]} and the {words[2]} of our {topic}. ' * 3
                               + f'Tag: {TAGS[n % len(TAGS)]}.',
                'category': rng.choice(mp.CATEGORIES),
                'paymentAmount': f'{rng.randint(5, 500)}.{rng.randint(0, 99):02d}',
                'paymentCurrency': rng.choice(('USDC', 'USD')), 'deadline': deadline,
                'requirements': {'language': rng.choice(LANGUAGES)}}, account)
            mp.create_job(svc.db, settings, fields)
    svc.fan_out()       # their job.new events, expanded here: the server would do it during the first measures
    job_id = svc.db.value('SELECT id FROM jobs ORDER BY seq LIMIT 1 OFFSET :n', {'n': count // 2})
    svc.close()
    return job_id, time.monotonic() - started


def wrk(url, *, connections, duration, threads=1, env=None):
    """One wrk run: {requests, rps, p50_ms, p99_ms, errors}."""
    command = ['wrk', f'-t{threads}', f'-c{connections}', f'-d{duration}s', '--latency',
               '-s', str(ROOT / 'bench' / 'report.lua'), url]
    done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, **(env or {})),
                          timeout=duration + 60)
    line = next((line for line in done.stdout.splitlines() if line.startswith('BENCH ')), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f'wrk failed on {url}: {done.stdout}\n{done.stderr}')
    result = json.loads(line[len('BENCH '):])
    errors = sum(result[name] for name in ('connect_errors', 'read_errors', 'write_errors', 'status_errors',
                                           'timeouts'))
    return {'requests': result['requests'], 'rps': round(result['requests'] / (result['duration_us'] / 1e6), 1),
            'p50_ms': round(result['p50_us'] / 1000, 3), 'p99_ms': round(result['p99_us'] / 1000, 3),
            'errors': errors}


@contextmanager
def posting_every_second(url, body):
    """A job posted every second while the block runs (each post changes what the polling agents read)."""
    stop = threading.Event()

    def post():
        while not stop.wait(1.0):
            request = urllib.request.Request(url, data=body.encode(), method='POST', headers={
                'Content-Type': 'application/json', 'Authorization': f'Bearer {ADMIN_KEY}'})
            with urllib.request.urlopen(request, timeout=10) as answer:
                answer.read()
    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    try:
        yield
    finally:
        stop.set()
        poster.join()


class Process:
    """A server process on a free port, stopped on exit."""

    def __init__(self, command, port, env=None):
        self.port = port
        self.process = subprocess.Popen(command, cwd=ROOT, env=dict(os.environ, **(env or {})),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def open_streams(port, count):
    """`count` idle GET /api/jobs/stream connections, each past its `connected` event."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(('127.0.0.1', port), timeout=30)
        sock.sendall(b'GET /api/jobs/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n')
        sockets.append(sock)
    for sock in sockets:
        seen = b''
        while b'event: connected' not in seen:
            chunk = sock.recv(4096)
            if not chunk:
                raise RuntimeError('a stream closed before its connected event')
            seen += chunk
    return sockets


def replica_lag_under_writes(primary, replica, seconds, rate=50):
    """Post jobs to the primary at `rate` a second for `seconds`; each second, time how long the replica takes to
    show the job just posted, and read its health's lag. {seen_p50_s, seen_max_s, lag_max_s, posted}."""
    import threading
    import requests
    session = requests.Session()
    session.headers['Authorization'] = f'Bearer {ADMIN_KEY}'
    body = {'title': 'Replicated job', 'description': 'Posted by make bench.', 'category': 'code',
            'paymentAmount': '5.00', 'deadline': mp.iso(mp.now() + timedelta(days=7))}
    posted, stopping = [], threading.Event()

    def write():
        started = time.monotonic()
        while not stopping.is_set():
            answer = session.post(primary + '/api/jobs', json=body, timeout=10)
            posted.append((answer.json()['job']['id'], time.monotonic()))
            time.sleep(max(0.0, started + len(posted) / rate - time.monotonic()))

    writer = threading.Thread(target=write)
    writer.start()
    seen, lags = [], []
    try:
        ends = time.monotonic() + seconds
        while time.monotonic() < ends:
            time.sleep(1)
            job_id, at = posted[-1]
            while requests.get(f'{replica}/api/jobs/{job_id}', timeout=10).status_code != 200:
                time.sleep(0.02)
            seen.append(time.monotonic() - at)
            lags.append(requests.get(replica + '/api/health', timeout=10).json()['lag'])
    finally:
        stopping.set()
        writer.join()
    seen.sort()
    return {'seen_p50_s': round(seen[len(seen) // 2], 2), 'seen_max_s': round(seen[-1], 2),
            'lag_max_s': max(lags), 'posted': len(posted), 'rate': rate}


def measure_replica(python, db, directory, measure, results, needed, seconds):
    """A read replica (litestream-vfs on a file:// replica) beside the primary, replicated by Litestream:
    GET /api/jobs?limit=50 on each, then the replica's lag under a steady write load."""
    replica_url = f'file://{directory}/replica'
    port, replica_port = free_port(), free_port()
    common = ['--rate-limits', 'off', '--max-connections', str(needed), '--max-connections-per-ip', str(needed)]
    primary = [python, 'marketplace.py', 'serve', '--db', str(db), '--port', str(port), '--sweep-interval', '3600',
               '--replica-url', replica_url, '--heartbeat-interval', '1', *common]
    replica = [python, 'marketplace.py', 'serve', '--port', str(replica_port), '--read-replica-of', replica_url,
               *common]
    with Process(primary, port, env={'MARKETPLACE_ADMIN_KEY': ADMIN_KEY}):
        deadline = time.monotonic() + 120
        while not list(Path(directory, 'replica').rglob('*.ltx')):     # Litestream's first snapshot
            if time.monotonic() > deadline:
                raise RuntimeError('Litestream made no snapshot of the primary in 120 s')
            time.sleep(0.1)
        with Process(replica, replica_port):
            measure('primary under Litestream: GET /api/jobs?limit=50', f'http://127.0.0.1:{port}/api/jobs?limit=50')
            measure('read replica: GET /api/jobs?limit=50', f'http://127.0.0.1:{replica_port}/api/jobs?limit=50')
            lag = replica_lag_under_writes(f'http://127.0.0.1:{port}', f'http://127.0.0.1:{replica_port}', seconds)
    replica_rps = results['read replica: GET /api/jobs?limit=50']['rps']
    primary_rps = results['primary under Litestream: GET /api/jobs?limit=50']['rps']
    results['read replica: GET /api/jobs?limit=50']['to_primary'] = round(replica_rps / primary_rps, 2)
    results['read replica: lag under writes'] = lag
    print(f'  read replica: {replica_rps / primary_rps:.2f} of the primary\'s GET /api/jobs?limit=50; under '
          f'{lag["rate"]} writes/s a job is on the replica {lag["seen_p50_s"]} s after its 201 (median, max '
          f'{lag["seen_max_s"]} s), health\'s lag at most {lag["lag_max_s"]} s', flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--jobs', type=int, default=20_000, help='jobs in the database (default 20000)')
    parser.add_argument('--duration', type=int, default=3, help='seconds per wrk run (default 3)')
    parser.add_argument('--rounds', type=int, default=3, help='ceiling-and-endpoint pairs per measure (default 3)')
    parser.add_argument('--connections', type=int, default=50, help='wrk connections (default 50)')
    parser.add_argument('--streams', type=int, default=2_000, help='idle streams to hold open (default 2000)')
    parser.add_argument('--out', default=str(ROOT / 'artifacts' / 'bench.json'), help='the JSON results file')
    parser.add_argument('--replica-seconds', type=int, default=10,
                        help='seconds of writes while the read replica\'s lag is measured (0: no replica measure)')
    parser.add_argument('--only', default='', help='measure only the endpoints whose name contains this text')
    args = parser.parse_args(argv)
    if shutil.which('wrk') is None:
        print('make bench needs wrk: install it with `sudo apt-get install wrk` (Debian/Ubuntu).', file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * args.streams + 200
    if hard != resource.RLIM_INFINITY and hard < needed:
        print(f'make bench needs {needed} open files; the hard limit is {hard} (ulimit -Hn).', file=sys.stderr)
        return 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))   # the server inherits it

    results = {}
    python = sys.executable
    print(f'make bench on {platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}', flush=True)

    def run(url, connections, env=None):
        return wrk(url, connections=connections, duration=args.duration, env=env)

    def show(name, result):
        results[name] = result
        print(f'  {name}: {result["rps"]:,.0f} requests/s, p50 {result["p50_ms"]} ms, p99 {result["p99_ms"]} ms'
              + (f', ratio {result["ratio"]:.2f}' if 'ratio' in result else '')
              + (f', {result["errors"]} ERRORS' if result['errors'] else ''), flush=True)

    ceiling_port, delay_port = free_port(), free_port()
    ceiling_url = f'http://127.0.0.1:{ceiling_port}/'
    with Process([python, 'bench/ceiling.py', str(ceiling_port), 'nodelay'], ceiling_port), \
            Process([python, 'bench/ceiling.py', str(delay_port), 'delay'], delay_port):

        def measure(name, url, connections=args.connections, env=None):
            """Rounds of (the ceiling, then the endpoint), back to back: the ratio of each pair, so that this
            machine's other work (which moves a single run by 10 % or more) weighs on both alike. The run and
            ratio shown are the median ones."""
            if args.only not in name:
                return
            pairs = sorted(((run(url, connections, env), run(ceiling_url, connections)) for _ in range(args.rounds)),
                           key=lambda pair: pair[0]['rps'] / pair[1]['rps'])
            measured, ceiling = pairs[len(pairs) // 2]
            show(name, dict(measured, ratio=round(measured['rps'] / ceiling['rps'], 2), ceiling_rps=ceiling['rps']))

        show('ceiling', dict(run(ceiling_url, args.connections), ratio=1.0))
        show('ceiling, one kept-alive client p50', run(ceiling_url, 1))
        show('ceiling without TCP_NODELAY', run(f'http://127.0.0.1:{delay_port}/', args.connections))
        show('ceiling without TCP_NODELAY, one kept-alive client p50', run(f'http://127.0.0.1:{delay_port}/', 1))
        with tempfile.TemporaryDirectory(prefix='bench-') as tmp:
            db = Path(tmp) / 'bench.db'
            job_id, seconds = load_jobs(db, args.jobs)
            print(f'  loaded {args.jobs:,} jobs in {seconds:.1f} s', flush=True)
            port = free_port()
            base = f'http://127.0.0.1:{port}'
            server = [python, 'marketplace.py', 'serve', '--db', str(db), '--port', str(port), '--rate-limits',
                      'off', '--sweep-interval', '3600', '--max-connections', str(needed),
                      '--max-connections-per-ip', str(needed)]      # every stream and wrk connection is from 127.0.0.1
            with Process(server, port, env={'MARKETPLACE_ADMIN_KEY': ADMIN_KEY}) as running:
                pid = running.process.pid
                measure('GET /api/health', f'{base}/api/health')
                measure('GET /api/jobs/:id', f'{base}/api/jobs/{job_id}')
                measure('GET /api/jobs?limit=50', f'{base}/api/jobs?limit=50')
                measure('GET /api/jobs?category=data&sort=pay_desc', f'{base}/api/jobs?category=data&sort=pay_desc')
                for query in (SPECIFIC_QUERY, TAG_QUERY, BROAD_QUERY):    # matching 0.5 %, 2 % and ~15 % of the jobs
                    measure(f'GET /api/jobs/search?q={query}', f'{base}/api/jobs/search?q={query}')
                body = json.dumps({'title': 'Benchmark job', 'description': 'Posted by make bench.',
                                   'category': 'code', 'paymentAmount': '25.00',
                                   'deadline': mp.iso(mp.now() + timedelta(days=7))})
                posting = {'BENCH_METHOD': 'POST', 'BENCH_BODY': body, 'BENCH_KEY': ADMIN_KEY}
                measure('POST /api/jobs, 32 posters', f'{base}/api/jobs', connections=32, env=posting)   # grouped
                measure('POST /api/jobs, one poster', f'{base}/api/jobs', connections=1, env=posting)    # alone
                measure('one kept-alive client: GET /api/health p50', f'{base}/api/health', connections=1)
                if args.only in POLLING:            # what agents do: poll a list, a search and a job, again and again
                    reads = ','.join(['/api/jobs?limit=50', f'/api/jobs/search?q={TAG_QUERY}', f'/api/jobs/{job_id}'])
                    with posting_every_second(f'{base}/api/jobs', body):
                        measure(POLLING, f'{base}/api/jobs', connections=200, env={'BENCH_PATHS': reads})
                        measure(POLLING_CONDITIONAL, f'{base}/api/jobs', connections=200,    # 304s until a post
                                env={'BENCH_PATHS': reads, 'BENCH_CONDITIONAL': '1'})
                peak = memory_kib(pid, 'VmHWM')
                results['server peak memory'] = {'mb': round(peak / 1024, 1)}
                if args.only in f'{args.streams:,} idle streams':
                    before = memory_kib(pid, 'VmRSS')
                    streams = open_streams(port, args.streams)
                    time.sleep(1)
                    added = memory_kib(pid, 'VmRSS') - before
                    measure(f'{args.streams:,} idle streams: GET /api/health p50', f'{base}/api/health',
                            connections=1)
                    for sock in streams:
                        sock.close()
                    results[f'{args.streams:,} idle streams: memory added'] = {'mb': round(added / 1024, 1)}
            if args.replica_seconds and args.only in 'read replica':
                measure_replica(python, db, tmp, measure, results, needed, args.replica_seconds)

    print('\n| measure | requests/s | p50 ms | p99 ms | ratio to the ceiling | target | met |')
    print('|---|---|---|---|---|---|---|')
    for name, result in results.items():
        kind, threshold = TARGETS.get(name.replace(f'{args.streams:,}', '2,000'), (None, None))
        ratio = result.get('ratio')
        value = {'ratio': ratio, 'below_ms': result.get('p50_ms'), 'below_mb': result.get('mb')}.get(kind)
        met = None if kind is None else (value >= threshold if kind == 'ratio' else value < threshold)
        target = {} if kind is None else {'ratio': f'≥ {threshold:.2f}', 'below_ms': f'< {threshold:g} ms',
                                          'below_mb': f'< {threshold:g} MB'}
        if 'seen_p50_s' in result:
            cells = ['', f'{result["seen_p50_s"] * 1000:.0f} (seen)', f'{result["seen_max_s"] * 1000:.0f} (max)', '']
        elif 'rps' in result:
            cells = [f'{result["rps"]:,.0f}', f'{result["p50_ms"]:.2f}', f'{result["p99_ms"]:.2f}',
                     '' if ratio is None else f'{ratio:.2f}']
        else:
            cells = ['', '', '', f'{result["mb"]} MB']
        print(f'| {name} | ' + ' | '.join(cells) + f' | {target.get(kind, "")} | '
              + ('' if met is None else 'yes' if met else 'NO') + ' |')
        result.update(ratio=ratio, target=target.get(kind), met=met)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({'machine': {'host': platform.node(), 'cores': os.cpu_count(),
                                           'python': platform.python_version(), 'platform': platform.platform()},
                               'jobs': args.jobs, 'duration': args.duration, 'rounds': args.rounds,
                               'connections': args.connections,
                               'results': results}, indent=2) + '\n')
    missed = [name for name, result in results.items() if result.get('met') is False]
    print(f'\nwritten to {out}' + (f'; targets missed: {", ".join(missed)}' if missed else '; every target met'))
    errors = sum(result.get('errors', 0) for result in results.values())
    return 1 if errors else 0


if __name__ == '__main__':
    sys.exit(main())
