"""GET /metrics: Prometheus's text format (read back with prometheus_client's own parser) after a scripted workload
on the real server: counts equal what was sent, by route template and status, with no id in any label; an open
stream is counted while it is held; admin keys only on the main port, no key on the --metrics-port listener, which
serves nothing else. The gauges read from the database, in-process."""

import os
import subprocess
import sys
import time
import uuid

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, LiveServer, free_port, make_account, make_agent, make_job
from test_server import TIMEOUT, Output, get_job, new_account, new_job, stop

ROUTE_TEMPLATES = {rule for _, rule, _, _ in mp.ROUTES} | {'(unmatched)'}


def parse(text):
    """{(sample name, sorted labels): value} of a scrape."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def requests_counted(samples):
    """{(method, route, status): count} of marketplace_http_requests_total."""
    return {(labels['method'], labels['route'], labels['status']): value
            for (name, pairs), value in samples.items() if name == 'marketplace_http_requests_total'
            for labels in [dict(pairs)]}


def value(samples, name, **labels):
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    """The real server with the keyless metrics listener on a second port; streams beat every 0.2 s (a closed one
    is noticed at its next beat) and the sweep runs every 0.5 s."""
    listener = free_port()
    live = LiveServer(tmp_path_factory.mktemp('metrics') / 'metrics.db',
                      ['--metrics-port', str(listener), '--stream-heartbeat', '0.2', '--sweep-interval', '0.5'])
    live.started_at = time.time()
    live.start()
    live.metrics_url = f'http://127.0.0.1:{listener}/metrics'
    Output(live)
    yield live
    stop(live)


def scrape(server):
    """A scrape of the keyless listener (not counted as a request)."""
    answer = requests.get(server.metrics_url, timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    assert answer.headers['Content-Type'] == 'text/plain; version=0.0.4; charset=utf-8'
    return parse(answer.text)


def test_counts_equal_the_scripted_workload_by_route_template_and_status(server):
    before = scrape(server)
    account, key = new_account(server, 'metrics-requester')
    jobs = [new_job(server, key, title=f'Counted job {n}') for n in range(5)]
    for n in range(7):
        get_job(server, jobs[n % 5]['id'])
    missing = [str(uuid.uuid4()) for _ in range(2)]
    for job_id in missing:
        assert requests.get(f'{server.url}/api/jobs/{job_id}', timeout=TIMEOUT).status_code == 404
    unknown = [str(uuid.uuid4()) for _ in range(3)]
    for thing in unknown:
        assert requests.get(f'{server.url}/api/nothing/{thing}', timeout=TIMEOUT).status_code == 404
    stream = requests.get(server.url + '/api/jobs/stream', stream=True, timeout=TIMEOUT)
    lines = stream.iter_lines()
    assert next(line for line in lines if line.startswith(b'event:')) == b'event: connected'

    held = scrape(server)
    counted = requests_counted(held)
    changed = {labels: count - requests_counted(before).get(labels, 0) for labels, count in counted.items()
               if count != requests_counted(before).get(labels, 0)}
    assert changed == {('POST', '/api/accounts', '201'): 1, ('POST', '/api/jobs', '201'): 5,
                       ('GET', '/api/jobs/<job_id>', '200'): 7, ('GET', '/api/jobs/<job_id>', '404'): 2,
                       ('GET', '(unmatched)', '404'): 3, ('GET', '/api/jobs/stream', '200'): 1}
    durations = 'marketplace_http_request_duration_seconds_count'
    assert (value(held, durations, method='GET', route='/api/jobs/<job_id>')
            - before.get((durations, (('method', 'GET'), ('route', '/api/jobs/<job_id>'))), 0)) == 9
    assert value(held, 'marketplace_open_streams') == 1

    ids = [job['id'] for job in jobs] + missing + unknown + [account['id']]
    labels = {pairs for _, pairs in held}
    label_values = {value for pairs in labels for _, value in pairs}
    assert [(value, id_) for value in label_values for id_ in ids if id_ in value] == []
    assert {dict(pairs)['route'] for pairs in labels if 'route' in dict(pairs)} <= ROUTE_TEMPLATES

    stream.close()      # the server notices at the stream's next heartbeat
    deadline = time.monotonic() + 5
    while value(scrape(server), 'marketplace_open_streams') != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert value(scrape(server), 'marketplace_open_streams') == 0


def test_the_main_port_answers_only_admin_keys_and_counts_its_scrapes(server):
    _, member_key = new_account(server, 'metrics-member')
    before = requests_counted(scrape(server))
    refused = requests.get(server.url + '/metrics', timeout=TIMEOUT)
    assert (refused.status_code, refused.json()['code']) == (401, 'unauthorized')
    forbidden = requests.get(server.url + '/metrics', headers={'Authorization': f'Bearer {member_key}'},
                             timeout=TIMEOUT)
    assert (forbidden.status_code, forbidden.json()) == (
        403, {'error': 'Only an admin key may read the metrics.', 'code': 'forbidden', 'status': 403})
    first = requests.get(server.url + '/metrics', headers={'Authorization': f'Bearer {ADMIN_KEY}'}, timeout=TIMEOUT)
    assert first.status_code == 200
    assert first.headers['Content-Type'] == 'text/plain; version=0.0.4; charset=utf-8'
    counted = requests_counted(parse(first.text))
    # a scrape is counted once answered: the first sees the refusals, not itself
    assert counted[('GET', '/metrics', '401')] - before.get(('GET', '/metrics', '401'), 0) == 1
    assert counted[('GET', '/metrics', '403')] - before.get(('GET', '/metrics', '403'), 0) == 1
    assert counted.get(('GET', '/metrics', '200'), 0) == before.get(('GET', '/metrics', '200'), 0)
    after = requests_counted(scrape(server))
    assert after[('GET', '/metrics', '200')] - before.get(('GET', '/metrics', '200'), 0) == 1


def test_the_listener_serves_only_metrics_and_its_scrapes_are_not_counted(server):
    before = requests_counted(scrape(server))
    other = requests.get(server.metrics_url.replace('/metrics', '/api/jobs'), timeout=TIMEOUT)
    assert (other.status_code, other.json()) == (
        404, {'error': 'This listener serves only GET /metrics.', 'code': 'not_found', 'status': 404})
    posted = requests.post(server.metrics_url, timeout=TIMEOUT)
    assert (posted.status_code, posted.headers['Allow'], posted.json()['code']) == (405, 'GET, HEAD',
                                                                                 'method_not_allowed')
    assert requests_counted(scrape(server)) == before


def test_the_last_sweep_is_shown_once_one_ran(server):
    deadline = time.monotonic() + 10
    samples = scrape(server)
    while ('marketplace_last_sweep_timestamp_seconds', ()) not in samples and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = scrape(server)
    assert server.started_at < value(samples, 'marketplace_last_sweep_timestamp_seconds') <= time.time()
    assert 0 <= value(samples, 'marketplace_last_sweep_duration_seconds') < 5


# In-process: the gauges read from the database ---------------------------------

def in_process_scrape(client):
    answer = client.get('/metrics', key=ADMIN_KEY)
    assert answer.status == 200, answer
    return parse(answer.body.decode())


def test_webhook_deliveries_payments_pending_and_the_database_size(client, app):
    db = app.service.db
    _, key = make_account(client, 'hooks')
    for name in ('first', 'second'):
        make_agent(client, key, name=name, webhookUrl=f'http://127.0.0.1:9/{name}')
    _, requester_key = make_account(client, 'requester')
    job = make_job(client, requester_key)
    cancelled = client.post(f'/api/jobs/{job["id"]}/cancel', key=requester_key)
    assert cancelled.status == 200, cancelled
    db.execute("UPDATE webhook_deliveries SET status = 'failed' WHERE rowid = (SELECT min(rowid) FROM "
               "webhook_deliveries)")
    # a refund sent and not confirmed yet, as on chain or through Stripe
    db.execute("UPDATE payments SET status = 'pending' WHERE type = 'refund'")
    samples = in_process_scrape(client)
    deliveries = db.rows('SELECT status, count(*) AS n FROM webhook_deliveries GROUP BY status')
    assert {row['status']: row['n'] for row in deliveries} == {'pending': 1, 'failed': 1}   # job.new to each
    assert value(samples, 'marketplace_webhook_deliveries', status='pending') == 1
    assert value(samples, 'marketplace_webhook_deliveries', status='failed') == 1
    assert {dict(pairs)['rail'] + ' ' + dict(pairs)['kind']: count for (name, pairs), count in samples.items()
            if name == 'marketplace_payments_pending'} == {'base payout': 0, 'base refund': 1, 'stripe payout': 0,
                                                          'stripe refund': 0}
    db.execute("UPDATE payments SET status = 'simulated' WHERE type = 'refund'")
    sizes = sum(os.path.getsize(path) for path in (db.path, db.path + '-wal') if os.path.exists(path))
    assert value(in_process_scrape(client), 'marketplace_database_bytes') == sizes > 0
    assert ('marketplace_chain_reachable', ()) not in samples       # simulated payments: no chain
    assert ('marketplace_last_sweep_timestamp_seconds', ()) not in samples  # no sweep has run


def test_chain_reachability_is_what_the_last_check_found(client, app, monkeypatch):
    class Node:
        reachable = False
        contract = None         # the escrow wallet's mode: no proposals to count

        def health(self):
            return {'reachable': self.reachable}

    node = Node()
    monkeypatch.setattr(app.service.settings, 'onchain', node, raising=False)
    assert value(in_process_scrape(client), 'marketplace_chain_reachable') == 0
    node.reachable = True
    assert value(in_process_scrape(client), 'marketplace_chain_reachable') == 1


def test_apps_in_one_process_count_apart(client, tmp_path):
    other = wiring.make_app(mp.Settings(db=str(tmp_path / 'other.db'), admin_key=ADMIN_KEY, rate_limits='off'))
    try:
        for _ in range(3):
            client.get('/api/stats')
        mine = requests_counted(in_process_scrape(client))
        theirs = requests_counted(parse(mp.call_app(other, 'GET', '/metrics', key=ADMIN_KEY)[2].decode()))
        assert mine[('GET', '/api/stats', '200')] == 3
        assert ('GET', '/api/stats', '200') not in theirs
    finally:
        other.service.close()


def test_a_metrics_port_that_cannot_be_had_stops_the_start_with_one_line(tmp_path):
    """--metrics-port on a port already taken (here the main one): serve exits 2 naming it, no traceback."""
    port = free_port()
    started = subprocess.run([sys.executable, str(mp.HERE / 'marketplace.py'), 'serve', '--db', str(tmp_path / 'm.db'),
                              '--port', str(port), '--metrics-port', str(port)],
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 2
    assert f'cannot listen on 127.0.0.1:{port}: Address already in use' in started.stderr
    assert 'Traceback' not in started.stderr
