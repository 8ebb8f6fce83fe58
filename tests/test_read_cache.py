"""The read cache (read_cache.py, CACHED_READS in marketplace.py): reads that repeat answered from memory, never
stale, never another caller's.

The property: writes and reads interleaved at random (every kind of caller: anonymous, the requester, the worker, a
stranger, an admin; private deliverables, disputes, rejected and cancelled jobs, jobs pending a card payment (opened, then
paid or expired), the caller's own jobs; the
clock moving on and the sweeps it starts), each read answered by the app with the cache is byte for byte what an app without it (on the same
database) answers at the same moment. And memory stays within its bound under 10,000 distinct queries; an ETag
from the generation, 304 on If-None-Match; hits and misses on /metrics.
"""

import hashlib
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, job_body, make_account, make_agent
from read_cache import ReadCache

CALLERS = ('anonymous', 'requester', 'worker', 'stranger', 'admin')


def header(answer, name):
    return {key.lower(): value for key, value in answer.headers.items()}.get(name.lower())


def apps(tmp_path, **overrides):
    """(with the cache, without it): two apps on one database; writes go through the first."""
    base = dict(db=str(tmp_path / 'cache.db'), rate_limits='off', admin_key=ADMIN_KEY, **overrides)
    cached = wiring.make_app(mp.Settings(**base))
    plain = wiring.make_app(mp.Settings(**dict(base, read_cache_mb=0)))
    assert cached.service.read_cache is not None and plain.service.read_cache is None
    return cached, plain


@pytest.fixture
def pair(tmp_path):
    """pair(**settings): apps() on this test's directory, both closed after the test."""
    made = []

    def make(**overrides):
        made.extend(apps(tmp_path, **overrides))
        return made[-2:]
    yield make
    for app in made:
        app.service.close()


