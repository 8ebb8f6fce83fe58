"""Disputes and sweeps against the real server on 127.0.0.1: concurrent votes, dispute against approval,
concurrent resolutions, the sweeper greenlet, the `sweep` command and SIGTERM while the sweeper runs."""

import json
import subprocess
import sys
import time
from datetime import timedelta

import requests

from conftest import ADMIN_KEY, ROOT, LiveServer
from test_server import (TIMEOUT, claim_and_deliver, Output, bearer, cli_env, get_job, ledger_of, new_account, new_job, post,
                         register_agent, run_concurrently, stop)

import marketplace as mp
import wiring


# Helpers ---------------------------------------------------------------------

def seconds_ahead(seconds):
    """An ISO 8601 time with milliseconds, `seconds` from now."""
    return mp.iso(mp.now() + timedelta(seconds=seconds))


def patch(url, body, key):
    return requests.patch(url, json=body, headers=bearer(key), timeout=TIMEOUT)


def claim(server, job_id, agent_id, key):
    answer = post(f'{server.url}/api/jobs/{job_id}/claim', {'agentId': agent_id}, key)
    assert answer.status_code == 201, answer.text
    return answer.json()['claim']['id']


def delivered_job(server, requester_key, agent, worker_key, **overrides):
    """A job with one delivered claim: (job, claim id)."""
    job = new_job(server, requester_key, **overrides)
    return job, claim_and_deliver(server, job, agent['id'], worker_key)


def open_dispute(server, job_id, claim_id, requester_key):
    answer = post(f'{server.url}/api/jobs/{job_id}/dispute', {'claimId': claim_id, 'reason': 'Not what I asked for.'},
                  requester_key)
    assert answer.status_code == 201, answer.text
    assert answer.json()['job']['status'] == 'disputed'
    return answer.json()['dispute']


def get_dispute(server, dispute_id):
    answer = requests.get(f'{server.url}/api/disputes/{dispute_id}', timeout=TIMEOUT)
    assert answer.status_code == 200, answer.text
    return answer.json()


def payments_of(server, job_id):
    return [(p['type'], p['amount']) for p in get_job(server, job_id)['payments']]


def assert_conflict(answer, code):
    assert answer.status_code == 409, answer.text
    assert answer.json()['code'] == code, answer.text
    assert answer.json()['status'] == 409


def run_cli(*args):
    return subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), *args], cwd=ROOT, env=cli_env(),
                          capture_output=True, text=True, timeout=30)


def overdue_database(path, seconds=0.8):
    """A database (built in-process, then closed) holding one job whose deadline has just passed, claimed by
    an agent that never delivered, and one job with a far deadline, claimed too: (overdue id, far id)."""
    app = wiring.make_app(mp.Settings(db=str(path), rate_limits='off', admin_key=ADMIN_KEY))
    try:
        def call(method, url, body=None, key=None):
            status, _, answer = mp.call_app(app, method, url, body, key)
            assert status in (200, 201), (status, answer)
            return answer

        requester_key = call('POST', '/api/accounts', {'name': 'requester'})['apiKey']
        registered = call('POST', '/api/agents/register',
                          {'name': 'worker', 'walletAddress': '0x' + '5' * 40, 'capabilities': {'categories': ['code']}})
        agent_id, worker_key = registered['agent']['id'], registered['apiKey']
        deadline = mp.now() + timedelta(seconds=seconds)
        overdue = call('POST', '/api/jobs', {'title': 'Soon overdue', 'description': 'x', 'category': 'code',
                                             'paymentAmount': '12.00', 'deadline': mp.iso(deadline)},
                       requester_key)['job']
        far = call('POST', '/api/jobs', {'title': 'Far away', 'description': 'x', 'category': 'code',
                                         'paymentAmount': '7.00', 'deadline': seconds_ahead(48 * 3600)},
                   requester_key)['job']
        for job in (overdue, far):
            assert call('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': agent_id}, worker_key)['job']['status'] \
                == 'claimed'
    finally:
        app.service.close()
    time.sleep(max(0.0, (deadline - mp.now()).total_seconds()) + 0.1)
    assert mp.now() > deadline
    return overdue['id'], far['id']


def job_row(path, job_id):
    """(job status, escrow status, claim statuses, payment types) read straight from a database file."""
    db = mp.Database(path)
    try:
        job = db.row('SELECT status, escrow_status FROM jobs WHERE id = :id', {'id': job_id})
        claims = [r['status'] for r in db.rows('SELECT status FROM claims WHERE job_id = :id ORDER BY rowid',
                                               {'id': job_id})]
        payments = [r['type'] for r in db.rows('SELECT type FROM payments WHERE job_id = :id ORDER BY rowid',
                                               {'id': job_id})]
        return job['status'], job['escrow_status'], claims, payments
    finally:
        db.close()


