"""A read replica opened before the primary's first Litestream compaction (issue 30, CONTRACT.md 24). litestream-vfs
0.5.17 stops that replica's connection at the primary's second compaction (`poll L1: non-contiguous ltx file`) and
it never reads another change; the replica must notice by its lag, refuse reads meanwhile and reopen its view, so
that a job posted on the primary 2, 5 and 10 minutes later is read on it within 10 seconds.

Litestream compacts at :00 and :30 of the wall clock, so the primary starts just after one and the replica four
seconds later, as the issue's recipe does. The whole test takes about 11 minutes: it runs in `make test-replicas`
(which .ci/run runs after `make test`), and is skipped by `make test`.
"""

import os
import re
import time

import pytest
import requests

from conftest import ADMIN_KEY, LiveServer, job_body
from test_server import Output, bearer, stop

pytestmark = pytest.mark.skipif(os.environ.get('MARKETPLACE_TEST_REPLICAS') != '1',
                                reason='11 minutes: run by make test-replicas')

TIMEOUT = 10        # seconds for any one HTTP call: only to avoid hanging, never asserted
SEEN_WITHIN = 10    # CONTRACT.md 24: a job posted on the primary is read on the replica within 10 s
CHECKS = (120, 300, 600)     # seconds after the primary's start: 2, 5 and 10 minutes


def reopenings(server):
    text = requests.get(server.url + '/metrics', headers=bearer(ADMIN_KEY), timeout=TIMEOUT).text
    return float(re.search(r'^marketplace_replica_reopenings_total (\S+)$', text, re.M)[1])


def test_a_replica_opened_before_the_first_compaction_still_follows_the_primary_10_minutes_later(tmp_path):
    replica_url = f'file://{tmp_path}/replica'
    while int(time.time()) % 30 != 1:       # just after a compaction of the wall clock's
        time.sleep(0.1)
    primary = LiveServer(tmp_path / 'primary.db', ['--replica-url', replica_url, '--heartbeat-interval', '1']).start()
    started = time.monotonic()
    primary.out = Output(primary)
    replica = None
    try:
        time.sleep(max(0.0, 4 - (time.monotonic() - started)))
        replica = LiveServer(tmp_path / 'replica.db', ['--read-replica-of', replica_url,
                                                       '--max-replica-lag', '10']).start()
        replica.out = Output(replica)
        key = requests.post(primary.url + '/api/accounts', json={'name': 'requester'},
                            timeout=TIMEOUT).json()['apiKey']
        for at in CHECKS:
            time.sleep(max(0.0, at - (time.monotonic() - started)))
            posted = requests.post(primary.url + '/api/jobs', json=job_body(title=f'Posted at {at} s'),
                                   headers=bearer(key), timeout=TIMEOUT)
            assert posted.status_code == 201, posted.text
            job_id, sent = posted.json()['job']['id'], time.monotonic()
            answers = []
            while time.monotonic() - sent < SEEN_WITHIN:
                answer = requests.get(replica.url + f'/api/jobs/{job_id}', timeout=TIMEOUT)
                answers.append(answer.status_code)
                if answer.status_code == 200:
                    break
                assert answer.status_code in (404, 503), answer.text     # not yet there, or refused while lagging
                time.sleep(0.2)
            assert answers[-1] == 200, f'the job posted at {at} s was not read on the replica within ' \
                                       f'{SEEN_WITHIN} s: {answers[-5:]}'
            assert requests.get(replica.url + '/api/health', timeout=TIMEOUT).json()['status'] == 'ok'
        # The freeze did happen (so the test saw the reopening at work), and each reopening said why in one line.
        count = reopenings(replica)
        assert count >= 1
    finally:
        if replica is not None:
            stop(replica)
        primary.terminate()         # SIGTERM to Litestream, which stops the server it runs
    log = replica.out.text()
    assert 'non-contiguous ltx file' in log
    assert log.count('its view of the replica is reopened') == count