class World:
    """A marketplace driven at random: its people, their jobs and claims."""

    def __init__(self, cached, plain):
        self.client, self.plain = Client(cached), Client(plain)
        requester, self.requester = make_account(self.client, 'requester')
        worker, self.worker = make_account(self.client, 'worker')
        _, self.stranger = make_account(self.client, 'stranger')
        self.agent, _ = make_agent(self.client, self.worker, name='searchable-agent')
        self.keys = {'anonymous': None, 'requester': self.requester, 'worker': self.worker,
                     'stranger': self.stranger, 'admin': ADMIN_KEY}
        self.jobs, self.claims = [], {}     # claims: job id -> claim
        self.pending = []                   # jobs waiting for their Checkout to be paid: (job, session id)

    def write(self, kind, pick):
        client = self.client
        if kind == 'checkout':      # a card payment opened (stripe mode's rules): the job pending_payment, hidden
            self.checkout(pick)
            return
        if kind in ('paid', 'unpaid') and self.pending:
            job, session = self.pending.pop(pick % len(self.pending))
            outcome = mp.settle_checkout(self.client.app.service.db, self.client.app.service.settings, {
                'id': session, 'client_reference_id': job['id'], 'amount_total': job['amount_cents'],
                'currency': 'usd', 'payment_intent': f'pi_{pick}', 'status': 'complete' if kind == 'paid' else
                'expired', 'payment_status': 'paid' if kind == 'paid' else 'unpaid'}, kind)
            assert outcome == ('opened' if kind == 'paid' else 'cancelled', job['id'])
            self.jobs.append({'id': job['id']})
            return
        if kind == 'post' or not self.jobs:
            currency = 'USD' if pick % 3 == 0 else 'USDC'
            deadline = mp.iso(mp.now() + mp.timedelta(hours=pick % 40 + 1))     # the clock's steps pass some
            answer = client.post('/api/jobs', job_body(title=f'searchable job {len(self.jobs)}', deadline=deadline,
                                                       paymentCurrency=currency), key=self.requester)
            if answer.status == 201:
                self.jobs.append(answer.json['job'])
            return
        job = self.jobs[pick % len(self.jobs)]
        claim = self.claims.get(job['id'])
        if kind == 'claim':
            answer = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': self.agent['id']}, key=self.worker)
            if answer.status == 201:
                self.claims[job['id']] = answer.json['claim']
        elif kind == 'deliver' and claim:
            client.post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': {
                'type': 'url', 'url': f'https://example.com/private/{pick}'}}, key=self.worker)
        elif kind == 'verify' and claim:
            client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': pick % 2 == 0,
                                                           'reason': 'not this'}, key=self.requester)
        elif kind == 'dispute' and claim:
            client.post(f'/api/jobs/{job["id"]}/dispute', {'claimId': claim['id'], 'reason': 'not what was asked'},
                        key=self.requester if pick % 2 else self.worker)
        elif kind == 'cancel':
            client.post(f'/api/jobs/{job["id"]}/cancel', key=self.requester)
        elif kind == 'agent':
            client.patch(f'/api/agents/{self.agent["id"]}', {'description': f'now {pick}'}, key=self.worker)
        elif kind == 'clock':
            mp.CLOCK.advance(hours=pick % 50)
        elif kind == 'sweep':
            mp.run_sweeps(client.app.service.db, client.app.service.settings)

    def checkout(self, pick):
        app = self.client.app
        account = app.service.db.row("SELECT id, role FROM accounts WHERE name = 'requester'")
        fields = mp.read_job_body(job_body(title=f'searchable pending {pick}', paymentCurrency='USD'), account)
        session = f'cs_test_{pick}_{len(self.pending)}'
        job = mp.create_job(app.service.db, app.service.settings, fields, checkout={
            'id': session, 'url': f'https://checkout.stripe.com/c/pay/{session}',
            'expires_at': mp.iso(mp.now() + mp.timedelta(minutes=30))})
        assert job['status'] == 'pending_payment'
        self.pending.append((job, session))

    def paths(self, pick):
        ids = [job['id'] for job in self.jobs] + [job['id'] for job, _ in self.pending]
        job = ids[pick % len(ids)] if ids else mp.new_id()
        return ['/api/jobs', '/api/jobs?limit=5', '/api/jobs?status=completed', '/api/jobs?status=disputed',
                '/api/jobs/search?q=searchable', f'/api/jobs/{job}', '/api/jobs/feed', '/api/jobs/feed?format=atom',
                '/api/agents', f'/api/agents/{self.agent["id"]}', '/api/jobs?category=code&sort=pay_desc']

    def read(self, who, pick):
        self.read_path(who, self.paths(pick)[pick % len(self.paths(pick))])

    def read_path(self, who, path):
        key = self.keys[who]
        first = self.client.get(path, key=key)
        truth = self.plain.get(path, key=key)
        assert (first.status, first.body) == (truth.status, truth.body), (who, path)
        again = self.client.get(path, key=key)          # from the cache now, when it was a 200
        assert (again.status, again.body) == (truth.status, truth.body), (who, path)


STEPS = st.lists(st.tuples(st.sampled_from(('post', 'claim', 'deliver', 'verify', 'dispute', 'cancel', 'agent',
                                            'clock', 'sweep', 'checkout', 'paid', 'unpaid',
                                            'read', 'read', 'read', 'read')),
                           st.sampled_from(CALLERS), st.integers(0, 1000)), min_size=5, max_size=60)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(steps=STEPS)
