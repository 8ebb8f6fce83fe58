"""Replication and restore with Litestream (CONTRACT.md 16), with the real binary and a real S3 server (moto) on
127.0.0.1: what the API acknowledged comes back after SIGTERM; a SIGKILL of the whole process group loses at most
the last sync interval; a restore goes to a moment in time, never over a file, and checks what it restored."""

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
import requests

from conftest import ADMIN_KEY, ROOT, LiveServer, free_port, job_body, random_wallet

import marketplace as mp
import wiring
import replication

pytestmark = pytest.mark.replication

TIMEOUT = 10
SECRET = 'replication-secret-' + secrets.token_hex(12)      # AWS_SECRET_ACCESS_KEY: never in any output
AWS_ENV = {'AWS_ACCESS_KEY_ID': 'replication-test-key', 'AWS_SECRET_ACCESS_KEY': SECRET, 'AWS_REGION': 'us-east-1'}
PUBLIC_URL = 'http://market.test'       # the same absolute URLs from the replicated and the restored server
SYNC_SECONDS = 1.0                      # replication.SYNC_INTERVAL
UPLOAD_MARGIN = 1.0                     # beyond the sync interval: one upload and a loaded 2-core machine


@pytest.fixture(scope='module')
def s3():
    """moto's S3 server on 127.0.0.1 with the bucket `backups`; its endpoint URL."""
    port = free_port()
    server = subprocess.Popen([os.path.join(sys.prefix, 'bin', 'moto_server'), '-H', '127.0.0.1', '-p', str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f'http://127.0.0.1:{port}'
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.put(f'{endpoint}/backups', timeout=2).status_code == 200:    # creates the bucket
                    break
            except requests.ConnectionError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, 'moto_server did not start'
            time.sleep(0.1)
        yield endpoint
    finally:
        server.terminate()
        server.wait(10)


class Output:
    """A process's output read in the background (a busy server never blocks on a full pipe)."""

    def __init__(self, process):
        self.chunks = []
        self.reader = threading.Thread(target=lambda: self.chunks.extend(iter(process.stdout.readline, b'')),
                                       daemon=True)
        self.reader.start()

    def wait_for(self, text, seconds=TIMEOUT):
        """Whether `text` appeared within `seconds` (only to avoid hanging)."""
        deadline = time.monotonic() + seconds
        while text.encode() not in b''.join(list(self.chunks)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return time.monotonic() < deadline

    def text(self):
        self.reader.join(10)
        return b''.join(self.chunks).decode(errors='replace')


def replicated(db, url, endpoint='', new_session=False):
    """A LiveServer replicated by Litestream to `url`, started, with its output read in the background."""
    args = ['--public-url', PUBLIC_URL, '--replica-url', url] + (['--replica-endpoint', endpoint] if endpoint else [])
    server = LiveServer(db, args, env=AWS_ENV, new_session=new_session).start()
    server.out = Output(server.process)
    return server


def plain(db):
    """A LiveServer on `db` without replication, started."""
    server = LiveServer(db, ['--public-url', PUBLIC_URL]).start()
    server.out = Output(server.process)
    return server


def stop(server):
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


def restore(db, url, endpoint='', timestamp=None):
    """`marketplace.py restore`: (exit code, output)."""
    command = [sys.executable, str(ROOT / 'marketplace.py'), 'restore', '--db', str(db), '--replica-url', url]
    command += (['--replica-endpoint', endpoint] if endpoint else []) + (['--timestamp', timestamp] if timestamp else [])
    env = {name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}
    done = subprocess.run(command, env={**env, **AWS_ENV}, capture_output=True, text=True, timeout=60, cwd=ROOT)
    return done.returncode, done.stdout + done.stderr


def call(server, method, path, body=None, key=None, status=200):
    answer = requests.request(method, server.url + path, json=body, timeout=TIMEOUT,
                              headers={'Authorization': f'Bearer {key}'} if key else {})
    assert answer.status_code == status, answer.text
    return answer.json()


def account(server, name):
    return call(server, 'POST', '/api/accounts', {'name': name}, status=201)['apiKey']


def post_job(server, key, title):
    return call(server, 'POST', '/api/jobs', job_body(title=title), key=key, status=201)['job']['id']


def write_a_market(server):
    """Jobs, claims, deliveries, an approval and a rejection through the API: the GET paths (and the key that
    reads each) whose answers show every acknowledged write, and the requester's key."""
    requester, worker = account(server, 'requester'), account(server, 'worker')
    agent = call(server, 'POST', '/api/agents', {'name': 'worker-agent', 'walletAddress': random_wallet(),
                                                 'capabilities': {'categories': ['code']}}, key=worker, status=201)
    agent_id = agent['agent']['id']
    jobs = [post_job(server, requester, f'Job {n}') for n in range(6)]
    for n, job_id in enumerate(jobs[:4]):
        claim = call(server, 'POST', f'/api/jobs/{job_id}/claim', {'agentId': agent_id}, key=worker, status=201)
        claim_id = claim['claim']['id']
        call(server, 'POST', f'/api/jobs/{job_id}/deliver',
             {'claimId': claim_id, 'deliverable': {'type': 'url', 'url': f'https://example.com/{n}'}}, key=worker)
        if n < 3:
            call(server, 'POST', f'/api/jobs/{job_id}/verify', {'claimId': claim_id, 'approved': n < 2},
                 key=requester)
    reads = [(f'/api/jobs/{job_id}', requester) for job_id in jobs]
    reads += [(f'/api/agents/{agent_id}', None), ('/api/jobs?limit=200', None), ('/api/stats', None),
              ('/api/jobs?limit=200', requester), ('/api/agents', None)]
    return reads, requester


def read_stream_until_timeout(server, seen):
    """Read /api/jobs/stream until its `timeout` event (the server closing it), noting the events in `seen`."""
    with requests.get(server.url + '/api/jobs/stream', stream=True, timeout=TIMEOUT) as answer:
        for line in answer.iter_lines():
            if line.startswith(b'event: '):
                seen.append(line.decode()[7:])
                if seen[-1] == 'timeout':
                    return


def test_sigterm_then_restore_from_s3_answers_the_same_json(s3, tmp_path):
    url = 's3://backups/story/marketplace'
    server = replicated(tmp_path / 'live.db', url, s3)
    try:
        health = call(server, 'GET', '/api/health')
        assert health['replication'] == {'enabled': True, 'url': url}
        reads, requester = write_a_market(server)
        before = {(path, key): call(server, 'GET', path, key=key) for path, key in reads}
        stream_events = []
        streamer = threading.Thread(target=read_stream_until_timeout, args=(server, stream_events))
        streamer.start()
        deadline = time.monotonic() + TIMEOUT
        while stream_events != ['connected'] and time.monotonic() < deadline:
            time.sleep(0.01)
        # A job whose body is still arriving when SIGTERM (to litestream, which passes it on) comes.
        body = json.dumps(job_body(title='In flight at SIGTERM')).encode()
        connection = socket.create_connection(('127.0.0.1', server.port), timeout=TIMEOUT)
        connection.sendall(b'POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n'
                           b'Authorization: Bearer %s\r\nConnection: close\r\nContent-Length: %d\r\n\r\n'
                           % (requester.encode(), len(body)) + body[:5])
        time.sleep(0.5)     # only ordering: the server has read the headers and waits in the handler for the body
        server.process.send_signal(signal.SIGTERM)
        assert server.out.wait_for('stopping (finishing requests in flight)')
        connection.sendall(body[5:])
        answer = b''
        while chunk := connection.recv(65536):
            answer += chunk
        connection.close()
        head, _, payload = answer.partition(b'\r\n\r\n')
        assert head.startswith(b'HTTP/1.1 201'), answer[:300]
        in_flight = json.loads(payload)['job']
        assert server.process.wait(TIMEOUT) == 0
        streamer.join(TIMEOUT)
        assert stream_events == ['connected', 'timeout']
        output = server.out.text()
    finally:
        stop(server)
    assert 'sending signal to exec process' in output and 'marketplace INFO stopped' in output
    assert output.rstrip().endswith('msg="litestream shut down"')       # its final sync ran after the server stopped
    assert 'replicated by Litestream to s3://backups/story/marketplace' in output
    assert SECRET not in output

    restored = tmp_path / 'restored' / 'market.db'
    restored.parent.mkdir()
    code, printed = restore(restored, url, s3)
    assert code == 0, printed + output
    assert printed.splitlines() == [f'Restored {url} to {restored} (latest)', 'integrity: ok', 'ledger: balanced']
    assert SECRET not in printed
    again = plain(restored)
    try:
        after = {(path, key): call(again, 'GET', path, key=key) for path, key in reads}
        assert call(again, 'GET', f'/api/jobs/{in_flight["id"]}', key=requester)['job'] == in_flight
        assert call(again, 'GET', '/api/health')['replication'] == {'enabled': False, 'url': None}
    finally:
        stop(again)
    for (path, _), answer in after.items():       # the answers without the job answered during the stop
        if path.startswith('/api/jobs?'):
            assert answer['jobs'][0]['id'] == in_flight['id']
            answer['jobs'], answer['total'] = answer['jobs'][1:], answer['total'] - 1
        if path == '/api/stats':
            answer['totalJobs'], answer['openJobs'] = answer['totalJobs'] - 1, answer['openJobs'] - 1
    assert after == before


def test_sigkill_of_the_process_group_under_load_loses_at_most_the_last_sync_interval(tmp_path):
    url = f'file://{tmp_path}/replica'
    server = replicated(tmp_path / 'live.db', url, new_session=True)
    requester = account(server, 'requester')
    acknowledged = []       # (job id, monotonic time of its 201)
    stopping = threading.Event()

    def post_jobs():
        session = requests.Session()
        session.headers['Authorization'] = f'Bearer {requester}'
        for n in range(5000):
            if stopping.is_set():
                return
            try:
                answer = session.post(server.url + '/api/jobs', json=job_body(title=f'Load {n}'), timeout=TIMEOUT)
            except requests.RequestException:      # refused, reset, or an answer cut off by the kill: not acknowledged
                return
            if answer.status_code == 201:
                acknowledged.append((answer.json()['job']['id'], time.monotonic()))

    writer = threading.Thread(target=post_jobs)
    try:
        writer.start()
        deadline = time.monotonic() + 20
        while len(acknowledged) < 150 and time.monotonic() < deadline and writer.is_alive():
            time.sleep(0.02)
        time.sleep(2.5)                         # load across a few sync intervals
        killed_at = time.monotonic()
        os.killpg(server.process.pid, signal.SIGKILL)     # litestream and the server, no chance to sync
        stopping.set()
        writer.join(TIMEOUT)
        server.process.wait(TIMEOUT)
    finally:
        stopping.set()
        stop(server)
    assert len(acknowledged) >= 150

    restored = tmp_path / 'restored.db'
    code, printed = restore(restored, url)
    assert code == 0, printed
    assert printed.splitlines()[1:] == ['integrity: ok', 'ledger: balanced']
    db = mp.Database(restored)
    try:
        present = {row['id'] for row in db.rows('SELECT id FROM jobs')}
    finally:
        db.close()
    missing = [(job_id, at) for job_id, at in acknowledged if job_id not in present]
    ids = [job_id for job_id, _ in acknowledged]
    assert ids[:len(ids) - len(missing)] == [job_id for job_id in ids if job_id in present]    # a prefix survives
    print(f'\nSIGKILL under load: {len(acknowledged)} jobs acknowledged, {len(missing)} missing after restore, '
          f'the oldest missing acknowledged {killed_at - missing[0][1]:.2f} s before the kill' if missing else
          f'\nSIGKILL under load: {len(acknowledged)} jobs acknowledged, none missing after restore')
    assert all(killed_at - at <= SYNC_SECONDS + UPLOAD_MARGIN for _, at in missing), missing


def test_point_in_time_restore_between_two_batches(tmp_path):
    url = f'file://{tmp_path}/replica'
    server = replicated(tmp_path / 'live.db', url)
    try:
        requester = account(server, 'requester')
        first = [post_job(server, requester, f'First {n}') for n in range(3)]
        # The moment between the batches: after the first batch's sync (within one interval), before the second.
        between = datetime.now(timezone.utc) + timedelta(seconds=SYNC_SECONDS + UPLOAD_MARGIN)
        time.sleep((between - datetime.now(timezone.utc)).total_seconds() + UPLOAD_MARGIN)
        second = [post_job(server, requester, f'Second {n}') for n in range(3)]
        assert server.terminate() == 0
    finally:
        stop(server)

    def jobs_in(path):
        db = mp.Database(path)
        try:
            return {row['id'] for row in db.rows('SELECT id FROM jobs')}
        finally:
            db.close()

    code, printed = restore(tmp_path / 'then.db', url, timestamp=between.isoformat())
    assert code == 0, printed
    assert printed.splitlines() == [f'Restored {url} to {tmp_path / "then.db"} as of {between.isoformat()}',
                                    'integrity: ok', 'ledger: balanced']
    assert jobs_in(tmp_path / 'then.db') == set(first)
    code, printed = restore(tmp_path / 'now.db', url)
    assert code == 0, printed
    assert jobs_in(tmp_path / 'now.db') == set(first) | set(second)


def test_the_server_stops_when_litestream_is_killed_alone(tmp_path):
    server = replicated(tmp_path / 'live.db', f'file://{tmp_path}/replica', new_session=True)
    try:
        server.process.kill()       # litestream alone: the server, its child, must not serve unreplicated writes
        server.process.wait(TIMEOUT)
        assert server.out.wait_for('marketplace INFO stopped')      # within about a second
        output = server.out.text()
        with pytest.raises(requests.ConnectionError):
            requests.get(server.url + '/api/health', timeout=TIMEOUT)
    finally:
        try:
            os.killpg(server.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert 'marketplace ERROR litestream, which replicates the database, is gone: stopping' in output


@pytest.mark.parametrize('existing', ['', '-wal', '-shm'])
def test_restore_never_overwrites(tmp_path, existing):
    target = tmp_path / 'market.db'
    taken = tmp_path / f'market.db{existing}'
    taken.write_bytes(b'what was here')
    code, printed = restore(target, f'file://{tmp_path}/replica')
    assert code == 1
    assert printed == f'restore: {taken} exists: restore onto a new path (nothing was changed)\n'
    assert taken.read_bytes() == b'what was here'
    assert sorted(path.name for path in tmp_path.iterdir()) == [taken.name]


def test_a_start_that_cannot_reach_the_replica_says_so_in_one_line(s3, tmp_path):
    env = {**{name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}, **AWS_ENV}
    serve = [sys.executable, str(ROOT / 'marketplace.py'), 'serve', '--db', str(tmp_path / 'm.db'),
             '--port', str(free_port())]
    no_bucket = subprocess.run(serve + ['--replica-url', 's3://no-such-bucket/m', '--replica-endpoint', s3],
                               env=env, capture_output=True, text=True, timeout=30)
    assert no_bucket.returncode == 1
    assert no_bucket.stdout == ''
    assert no_bucket.stderr.startswith('marketplace.py serve: the replica s3://no-such-bucket/m cannot be reached: ')
    assert 'NoSuchBucket' in no_bucket.stderr and no_bucket.stderr.count('\n') == 1
    assert SECRET not in no_bucket.stderr
    (tmp_path / 'a-file').write_text('')
    unwritable = subprocess.run(serve + ['--replica-url', f'file://{tmp_path}/a-file/replica'],
                                env=env, capture_output=True, text=True, timeout=30)
    assert unwritable.returncode == 1
    assert unwritable.stderr == (f'marketplace.py serve: the replica file://{tmp_path}/a-file/replica cannot be '
                                 'written: Not a directory\n')
    assert not (tmp_path / 'm.db').exists()


def test_health_shows_the_replica_without_credentials_and_the_logs_hide_them(tmp_path, monkeypatch):
    monkeypatch.setenv('AWS_SECRET_ACCESS_KEY', SECRET)
    settings = mp.Settings(db=str(tmp_path / 'm.db'), replica_url='s3://AKIAKEY:url-secret-123@backups/m?x=1')
    app = wiring.make_app(settings)
    try:
        answer = mp.call_app(app, 'GET', '/api/health', None, None, None)
        assert answer[0] == 200
        assert answer[2]['replication'] == {'enabled': True, 'url': 's3://backups/m'}
        assert app.service.db.value('PRAGMA wal_autocheckpoint') == 0      # checkpoints left to Litestream
    finally:
        app.service.close()
    hidden = mp.setting_secrets(settings)
    assert SECRET in hidden and 'url-secret-123' in hidden and 'AKIAKEY:url-secret-123' in hidden
    plain_db = mp.Database(tmp_path / 'plain.db')
    try:
        assert plain_db.value('PRAGMA wal_autocheckpoint') == 1000
    finally:
        plain_db.close()


def test_litestream_comes_from_the_virtual_environment():
    assert replication.litestream_binary() == os.path.join(sys.prefix, 'bin', 'litestream')
    version = subprocess.run([replication.litestream_binary(), 'version'], capture_output=True, text=True, timeout=10)
    assert version.stdout.strip() == '0.5.17'