# Concurrent votes ------------------------------------------------------------

def test_seven_concurrent_votes_resolve_a_three_vote_dispute_once(tmp_path):
    """Seven active arbitrators vote at once: the three of the dispute's panel are counted, the first two leave
    it open and the third decides it, once; the four others are refused (403 not_on_panel)."""
    server = LiveServer(tmp_path / 'votes.db').start()
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        arbitrators = []        # (arbitrator id, owner's key)
        for i in range(7):
            account, key = new_account(server, f'arbiter-{i}')
            answer = post(server.url + '/api/arbitrators',
                          {'name': f'arbiter {i}', 'walletAddress': '0x' + f'{i + 1:x}' * 40, 'accountId': account['id']},
                          ADMIN_KEY)
            assert answer.status_code == 201, answer.text
            assert answer.json()['arbitrator']['accountId'] == account['id']
            arbitrator_id = answer.json()['arbitrator']['id']
            assert patch(f'{server.url}/api/arbitrators/{arbitrator_id}', {'status': 'active'}, ADMIN_KEY).status_code \
                == 200
            arbitrators.append((arbitrator_id, key))
        job, claim_id = delivered_job(server, requester_key, agent, worker_key, paymentAmount='30.00')
        dispute = open_dispute(server, job['id'], claim_id, requester_key)
        assert dispute['requiredVotes'] == 3
        panel = [i for i, (arbitrator_id, _) in enumerate(arbitrators) if arbitrator_id in dispute['panel']]
        assert len(panel) == 3
        choices = ['worker'] * 5 + ['requester'] * 2

        answers = run_concurrently(7, lambda i: post(
            f'{server.url}/api/disputes/{dispute["id"]}/vote',
            {'arbitratorId': arbitrators[i][0], 'vote': choices[i], 'reasoning': f'arbiter {i}'}, arbitrators[i][1]))

        assert all(isinstance(a, requests.Response) for a in answers), answers
        assert sorted(a.status_code for a in answers) == [201] * 3 + [403] * 4, [a.text for a in answers]
        accepted = [(i, a.json()) for i, a in enumerate(answers) if a.status_code == 201]
        assert [i for i, _ in accepted] == panel
        for i, refused in enumerate(answers):
            if i not in panel:
                assert (refused.json()['code'], refused.json()['status']) == ('not_on_panel', 403), refused.text
        deciding = [body for _, body in accepted if body['resolved']]
        assert len(deciding) == 1, accepted
        assert deciding[0]['votesReceived'] == 3
        undecided = [body for _, body in accepted if not body['resolved']]
        assert sorted(body['votesReceived'] for body in undecided) == [1, 2]
        assert all(body['outcome'] is None and body['requiredVotes'] == 3 for body in undecided)
        for i, body in accepted:
            assert body['vote']['arbitratorId'] == arbitrators[i][0]
            assert body['vote']['vote'] == choices[i]
        accepted_choices = [choices[i] for i, _ in accepted]
        majority = max(('worker', 'requester'), key=accepted_choices.count)
        assert deciding[0]['outcome'] == majority

        shown = get_dispute(server, dispute['id'])
        assert shown['dispute']['status'] == 'resolved'
        assert shown['dispute']['votesReceived'] == 3
        assert shown['dispute']['outcome'] == majority
        assert shown['dispute']['resolvedBy'] == 'community'
        votes = requests.get(f'{server.url}/api/disputes/{dispute["id"]}/vote', timeout=TIMEOUT).json()
        assert sorted(v['id'] for v in votes['votes']) == sorted(body['vote']['id'] for _, body in accepted)
        assert votes['summary']['total'] == 3

        state = get_job(server, job['id'])
        if majority == 'worker':
            assert (state['job']['status'], state['job']['escrowStatus']) == ('completed', 'released')
            assert [c['status'] for c in state['claims']] == ['approved']
            assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '30.00'), ('release', '30.00')]
        else:
            assert (state['job']['status'], state['job']['escrowStatus']) == ('refunded', 'refunded')
            assert [c['status'] for c in state['claims']] == ['rejected']
            assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '30.00'), ('refund', '30.00')]
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


# Dispute against approval ----------------------------------------------------

