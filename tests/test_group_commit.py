"""Group commit (Database.transaction): concurrent writes share one COMMIT, each in its own savepoint.

In-process, with threads and a COMMIT held back by a hook, groups form at known places: a lone write commits at
once and alone, a failing member undoes only itself, a failed COMMIT fails every member and applies none, a kill
during a COMMIT on its thread waits for it, a COMMIT never waits for gevent's
thread pool (full of slow name lookups), and outbox events that reach nobody share one fan-out. Through
the real server: a claim that loses a race amid unrelated posts undoes none of them, keys sent many times at once
inside groups make one job each, and SIGKILL in the middle of 32 posters loses no answered job and half-writes none.
"""

import concurrent.futures
import json
import threading
import time
import uuid

import apsw
import pytest
import requests

import marketplace as mp
from conftest import LiveServer, job_body
from test_server import Output


class Commits:
    """The sizes of the groups a database commits; with `hold`, its first COMMIT waits until `release()`."""

    def __init__(self, db, monkeypatch, hold=False, fail=()):
        self.db, self.sizes, self.fail = db, [], set(fail)     # fail: the numbers (from 1) of COMMITs that fail
        self.held = threading.Event()
        self.released = threading.Event()
        if not hold:
            self.released.set()
        commit_group, durable_commit = db.commit_group, db.durable_commit

        def record(group):
            self.sizes.append(group.members)
            return commit_group(group)

        def commit():
            self.held.set()
            self.released.wait(10)
            if len(self.sizes) in self.fail:
                return apsw.FullError('database or disk is full (simulated)'), None
            return durable_commit()

        monkeypatch.setattr(db, 'commit_group', record)
        monkeypatch.setattr(db, 'durable_commit', commit)

    def release_when_waiting(self, count):
        """Let the held COMMIT go once `count` transactions wait for the writer lock (they will form a group)."""
        deadline = time.monotonic() + 10
        while self.db._waiting < count and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.db._waiting == count
        self.released.set()


def account_count(db, name):
    return db.value('SELECT count(*) FROM accounts WHERE name = :name', {'name': name})


def in_threads(*work):
    """Run each callable in its own thread, the first alone until its COMMIT is held; their results or errors."""
    with concurrent.futures.ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(item) for item in work]
        concurrent.futures.wait(futures, timeout=20)
    return [future.exception() or future.result() for future in futures]


def grouped(db, monkeypatch, first, rest, fail=()):
    """`first` alone, its COMMIT held until every one of `rest` waits for the writer, so `rest` form one group."""
    commits = Commits(db, monkeypatch, hold=True, fail=fail)
    with concurrent.futures.ThreadPoolExecutor(1 + len(rest)) as pool:
        leading = pool.submit(first)
        assert commits.held.wait(10)
        futures = [pool.submit(item) for item in rest]
        commits.release_when_waiting(len(rest))
        concurrent.futures.wait([leading, *futures], timeout=20)
    return commits, [future.exception() or future.result() for future in [leading, *futures]]


def test_a_lone_write_commits_at_once_in_a_group_of_its_own(app, client, monkeypatch):
    db = app.service.db
    commits = Commits(db, monkeypatch)
    account, key = mp.create_account(db, 'alone')
    assert commits.sizes == [1] and db._group is None      # committed before create_account returned
    assert account_count(db, 'alone') == 1
    job = client.post('/api/jobs', job_body(title='Alone'), key=key)
    assert job.status == 201
    assert set(commits.sizes) == {1}        # the post and the fan-out's look at the outbox: each alone, at once
    assert db.value('SELECT status FROM jobs WHERE id = :id', {'id': job.json['job']['id']}) == 'open'


def test_writers_waiting_together_share_one_commit(app, monkeypatch):
    db = app.service.db
    commits, results = grouped(db, monkeypatch, lambda: mp.create_account(db, 'first'),
                               [lambda: mp.create_account(db, 'grouped') for _ in range(8)])
    assert commits.sizes == [1, 8]
    assert all(isinstance(result, tuple) for result in results), results
    assert account_count(db, 'grouped') == 8