def test_cached_reads_are_what_an_uncached_app_answers_after_any_writes(tmp_path_factory, steps):
    tmp = tmp_path_factory.mktemp('cache')
    cached, plain = apps(tmp)
    mp.CLOCK.set(mp.now())
    try:
        world = World(cached, plain)
        for kind, who, pick in steps:
            if kind == 'read':
                world.read(who, pick)
            else:
                world.write(kind, pick)
        for who in CALLERS:                             # at the end, everything once more, by everyone
            for pick in range(len(world.paths(0))):
                world.read(who, pick)
        world.checkout(0)                               # and a job pending payment, read by each as it is, then paid
        job, _ = world.pending[-1]
        for who in CALLERS:
            world.read_path(who, f'/api/jobs/{job["id"]}')
            world.read_path(who, '/api/jobs/search?q=pending')
        world.write('paid', len(world.pending) - 1)
        for who in CALLERS:
            world.read_path(who, f'/api/jobs/{job["id"]}')
            world.read_path(who, '/api/jobs/search?q=pending')
        assert cached.service.read_cache.hits > 0
    finally:
        mp.CLOCK.set(None)
        cached.service.close()
        plain.service.close()


def test_a_write_is_never_followed_by_an_older_answer(pair):
    cached, plain = pair()
    client = Client(cached)
    _, key = make_account(client, 'requester')
    for n in range(5):
        assert client.get('/api/jobs').json['total'] == n
        assert client.get('/api/jobs').json['total'] == n           # a hit
        assert client.post('/api/jobs', job_body(title=f'job {n}'), key=key).status == 201
    assert client.get('/api/jobs').json['total'] == 5
    assert cached.service.read_cache.hits >= 5


def test_a_private_deliverable_cached_for_its_requester_is_never_shown_to_a_stranger(pair):
    cached, plain = pair()
    client = Client(cached)
    world = World(cached, plain)
    world.write('post', 1)
    world.write('claim', 0)
    world.write('deliver', 0)
    path = f'/api/jobs/{world.jobs[0]["id"]}'
    mine = client.get(path, key=world.requester)
    assert mine.json['claims'][0]['deliverable']['url'] == 'https://example.com/private/0'
    assert client.get(path, key=world.requester).body == mine.body         # kept
    for key in (None, world.stranger):
        shown = client.get(path, key=key)
        assert shown.status == 200 and 'example.com/private' not in json.dumps(shown.json)


def test_an_etag_from_the_generation_answers_304_until_a_write(pair):
    cached, plain = pair()
    client = Client(cached)
    _, key = make_account(client, 'requester')
    first = client.get('/api/jobs/search?q=flaky')
    etag = header(first, 'ETag')
    generation = cached.service.db.value('SELECT n FROM generation')
    assert etag.startswith(f'"{generation}-')
    unchanged = client.get('/api/jobs/search?q=flaky', headers={'If-None-Match': etag})
    assert (unchanged.status, unchanged.body) == (304, b'')
    other = client.get('/api/jobs/search?q=flaky', key=key, headers={'If-None-Match': etag})
    assert other.status == 200                                      # another caller: another tag
    assert client.post('/api/jobs', job_body(title='Fix the flaky test'), key=key).status == 201
    changed = client.get('/api/jobs/search?q=flaky', headers={'If-None-Match': etag})
    assert changed.status == 200 and changed.json['total'] == 1 and header(changed, 'ETag') != etag
    missing = client.get(f'/api/jobs/{mp.new_id()}')
    assert missing.status == 404 and header(missing, 'ETag') is None      # only a 200 is tagged
    nobody = f'/api/jobs/{mp.new_id()}'         # a tag made up the server's way, for a job that is not there
    made_up = '"%d-%s"' % (cached.service.db.value('SELECT n FROM generation'), hashlib.sha256(
        repr(((nobody, '', None, None), None)).encode()).hexdigest()[:20])
    assert client.get(nobody, headers={'If-None-Match': made_up}).status == 404      # a 304 only names a 200


def test_memory_stays_within_its_bound_under_10000_distinct_queries(pair):
    cached, plain = pair(read_cache_mb=1)
    client = Client(cached)
    _, key = make_account(client, 'requester')
    for n in range(3):
        client.post('/api/jobs', job_body(title=f'word{n} job'), key=key)
    cache = cached.service.read_cache
    largest = 0
    for n in range(10_000):
        answer = client.get(f'/api/jobs/search?q=word{n % 3}&min_pay={n / 100:.2f}')
        assert answer.status == 200
        largest = max(largest, cache.size)
    assert cache.max_bytes == 2 ** 20 and largest <= cache.max_bytes
    assert 1_000 < len(cache) < 10_000          # many kept, the oldest forgotten