def test_dispute_and_approval_at_the_same_moment_exactly_one_wins(tmp_path):
    server = LiveServer(tmp_path / 'dispute-approve.db').start()
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        jobs = [delivered_job(server, requester_key, agent, worker_key, paymentAmount='20.00') for _ in range(10)]
        winners = []
        for job, claim_id in jobs:
            base = f'{server.url}/api/jobs/{job["id"]}'
            dispute_answer, approve_answer = run_concurrently(2, lambda i: post(
                base + '/dispute', {'claimId': claim_id, 'reason': 'Wrong.'}, requester_key) if i == 0 else post(
                base + '/verify', {'claimId': claim_id, 'approved': True}, requester_key))
            assert isinstance(dispute_answer, requests.Response), dispute_answer
            assert isinstance(approve_answer, requests.Response), approve_answer
            statuses = (dispute_answer.status_code, approve_answer.status_code)
            assert statuses in ((201, 409), (409, 200)), (dispute_answer.text, approve_answer.text)
            state = get_job(server, job['id'])
            disputes = requests.get(f'{server.url}/api/disputes', params={'job_id': job['id']}, timeout=TIMEOUT)
            assert disputes.status_code == 200, disputes.text
            if statuses == (201, 409):
                winners.append('dispute')
                assert_conflict(approve_answer, 'claim_not_delivered')
                assert (state['job']['status'], state['job']['escrowStatus']) == ('disputed', 'locked')
                assert [c['status'] for c in state['claims']] == ['disputed']
                assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '20.00')]
                assert [(d['status'], d['claimId']) for d in disputes.json()['disputes']] == [('open', claim_id)]
            else:
                winners.append('approval')
                assert_conflict(dispute_answer, 'claim_not_delivered')
                assert (state['job']['status'], state['job']['escrowStatus']) == ('completed', 'released')
                assert [c['status'] for c in state['claims']] == ['approved']
                assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '20.00'),
                                                                                  ('release', '20.00')]
                assert disputes.json()['disputes'] == []
                assert disputes.json()['total'] == 0
        assert len(winners) == 10
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


# Concurrent resolutions ------------------------------------------------------

def test_ten_concurrent_admin_resolutions_settle_once(tmp_path):
    server = LiveServer(tmp_path / 'resolve.db').start()
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        job, claim_id = delivered_job(server, requester_key, agent, worker_key, paymentAmount='15.00')
        dispute = open_dispute(server, job['id'], claim_id, requester_key)
        outcomes = ['worker' if i % 2 == 0 else 'requester' for i in range(10)]

        answers = run_concurrently(10, lambda i: patch(
            f'{server.url}/api/disputes/{dispute["id"]}',
            {'outcome': outcomes[i], 'resolution': f'decision {i}', 'resolvedBy': f'admin-{i}'}, ADMIN_KEY))

        assert all(isinstance(a, requests.Response) for a in answers), answers
        assert sorted(a.status_code for a in answers) == [200] + [409] * 9, [a.text for a in answers]
        winner = next(i for i, a in enumerate(answers) if a.status_code == 200)
        for loser in (a for a in answers if a.status_code == 409):
            assert_conflict(loser, 'dispute_resolved')
        body = answers[winner].json()
        outcome = outcomes[winner]
        expected_job = ('completed', 'released') if outcome == 'worker' else ('refunded', 'refunded')
        assert (body['jobStatus'], body['escrowStatus']) == expected_job
        assert body['dispute']['status'] == 'resolved'
        assert body['dispute']['outcome'] == outcome

        shown = get_dispute(server, dispute['id'])['dispute']
        assert (shown['status'], shown['outcome'], shown['resolution'], shown['resolvedBy']) == \
            ('resolved', outcome, f'decision {winner}', f'admin-{winner}')
        state = get_job(server, job['id'])
        assert (state['job']['status'], state['job']['escrowStatus']) == expected_job
        settlement = 'release' if outcome == 'worker' else 'refund'
        assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '15.00'), (settlement, '15.00')]
        assert [c['status'] for c in state['claims']] == ['approved' if outcome == 'worker' else 'rejected']
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


# The sweeper greenlet --------------------------------------------------------