def test_a_failing_member_undoes_only_itself(app, monkeypatch):
    db = app.service.db

    def failing():
        with db.transaction():
            mp.create_account(db, 'undone')
            raise mp.Conflict('lost a race', code='already_claimed')

    commits, results = grouped(db, monkeypatch, lambda: mp.create_account(db, 'first'),
                               [lambda: mp.create_account(db, 'kept'), failing,
                                lambda: mp.create_account(db, 'kept')])
    assert commits.sizes == [1, 2]
    assert [type(result) for result in results] == [tuple, tuple, mp.Conflict, tuple]
    assert results[2].code == 'already_claimed'         # its own error
    assert (account_count(db, 'kept'), account_count(db, 'undone')) == (2, 0)


def test_a_failed_commit_fails_every_member_and_applies_none(app, client, monkeypatch):
    db = app.service.db
    commits, results = grouped(db, monkeypatch, lambda: mp.create_account(db, 'first'),
                               [lambda: mp.create_account(db, 'lost') for _ in range(3)], fail={2})
    assert commits.sizes == [1, 3]
    assert [type(result) for result in results] == [tuple] + [mp.CommitFailed] * 3
    assert (account_count(db, 'first'), account_count(db, 'lost')) == (1, 0)
    assert not db.conn.in_transaction
    # Through the API: the answer is the JSON 503, and the job is not there (the ledger balances: the fixture).
    _, key = mp.create_account(db, 'poster')
    monkeypatch.setattr(db, 'durable_commit', lambda: (apsw.FullError('disk full (simulated)'), None))
    answer = client.post('/api/jobs', job_body(title='Never written'), key=key)
    assert (answer.status, answer.json['code'], answer.json['status']) == (503, 'commit_failed', 503)
    assert answer.headers['Retry-After'] == '1'
    monkeypatch.undo()
    assert db.value("SELECT count(*) FROM jobs WHERE title = 'Never written'") == 0
    assert client.post('/api/jobs', job_body(title='Written'), key=key).status == 201


class SlowCommits:
    """The writing connection, its COMMIT slowed down (in the thread that runs it)."""

    def __init__(self, conn, seconds):
        self.conn, self.seconds = conn, seconds

    def execute(self, sql, *args):
        if sql == 'COMMIT':
            time.sleep(self.seconds)
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_a_kill_during_the_commit_waits_for_it_and_leaves_the_writer_usable(app, monkeypatch):
    """A greenlet killed while its group's COMMIT runs in gevent's thread pool (a server stopping kills the
    fan-out's) waits for that COMMIT: nothing touches the connection meanwhile, and the change is there."""
    import gevent
    db = app.service.db
    monkeypatch.setattr(db, 'commit_in_thread', True)
    monkeypatch.setattr(db, 'conn', SlowCommits(db.conn, 0.3))
    committing = gevent.spawn(mp.create_account, db, 'killed while committing')
    gevent.sleep(0.1)                # in its COMMIT now
    committing.kill()
    assert committing.dead and isinstance(committing.value, gevent.GreenletExit)    # killed, not finished
    assert account_count(db, 'killed while committing') == 1
    assert (db._group, db._owner, db.conn.in_transaction) == (None, None, False)
    mp.create_account(db, 'after')
    assert account_count(db, 'after') == 1


def test_a_commit_runs_on_a_thread_of_its_own_while_gevents_pool_is_full(app, monkeypatch):
    """CONTRACT.md 20: nothing outside waits in a commit's way. Every thread of gevent's pool is taken (as slow
    name lookups take them), yet a write commits, on a thread that is none of them; today it waited for one."""
    import gevent
    db = app.service.db
    monkeypatch.setattr(db, 'commit_in_thread', True)
    pool, gate, busy = gevent.get_hub().threadpool, threading.Event(), []

    def lookup():
        busy.append(threading.get_ident())
        gate.wait(30)
    blockers = [pool.spawn(lookup) for _ in range(pool.maxsize)]
    try:
        deadline = time.monotonic() + 10
        while len(busy) < pool.maxsize and time.monotonic() < deadline:
            gevent.sleep(0.01)
        assert len(busy) == pool.maxsize
        committer = []
        monkeypatch.setattr(db, 'conn', CommitThread(db.conn, committer))
        writing = gevent.spawn(mp.create_account, db, 'written while the pool is full')
        writing.join(timeout=10)        # only a bound on the wait: it commits at once
        assert writing.successful(), writing.exception
        assert not any(blocker.ready() for blocker in blockers)      # the pool still full: it did not wait for it
    finally:
        gate.set()
        gevent.joinall(blockers, timeout=10)
    assert account_count(db, 'written while the pool is full') == 1
    assert len(committer) == 1 and committer[0] not in busy and committer[0] != threading.get_ident()