def test_the_cache_alone_keeps_its_bound_and_forgets_older_generations():
    cache = ReadCache(10_000)
    rng = random.Random(7)
    for n in range(10_000):
        cache.put((n // 1000, f'/q{n}', None, None), 'application/json', b'x' * rng.randrange(1, 500), f'"{n}"')
        assert cache.size <= 10_000
    assert cache.get((9, '/q9999', None, None)) == ('application/json', cache.get((9, '/q9999', None, None))[1],
                                                    '"9999"')
    assert cache.get((0, '/q0', None, None)) is None
    cache.forget_before(10)
    assert (len(cache), cache.size) == (0, 0)
    cache.put(('g', 'huge'), 'application/json', b'x' * 20_000, '"huge"')     # larger than the whole cache: not kept
    assert len(cache) == 0 and (cache.hits, cache.misses) == (2, 1)


def test_an_answer_kept_until_a_moment_is_not_given_at_or_after_it():
    cache = ReadCache(10_000)
    cache.put((1, '/feed'), 'application/rss+xml', b'<rss/>', '"1-a"', until='2026-11-27T12:00:00.000Z')
    assert cache.get((1, '/feed'), '2026-11-27T11:59:59.999Z') == ('application/rss+xml', b'<rss/>', '"1-a"')
    assert cache.get((1, '/feed'), '2026-11-27T12:00:00.000Z') is None
    assert (len(cache), cache.size) == (0, 0)           # forgotten, its bytes given back


def test_the_feed_drops_a_job_at_its_deadline_with_nothing_written_meanwhile(pair):
    cached, plain = pair()
    client, truth = Client(cached), Client(plain)
    _, key = make_account(client, 'requester')
    mp.CLOCK.set(mp.now())
    try:
        soon = mp.iso(mp.now() + mp.timedelta(hours=1))
        assert client.post('/api/jobs', job_body(title='Due soon', deadline=soon), key=key).status == 201
        assert client.post('/api/jobs', job_body(title='Due later'), key=key).status == 201
        first = client.get('/api/jobs/feed')
        assert b'Due soon' in first.body and client.get('/api/jobs/feed').body == first.body     # kept
        generation = cached.service.db.value('SELECT n FROM generation')
        mp.CLOCK.advance(hours=1)                       # the deadline: no write, the same generation
        assert cached.service.db.value('SELECT n FROM generation') == generation
        after = client.get('/api/jobs/feed', headers={'If-None-Match': header(first, 'ETag')})
        assert after.status == 200 and b'Due soon' not in after.body and b'Due later' in after.body
        assert after.body == truth.get('/api/jobs/feed').body and header(after, 'ETag') != header(first, 'ETag')
        again = client.get('/api/jobs/feed', headers={'If-None-Match': header(after, 'ETag')})
        assert (again.status, again.body) == (304, b'')
    finally:
        mp.CLOCK.set(None)


@pytest.mark.parametrize('path', ['/api/jobs', '/api/agents'])
def test_the_cache_off_answers_without_an_etag(pair, path):
    _, plain = pair()
    assert header(Client(plain).get(path), 'ETag') is None


def test_metrics_show_the_hit_ratio(pair):
    cached, plain = pair()
    client = Client(cached)
    for _ in range(4):
        assert client.get('/api/jobs').status == 200       # one miss, three hits
    shown = client.get('/metrics', key=ADMIN_KEY).body
    shown = shown.decode() if isinstance(shown, bytes) else shown
    assert 'marketplace_read_cache_hits_total 3.0' in shown and 'marketplace_read_cache_misses_total 1.0' in shown
    assert 'marketplace_read_cache_hit_ratio 0.75' in shown