def test_the_sweeper_expires_an_overdue_claimed_job(tmp_path):
    server = LiveServer(tmp_path / 'sweeper.db', ['--sweep-interval', '0.3']).start()
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        soon = new_job(server, requester_key, paymentAmount='9.00', deadline=seconds_ahead(1.5))
        far = new_job(server, requester_key, paymentAmount='8.00')
        claim(server, soon['id'], agent['id'], worker_key)
        claim(server, far['id'], agent['id'], worker_key)
        assert get_job(server, soon['id'])['job']['status'] == 'claimed'

        give_up = time.monotonic() + 6
        while time.monotonic() < give_up:
            state = get_job(server, soon['id'])
            if state['job']['status'] != 'claimed':
                break
            time.sleep(0.05)
        assert state['job']['status'] == 'expired'
        assert state['job']['escrowStatus'] == 'refunded'
        assert [c['status'] for c in state['claims']] == ['expired']
        assert [(p['type'], p['amount']) for p in state['payments']] == [('escrow', '9.00'), ('refund', '9.00')]
        assert mp.parse_time(soon['deadline']) <= mp.now()

        untouched = get_job(server, far['id'])
        assert (untouched['job']['status'], untouched['job']['escrowStatus']) == ('claimed', 'locked')
        assert [c['status'] for c in untouched['claims']] == ['claimed']
        assert [(p['type'], p['amount']) for p in untouched['payments']] == [('escrow', '8.00')]
        agent_now = requests.get(f'{server.url}/api/agents/{agent["id"]}', timeout=TIMEOUT).json()
        assert agent_now['agent']['reputationScore'] == '0.00'      # −0.50, floored at 0.00
        assert [(e['delta'], e['reason'], e['jobId'], e['scoreAfter']) for e in agent_now['reputationHistory']] \
            == [('-0.50', 'claim expired without delivery', soon['id'], '0.00')]
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(server.db) == []


def test_the_first_automatic_sweep_runs_one_interval_after_start(tmp_path):
    """A job already overdue when the server starts stays untouched until one --sweep-interval has passed."""
    path = tmp_path / 'first-sweep.db'
    overdue, far = overdue_database(path)
    server = LiveServer(path, ['--sweep-interval', '3']).start()
    started = time.monotonic()        # the sweeper greenlet started at most a few ms before this
    try:
        assert get_job(server, overdue)['job']['status'] == 'claimed'    # no sweep at start
        time.sleep(max(0.0, started + 1.5 - time.monotonic()))
        assert get_job(server, overdue)['job']['status'] == 'claimed'    # nor half an interval later
        while time.monotonic() < started + 7:
            state = get_job(server, overdue)
            if state['job']['status'] != 'claimed':
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        assert state['job']['status'] == 'expired'
        assert 1.5 <= elapsed <= 7
        assert [c['status'] for c in state['claims']] == ['expired']
        assert [p['type'] for p in state['payments']] == ['escrow', 'refund']
        assert get_job(server, far)['job']['status'] == 'claimed'
        assert server.terminate() == 0
    finally:
        stop(server)
    assert ledger_of(path) == []


# The sweep command -----------------------------------------------------------

def test_the_sweep_command_expires_an_overdue_job_once(tmp_path):
    path = tmp_path / 'cron.db'
    overdue, far = overdue_database(path)

    first = run_cli('sweep', '--db', str(path))
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {
        'expire': {'expired': 1, 'refunded': 1, 'reputationPenalties': 1, 'jobIds': [overdue]},
        'autoVerify': {'autoApproved': 0, 'claimIds': [], 'checked': 0},
    }
    assert job_row(path, overdue) == ('expired', 'refunded', ['expired'], ['escrow', 'refund'])
    assert job_row(path, far) == ('claimed', 'locked', ['claimed'], ['escrow'])

    second = run_cli('sweep', '--db', str(path))
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout) == {
        'expire': {'expired': 0, 'refunded': 0, 'reputationPenalties': 0, 'jobIds': []},
        'autoVerify': {'autoApproved': 0, 'claimIds': [], 'checked': 0},
    }
    assert job_row(path, overdue) == ('expired', 'refunded', ['expired'], ['escrow', 'refund'])
    assert ledger_of(path) == []


# SIGTERM while the sweeper runs ----------------------------------------------

def test_sigterm_while_the_sweeper_runs_exits_0(tmp_path):
    server = LiveServer(tmp_path / 'term-sweeper.db', ['--sweep-interval', '0.2']).start()
    output = Output(server)
    try:
        _, requester_key = new_account(server, 'requester')
        agent, worker_key = register_agent(server, 'worker')
        job = new_job(server, requester_key, deadline=seconds_ahead(0.3))
        claim(server, job['id'], agent['id'], worker_key)
        assert output.wait_for('sweep: '), output.lines       # the sweeper has run and expired the job
        assert get_job(server, job['id'])['job']['status'] == 'expired'
        time.sleep(0.3)       # a sweep or two more, then stop in the middle of the sweeper's cycle
        signalled = time.monotonic()
        assert server.terminate(timeout=10) == 0
        assert time.monotonic() - signalled < 10
        text = output.text()
        assert 'stopping' in text
        assert text.rstrip().endswith('stopped')
        assert 'Traceback' not in text
    finally:
        stop(server)
    assert ledger_of(server.db) == []