class CommitThread:
    """A connection that notes the thread each COMMIT runs on."""

    def __init__(self, conn, threads):
        self.conn, self.threads = conn, threads

    def execute(self, sql, *args):
        if sql == 'COMMIT':
            self.threads.append(threading.get_ident())
        return self.conn.execute(sql, *args)

    def __getattr__(self, name):
        return getattr(self.conn, name)


def test_events_for_few_agents_are_expanded_in_their_writes_transaction(app, client, monkeypatch):
    db = app.service.db
    _, key = mp.create_account(db, 'poster')
    monkeypatch.setattr(app.service, 'fan_out', lambda: None)        # a fan-out would run below
    commits = Commits(db, monkeypatch)
    for n in range(5):
        assert client.post('/api/jobs', job_body(title=f'Fanned {n}'), key=key).status == 201
    assert commits.sizes == [1] * 5                 # one transaction a post, its event's expansion in it
    assert db.value('SELECT count(*) FROM webhook_events WHERE expanded_at IS NULL') == 0
    assert mp.fan_out_events(db) == 0
    assert commits.sizes == [1] * 5                 # and no fan-out transaction after them


# Through the real server -----------------------------------------------------

@pytest.fixture(scope='module')
def server(tmp_path_factory):
    server = LiveServer(tmp_path_factory.mktemp('group') / 'group.db').start()
    server.log = Output(server)
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


def register(url, name):
    answer = requests.post(url + '/api/accounts', json={'name': name}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()['apiKey']


def post_job(url, key, title, idempotency_key=None, body=None):
    headers = {'Authorization': f'Bearer {key}'}
    if idempotency_key:
        headers['Idempotency-Key'] = idempotency_key
    return requests.post(url + '/api/jobs', json=body or job_body(title=title), headers=headers, timeout=30)


def test_a_claim_that_loses_a_race_undoes_nothing_of_its_group(server):
    requester = register(server.url, 'requester')
    job = post_job(server.url, requester, 'Contested').json()['job']
    workers = []
    for n in range(12):
        key = register(server.url, f'worker {n}')
        agent = requests.post(server.url + '/api/agents', headers={'Authorization': f'Bearer {key}'}, timeout=10,
                              json={'name': f'agent {n}', 'walletAddress': '0x' + f'{n + 1:040x}'}).json()['agent']
        workers.append((key, agent['id']))

    def claim(worker):
        key, agent_id = worker
        return requests.post(f'{server.url}/api/jobs/{job["id"]}/claim', json={'agentId': agent_id}, timeout=30,
                             headers={'Authorization': f'Bearer {key}'})

    barrier = threading.Barrier(12 + 24)
    work = [lambda worker=worker: (barrier.wait(), claim(worker))[1] for worker in workers]
    work += [lambda n=n: (barrier.wait(), post_job(server.url, requester, f'Beside the race {n}'))[1]
             for n in range(24)]
    answers = in_threads(*work)
    claims, posts = answers[:12], answers[12:]
    won = [answer for answer in claims if answer.status_code == 201]
    assert len(won) == 1, [answer.text for answer in claims]
    assert sorted({(answer.status_code, answer.json()['code']) for answer in claims if answer is not won[0]}) \
        in ([(409, 'already_claimed')], [(409, 'job_not_open')], [(409, 'already_claimed'), (409, 'job_not_open')])
    assert [answer.status_code for answer in posts] == [201] * 24
    for answer in posts:
        again = requests.get(server.url + '/api/jobs/' + answer.json()['job']['id'], timeout=10)
        assert again.json()['job']['title'] == answer.json()['job']['title']
    shown = requests.get(f'{server.url}/api/jobs/{job["id"]}', timeout=10).json()
    assert shown['job']['status'] == 'claimed'
    assert [claim['id'] for claim in shown['claims']] == [won[0].json()['claim']['id']]


def test_keys_sent_many_times_at_once_make_one_job_each(server):
    key = register(server.url, 'keyed')
    keys = [str(uuid.uuid4()) for _ in range(8)]
    bodies = [job_body(title=f'Keyed {n}') for n in range(8)]
    barrier = threading.Barrier(8 * 4 + 16)
    work = [lambda k=k, n=n: (barrier.wait(), post_job(server.url, key, None, k, bodies[n]))[1]
            for n, k in enumerate(keys) for _ in range(4)]
    work += [lambda n=n: (barrier.wait(), post_job(server.url, key, f'Unkeyed {n}'))[1] for n in range(16)]
    answers = in_threads(*work)
    for n, k in enumerate(keys):
        sent = answers[n * 4:(n + 1) * 4]
        created = {answer.json()['job']['id'] for answer in sent if answer.status_code == 201}
        assert len(created) == 1, [answer.text for answer in sent]
        assert {answer.status_code for answer in sent} <= {201, 409}
        assert all(answer.json()['code'] == 'idempotency_in_progress' for answer in sent if answer.status_code == 409)
        replay = post_job(server.url, key, None, k, bodies[n])
        assert (replay.status_code, replay.headers['Idempotent-Replayed']) == (201, 'true')
        assert replay.json()['job']['id'] == created.pop()
    assert [answer.status_code for answer in answers[32:]] == [201] * 16
    listed = requests.get(server.url + '/api/jobs?limit=200', timeout=10).json()['jobs']
    assert sorted(job['title'] for job in listed if job['title'].startswith('Keyed')) == \
        sorted(f'Keyed {n}' for n in range(8))


def test_the_server_says_how_many_transactions_its_commits_grouped(server):
    """After the tests above (many concurrent writes), fewer COMMITs than write transactions: they were grouped."""
    assert server.terminate() == 0
    line, = [line for line in server.log.text().splitlines() if 'group commits made' in line]
    commits, transactions = (int(word) for word in line.split() if word.isdigit())
    assert 0 < commits < transactions


def test_sigkill_amid_grouped_posts_loses_no_answered_job_and_halves_none(tmp_path):
    path = tmp_path / 'killed.db'
    server = LiveServer(path).start()
    output = Output(server)
    key = register(server.url, 'poster')
    answered, stop = [], threading.Event()

    def poster(n):
        session = requests.Session()
        count = 0
        while not stop.is_set():
            title = f'Poster {n} job {count}'
            count += 1
            try:
                answer = session.post(server.url + '/api/jobs', json=job_body(title=title), timeout=10,
                                      headers={'Authorization': f'Bearer {key}'})
            except requests.RequestException:
                return
            answered.append((title, answer.status_code, answer.json()['job']['id'] if answer.ok else None))

    threads = [threading.Thread(target=poster, args=(n,)) for n in range(32)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    while len(answered) < 300 and time.monotonic() < deadline:
        time.sleep(0.01)
    server.kill()
    stop.set()
    for thread in threads:
        thread.join(15)
    output.text()
    assert len(answered) >= 300
    assert {status for _, status, _ in answered} == {201}
    db = mp.Database(path)
    try:
        jobs = {row['id']: row for row in db.rows('SELECT id, title, status, escrow_status FROM jobs')}
        escrows = {row['job_id']: row['amount'] for row in db.rows(
            "SELECT job_id, amount FROM payments WHERE type = 'escrow'")}
        for title, _, job_id in answered:
            assert jobs[job_id]['title'] == title
        assert set(escrows) == set(jobs)     # every job there has its escrow, and no escrow is without its job
        assert set(escrows.values()) == {25_000_000}     # 25.00 USDC
        assert {(row['status'], row['escrow_status']) for row in jobs.values()} == {('open', 'locked')}
        assert mp.ledger_problems(db) == []
        assert json.loads(json.dumps(db.rows('PRAGMA integrity_check'))) == [{'integrity_check': 'ok'}]
    finally:
        db.close()
