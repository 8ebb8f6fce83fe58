"""Onchain mode end to end (CONTRACT.md 7, docs/payments-on-chain.md "USDC on Base: onchain mode"): the real server as a process,
a real local EVM (anvil, tests/chain.py) with TestUSDC at the Base USDC address, and real USDC transfers.

Funding checks on chain, a stranger who posts someone else's funding transfer (and docs/security.md's example of
signing one), payouts and refunds that land in wallets, a crash between the commit and the broadcast (an RPC
proxy that holds eth_sendRawTransaction), and a node that is down or on another chain.
Every test uses the `usdc` fixture, so the chain is put back as it was after it. Only 127.0.0.1.
"""

import json
import os
import re
import secrets
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

import chain
from chain import DEV_ADDRESSES, DEV_KEYS, OTHER_TOKEN, USDC, Account  # web3/eth-account only through chain.py
from conftest import ROOT, LiveServer, free_port, in_hours, job_body
from test_server import claim_and_deliver

import marketplace as mp

SECURITY_DOC = (ROOT / 'docs' / 'security.md').read_text()
TIMEOUT = 20                # seconds for any one HTTP call: only to avoid hanging, never asserted
ESCROW_KEY, ESCROW = DEV_KEYS[1], DEV_ADDRESSES[1]
PAYER_KEY, PAYER = DEV_KEYS[2], DEV_ADDRESSES[2]
PRICE = 25_000_000          # 25.00 USDC in base units


# Helpers ---------------------------------------------------------------------

def onchain_args(rpc_url, *extra):
    return ['--rpc-url', rpc_url, '--chain-id', '8453', '--confirmations', '2', '--rate-limits', 'off', *extra]


def drain(server):
    """Read the server's output in the background (a full pipe would block it); lines in server.lines."""
    server.lines = []

    def read(stream):
        for line in iter(stream.readline, b''):
            server.lines.append(line.decode(errors='replace'))
    server.reader = threading.Thread(target=read, args=(server.process.stdout,), daemon=True)
    server.reader.start()


def stop(server):
    if server.process is not None and server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


@contextmanager
def running(server):
    """A LiveServer started, its output drained, and killed afterwards if still running."""
    try:
        server.start()
        drain(server)
        yield server
    finally:
        stop(server)


def serving(db, rpc_url, *extra):
    """A server in onchain mode (escrow wallet DEV_ADDRESSES[1]) on `db`, killed afterwards if still running."""
    return running(LiveServer(db, onchain_args(rpc_url, *extra), env={'MARKETPLACE_ESCROW_KEY': ESCROW_KEY}))


def ledger_of(db_path):
    db = mp.Database(str(db_path))
    try:
        return mp.ledger_problems(db)
    finally:
        db.close()


def call(server, method, path, body=None, key=None):
    headers = {'Authorization': f'Bearer {key}'} if key else {}
    return requests.request(method, server.url + path, json=body, headers=headers, timeout=TIMEOUT)


ACCOUNT_OF_KEY = {}         # API key -> its account id, for the funding signatures


def new_requester(server, name='requester'):
    answer = call(server, 'POST', '/api/accounts', {'name': name})
    assert answer.status_code == 201, answer.text
    ACCOUNT_OF_KEY[answer.json()['apiKey']] = answer.json()['account']['id']
    return answer.json()['apiKey']


def new_worker(server, name='worker'):
    """An account with one agent whose wallet is a fresh address (no USDC yet): (agent, key, wallet)."""
    wallet = Account.create().address
    answer = call(server, 'POST', '/api/agents/register',
                  {'name': name, 'walletAddress': wallet, 'capabilities': {'categories': ['code']}})
    assert answer.status_code == 201, answer.text
    return answer.json()['agent'], answer.json()['apiKey'], wallet


def pay_escrow(anvil, amount, to=ESCROW, token=USDC, confirm=True):
    """Mint `amount` to the payer and transfer it to `to`; with `confirm`, mine one more block (2 deep)."""
    anvil.mint(PAYER, amount, token=token)
    tx_hash = anvil.transfer(PAYER_KEY, to, amount, token=token)
    if confirm:
        anvil.mine(1)
    return tx_hash


def post_job(server, key, tx_hash=None, signer=PAYER_KEY, **overrides):
    """POST /api/jobs with `tx_hash` and its escrowSignature by `signer` (None: no signature) for the key's account."""
    body = job_body(**overrides)
    if tx_hash is not None:
        body['escrowTxHash'] = tx_hash
        if signer is not None:
            body['escrowSignature'] = chain.sign_funding(signer, ACCOUNT_OF_KEY[key], tx_hash, ESCROW)
    return call(server, 'POST', '/api/jobs', body, key)


def funded_job(server, key, tx_hash, **overrides):
    answer = post_job(server, key, tx_hash, **overrides)
    assert answer.status_code == 201, answer.text
    return answer.json()['job']


def get_job(server, job_id):
    answer = call(server, 'GET', f'/api/jobs/{job_id}')
    assert answer.status_code == 200, answer.text
    return answer.json()


def job_total(server):
    answer = call(server, 'GET', '/api/jobs')
    assert answer.status_code == 200, answer.text
    return answer.json()['total']


def delivered(server, job, worker_key, agent):
    return claim_and_deliver(server, job, agent['id'], worker_key)


def funded_delivery(server, anvil):
    """A requester's job funded on chain with PRICE, claimed and delivered by a new worker:
    (requester key, job, claim id, the worker's wallet)."""
    key = new_requester(server)
    agent, worker_key, wallet = new_worker(server)
    job = funded_job(server, key, pay_escrow(anvil, PRICE))
    return key, job, delivered(server, job, worker_key, agent), wallet


def verify(server, job, claim_id, approved, requester_key):
    answer = call(server, 'POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim_id, 'approved': approved},
                  requester_key)
    assert answer.status_code == 200, answer.text
    return answer.json()


def one(payments, kind):
    found = [p for p in payments if p['type'] == kind]
    assert len(found) == 1, payments
    return found[0]


def assert_refused(answer, status, code):
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert (body['status'], body['code']) == (status, code), body
    assert isinstance(body['error'], str) and body['error'].strip(), body
    return body


def assert_pending_payout(payment, amount, recipient):
    assert payment['status'] == 'pending', payment
    assert (payment['amount'], payment['currency'], payment['rail']) == (amount, 'USDC', 'base'), payment
    assert payment['recipient'].lower() == recipient.lower(), payment
    assert isinstance(payment['txHash'], str) and len(payment['txHash']) == 66, payment


def settle(anvil, done, seconds=10):
    """Mine a block at a time until done() is true (the server's sweeper confirms in between)."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f'not settled in {seconds} s'
        anvil.mine(1)
        time.sleep(0.15)


def statuses(server, job_id):
    return {p['type']: p['status'] for p in get_job(server, job_id)['payments']}


def nonce_of(anvil, address):
    return anvil.w3.eth.get_transaction_count(address, 'latest')


# 1. A funded job opens ----------------------------------------------------------

def test_a_funded_job_opens_and_health_shows_the_chain(anvil, usdc, tmp_path):
    with serving(tmp_path / 'm.db', anvil.url) as server:
        key = new_requester(server)
        tx_hash = pay_escrow(anvil, PRICE)
        assert anvil.balance(ESCROW) == PRICE
        job = funded_job(server, key, tx_hash)
        assert (job['status'], job['escrowStatus'], job['escrowTxHash']) == ('open', 'locked', tx_hash)
        assert (job['paymentAmount'], job['paymentCurrency'], job['paymentRail']) == ('25.00', 'USDC', 'base')

        shown = get_job(server, job['id'])
        assert shown['job']['escrowTxHash'] == tx_hash
        assert len(shown['payments']) == 1
        escrow = shown['payments'][0]
        assert {k: escrow[k] for k in ('type', 'status', 'txHash', 'amount', 'currency', 'rail')} == \
            {'type': 'escrow', 'status': 'confirmed', 'txHash': tx_hash, 'amount': '25.00', 'currency': 'USDC',
             'rail': 'base'}

        # Health asks the node at most once per block time (2 s): its view is at most that old.
        time.sleep(2.1)
        health = call(server, 'GET', '/api/health')
        assert health.status_code == 200, health.text
        assert health.json()['payments'] == 'onchain'
        assert health.json()['chain'] == {'chainId': 8453, 'latestBlock': anvil.block_number(),
                                          'escrowAddress': ESCROW, 'usdcAddress': USDC, 'reachable': True}


# 2. Bad funding transfers ---------------------------------------------------------

def test_each_bad_funding_transfer_is_refused_with_its_own_code(anvil, usdc, tmp_path):
    with serving(tmp_path / 'm.db', anvil.url) as server:
        key, other_key = new_requester(server), new_requester(server, 'someone-else')

        body = assert_refused(post_job(server, key), 402, 'payment_required')
        assert body['paymentRequirements'] == {'payTo': ESCROW, 'amount': '25000000', 'asset': USDC,
                                               'network': 'base', 'chainId': 8453}

        assert_refused(post_job(server, key, '0x' + secrets.token_hex(32)), 402, 'payment_not_found')

        anvil.mint(PAYER, 10_000_000)     # then send more than the payer holds, mined with status 0
        reverted = anvil.transfer(PAYER_KEY, ESCROW, PRICE, gas=100_000)
        anvil.mine(1)
        assert anvil.receipt(reverted)['status'] == 0
        assert_refused(post_job(server, key, reverted), 402, 'payment_reverted')

        wrong_token = pay_escrow(anvil, PRICE, token=OTHER_TOKEN)
        assert anvil.balance(ESCROW, token=OTHER_TOKEN) == PRICE
        assert_refused(post_job(server, key, wrong_token), 402, 'payment_wrong_token')

        elsewhere = pay_escrow(anvil, PRICE, to=DEV_ADDRESSES[3])
        assert_refused(post_job(server, key, elsewhere), 402, 'payment_wrong_recipient')

        short = pay_escrow(anvil, 24_990_000)
        assert_refused(post_job(server, key, short), 402, 'payment_insufficient')

        assert job_total(server) == 0     # nothing above opened a job

        fresh = pay_escrow(anvil, PRICE, confirm=False)   # its own block only: 1 of 2 confirmations
        answer = post_job(server, key, fresh)
        assert_refused(answer, 402, 'payment_pending')
        assert 1 <= int(answer.headers['Retry-After']) <= 10
        assert job_total(server) == 0

        anvil.mine(1)                                      # now 2 deep: the same hash opens the job
        deadline = in_hours(48)
        job = funded_job(server, key, fresh, deadline=deadline)
        assert job['escrowTxHash'] == fresh

        assert_refused(post_job(server, other_key, fresh, deadline=deadline), 409, 'payment_replayed')
        again = post_job(server, key, fresh, deadline=deadline)         # the same job again: a retry
        assert again.status_code == 200, again.text
        assert again.json()['job']['id'] == job['id']
        assert again.json()['job']['escrowTxHash'] == fresh
        assert job_total(server) == 1
        assert [p['type'] for p in get_job(server, job['id'])['payments']] == ['escrow']


def test_a_funding_hash_is_not_an_idempotency_key(anvil, usdc, tmp_path):
    """CONTRACT 14, a defect found by trying it as a new user: twelve posts at once with one funding hash and twelve
    titles answered one 201 and eleven 200s carrying that other job. Now: one job, eleven 409 payment_replayed
    naming it; the same body again (a retry) is that job, 200; another body is still 409."""
    with serving(tmp_path / 'm.db', anvil.url) as server:
        key = new_requester(server)
        tx_hash = pay_escrow(anvil, PRICE)
        signature = chain.sign_funding(PAYER_KEY, ACCOUNT_OF_KEY[key], tx_hash, ESCROW)
        deadline = in_hours(48)
        bodies = [job_body(title=f'Job number {i}', deadline=deadline, escrowTxHash=tx_hash,
                           escrowSignature=signature) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda body: call(server, 'POST', '/api/jobs', body, key), bodies))
        created = [answer.json()['job'] for answer in answers if answer.status_code == 201]
        assert len(created) == 1, [answer.text for answer in answers]
        job = created[0]
        refused = [answer for answer in answers if answer.status_code != 201]
        assert [(answer.status_code, answer.json()['code'], answer.json()['jobId']) for answer in refused] == \
            [(409, 'payment_replayed', job['id'])] * 11
        same = next(body for body in bodies if body['title'] == job['title'])
        again = call(server, 'POST', '/api/jobs', same, key)
        assert (again.status_code, again.json()['job']['id'], again.json()['job']['title']) == \
            (200, job['id'], job['title'])
        other = call(server, 'POST', '/api/jobs', dict(same, description='Another job entirely.'), key)
        assert (assert_refused(other, 409, 'payment_replayed')['jobId']) == job['id']
        assert job_total(server) == 1
        assert [p['type'] for p in get_job(server, job['id'])['payments']] == ['escrow']
        assert server.terminate() == 0


# 2b. A funding transfer is not a bearer token ----------------------------------------

def database_view(db_path):
    """What a refused funding must leave as it was: jobs, used hashes, payments and every ledger entry."""
    db = sqlite3.connect(f'file:{db_path}?mode=ro', uri=True)
    try:
        return {table: db.execute(f'SELECT * FROM {table} ORDER BY rowid').fetchall()
                for table in ('jobs', 'used_payments', 'payments', 'ledger_entries')}
    finally:
        db.close()


def test_a_stranger_cannot_take_a_requesters_funding_transfer(anvil, usdc, tmp_path):
    """The attack: a stranger who watches the escrow address posts the victim's transfer first (to approve a
    delivery by an agent of its own and be paid the deposit). Without the victim's signature it gets nothing."""
    db = tmp_path / 'm.db'
    with serving(db, anvil.url) as server:
        victim_key, stranger_key = new_requester(server, 'victim'), new_requester(server, 'stranger')
        victim, stranger = ACCOUNT_OF_KEY[victim_key], ACCOUNT_OF_KEY[stranger_key]
        stranger_wallet_key, stranger_wallet = DEV_KEYS[4], DEV_ADDRESSES[4]
        answer = call(server, 'POST', '/api/agents', {'name': 'escrow', 'walletAddress': ESCROW.lower()}, stranger_key)
        body = assert_refused(answer, 400, 'validation_failed')          # the escrow's wallet is not an agent's
        assert body['fields'] == {'walletAddress': 'must not be the escrow address of this service'}
        answer = call(server, 'POST', '/api/agents', {'name': 'accomplice', 'walletAddress': stranger_wallet},
                      stranger_key)
        assert answer.status_code == 201, answer.text
        tx_hash = pay_escrow(anvil, 500_000_000)              # the victim sends 500 USDC to escrow
        before = database_view(db)
        balances = {address: anvil.balance(address) for address in (ESCROW, PAYER, stranger_wallet)}
        assert balances == {ESCROW: 500_000_000, PAYER: 0, stranger_wallet: 0}

        expected = chain.funding_typed_data(stranger, tx_hash, ESCROW)
        for signer in (None, stranger_wallet_key):            # no signature; the stranger's own wallet's
            answer = post_job(server, stranger_key, tx_hash, signer=signer, paymentAmount='500.00')
            body = assert_refused(answer, 402, 'payment_signature_invalid')
            assert body['fundingTypedData'] == expected
        signed_by_stranger = Account.sign_typed_data(stranger_wallet_key, full_message=expected)   # what the 402 says
        answer = call(server, 'POST', '/api/jobs', job_body(paymentAmount='500.00', escrowTxHash=tx_hash,
                      escrowSignature=signed_by_stranger.signature.to_0x_hex()), stranger_key)
        assert_refused(answer, 402, 'payment_signature_invalid')
        assert database_view(db) == before                    # no job, no used hash, no payment, no ledger entry
        assert job_total(server) == 0
        assert {address: anvil.balance(address) for address in balances} == balances

        victims = call(server, 'POST', '/api/jobs', job_body(
            paymentAmount='500.00', escrowTxHash=tx_hash,
            escrowSignature=chain.sign_funding(PAYER_KEY, victim, tx_hash, ESCROW)), victim_key)
        assert victims.status_code == 201, victims.text
        job = victims.json()['job']
        assert (job['requesterId'], job['paymentAmount'], job['escrowTxHash']) == (victim, '500.00', tx_hash)

        for signer in (None, stranger_wallet_key, PAYER_KEY):     # PAYER_KEY: as if it had the payer's key
            answer = post_job(server, stranger_key, tx_hash, signer=signer, paymentAmount='500.00')
            assert_refused(answer, 409, 'payment_replayed')
        copied = call(server, 'POST', '/api/jobs', job_body(
            paymentAmount='500.00', escrowTxHash=tx_hash,
            escrowSignature=chain.sign_funding(PAYER_KEY, victim, tx_hash, ESCROW)), stranger_key)
        assert_refused(copied, 409, 'payment_replayed')           # the victim's own body, replayed
        assert job_total(server) == 1
        assert {address: anvil.balance(address) for address in balances} == balances
        assert server.terminate() == 0
    assert ledger_of(db) == []


def test_the_readmes_funding_example_runs_as_written(anvil, usdc, tmp_path):
    """docs/security.md "What stops theft": sign_funding.py and the curl that posts it, against the server."""
    block = SECURITY_DOC.split('<!-- funding:start -->')[1].split('<!-- funding:end -->')[0]
    python = block.split('```python')[1].split('```')[0]
    script = block.split('```sh')[1].split('```')[0]
    (tmp_path / 'sign_funding.py').write_text(python)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        key = new_requester(server)
        tx_hash = pay_escrow(anvil, PRICE)
        values = {'BASE': server.url, 'REQUESTER_KEY': key, 'TX_HASH': tx_hash, 'PAYER_KEY': PAYER_KEY}
        for name, value in values.items():
            script, found = re.subn(rf'^{name}=.*$', f'{name}={value}', script, count=1, flags=re.MULTILINE)
            assert found == 1, name
        path = f'{Path(sys.executable).parent}{os.pathsep}{os.environ["PATH"]}'    # python3 with eth-account
        run = subprocess.run(['bash', '-euo', 'pipefail', '-c', script], capture_output=True, text=True, timeout=60,
                             cwd=tmp_path, env=dict(os.environ, PATH=path))
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == re.findall(r'^# → (.*)$', script, re.MULTILINE) == ['201']
        refused = json.loads((tmp_path / 'refused.json').read_text())
        assert (refused['status'], refused['code']) == (402, 'payment_signature_invalid')
        assert refused['fundingTypedData'] == chain.funding_typed_data(ACCOUNT_OF_KEY[key], tx_hash, ESCROW)
        job = json.loads((tmp_path / 'job.json').read_text())['job']
        assert (job['requesterId'], job['escrowTxHash'], job['escrowStatus']) == (ACCOUNT_OF_KEY[key], tx_hash,
                                                                                 'locked')


def test_a_transfer_older_than_the_max_age_is_expired(anvil, usdc, tmp_path):
    # The chain's clock moves on two minutes past the transfer: by the chain it is older than 60 s.
    with serving(tmp_path / 'm.db', anvil.url, '--payment-max-age', '60') as server:
        key = new_requester(server)
        tx_hash = pay_escrow(anvil, PRICE)
        mined_at = anvil.w3.eth.get_block(anvil.receipt(tx_hash)['blockNumber'])['timestamp']
        anvil.set_next_timestamp(mined_at + 120)      # two minutes later on chain
        anvil.mine(1)
        assert anvil.timestamp() - mined_at == 120
        assert_refused(post_job(server, key, tx_hash), 402, 'payment_expired')
        assert job_total(server) == 0


# 3. Approval pays the worker on chain ----------------------------------------------

# docs/api.md "Money and escrow": the fee is rounded down to the cent, so 2.5 % of 25.00 is 0.62 (not 0.625).
@pytest.mark.parametrize('fee_percent, paid, fee', [('0', 25_000_000, 0), ('2.5', 24_380_000, 620_000)])
def test_approval_moves_usdc_to_the_worker_wallet(anvil, usdc, tmp_path, fee_percent, paid, fee):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, '--sweep-interval', '0.3', '--fee-percent', fee_percent) as server:
        key = new_requester(server)
        agent, worker_key, wallet = new_worker(server)
        job = funded_job(server, key, pay_escrow(anvil, PRICE))
        assert (anvil.balance(ESCROW), anvil.balance(wallet)) == (PRICE, 0)
        claim_id = delivered(server, job, worker_key, agent)

        answer = verify(server, job, claim_id, True, key)
        assert answer['job']['status'] == 'completed'
        assert answer['escrowStatus'] == 'released'
        release = one(answer['payments'], 'release')
        assert_pending_payout(release, mp.format_units(paid, 'USDC'), wallet)
        if fee:
            fee_record = one(answer['payments'], 'fee')
            assert (fee_record['amount'], fee_record['status'], fee_record['txHash']) == ('0.62', 'confirmed', None)
        else:
            assert [p['type'] for p in answer['payments']] == ['release']

        settle(anvil, lambda: statuses(server, job['id'])['release'] == 'confirmed'
               and anvil.balance(wallet) == paid)
        receipt = anvil.receipt(release['txHash'])
        assert (receipt['status'], receipt['from'], receipt['to']) == (1, ESCROW, USDC)
        assert anvil.balance(wallet) == paid
        assert anvil.balance(ESCROW) == PRICE - paid == fee     # the fee stays in the escrow wallet
        shown = one(get_job(server, job['id'])['payments'], 'release')
        assert (shown['status'], shown['txHash'], shown['amount']) == \
            ('confirmed', release['txHash'], release['amount'])
        assert server.terminate() == 0
    assert ledger_of(db) == []


# 4. Rejection refunds the payer -------------------------------------------------------

def test_rejection_refunds_the_payer_and_overfunding_comes_back(anvil, usdc, tmp_path):
    db = tmp_path / 'm.db'
    with serving(db, anvil.url, '--sweep-interval', '0.3') as server:
        key = new_requester(server)
        agent, worker_key, wallet = new_worker(server)
        rejected = funded_job(server, key, pay_escrow(anvil, 30_000_000))     # 30 USDC for a 25 USDC job
        approved = funded_job(server, key, pay_escrow(anvil, 30_000_000))
        assert (anvil.balance(PAYER), anvil.balance(ESCROW)) == (0, 60_000_000)
        assert one(get_job(server, rejected['id'])['payments'], 'escrow')['amount'] == '30.00'

        answer = verify(server, rejected, delivered(server, rejected, worker_key, agent), False, key)
        assert (answer['job']['status'], answer['escrowStatus']) == ('rejected', 'refunded')
        refund = one(answer['payments'], 'refund')
        assert_pending_payout(refund, '30.00', PAYER)
        settle(anvil, lambda: statuses(server, rejected['id'])['refund'] == 'confirmed'
               and anvil.balance(PAYER) == 30_000_000)
        assert (anvil.balance(PAYER), anvil.balance(ESCROW), anvil.balance(wallet)) == (30_000_000, 30_000_000, 0)

        answer = verify(server, approved, delivered(server, approved, worker_key, agent), True, key)
        assert (answer['job']['status'], answer['escrowStatus']) == ('completed', 'released')
        assert [p['type'] for p in answer['payments']] == ['release', 'refund']
        assert_pending_payout(one(answer['payments'], 'release'), '25.00', wallet)
        assert_pending_payout(one(answer['payments'], 'refund'), '5.00', PAYER)
        settle(anvil, lambda: statuses(server, approved['id']) == {'escrow': 'confirmed', 'release': 'confirmed',
                                                                     'refund': 'confirmed'})
        assert anvil.balance(wallet) == 25_000_000
        assert anvil.balance(PAYER) == 35_000_000
        assert anvil.balance(ESCROW) == 0
        assert server.terminate() == 0
    assert ledger_of(db) == []


# 5. A crash between the commit and the broadcast ------------------------------------------

class RPCProxy:
    """A JSON-RPC proxy on 127.0.0.1 in front of anvil. While `holding`, an eth_sendRawTransaction is held
    (never answered) until release(); everything else is forwarded. `sent` records every
    eth_sendRawTransaction that reached the node through it, with the node's answer."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.holding = False
        self.down = False       # while set, every request is dropped unanswered: the node has stopped
        self.held = []          # [{'raw', 'body', 'release': Event}]
        self.sent = []          # [(raw, answer)]
        self.changed = threading.Condition()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get('Content-Length') or 0))
                try:
                    request = json.loads(body)
                except ValueError:
                    request = None
                method = request.get('method') if isinstance(request, dict) else None
                if proxy.down:
                    self.close_connection = True
                    return
                if method == 'eth_sendRawTransaction' and proxy.holding:
                    entry = {'raw': request['params'][0], 'body': body, 'release': threading.Event()}
                    with proxy.changed:
                        proxy.held.append(entry)
                        proxy.changed.notify_all()
                    entry['release'].wait(60)
                    self.close_connection = True
                    return      # dropped: no answer at all
                answer = proxy.forward(body)
                if method == 'eth_sendRawTransaction':
                    with proxy.changed:
                        proxy.sent.append((request['params'][0], json.loads(answer)))
                        proxy.changed.notify_all()
                self.send_response(200)
                self.send_header('Content-Type', 'application/json')
                self.send_header('Content-Length', str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f'http://127.0.0.1:{self.server.server_address[1]}'

    def forward(self, body):
        return requests.post(self.upstream, data=body, headers={'Content-Type': 'application/json'},
                             timeout=10).content

    def wait_for_held(self, seconds=10):
        with self.changed:
            assert self.changed.wait_for(lambda: self.held, seconds), 'no eth_sendRawTransaction reached the proxy'
            return self.held[0]

    def close(self):
        self.holding = False
        for entry in self.held:
            entry['release'].set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(anvil):
    proxy = RPCProxy(anvil.url)
    yield proxy
    proxy.close()


@pytest.mark.parametrize('node_has_it', [False, True], ids=['dropped', 'forwarded'])
def test_a_crash_between_commit_and_broadcast_pays_exactly_once(anvil, usdc, proxy, tmp_path, node_has_it):
    db = tmp_path / 'm.db'
    with serving(db, proxy.url, '--sweep-interval', '600') as server:
        key, job, claim_id, wallet = funded_delivery(server, anvil)
        nonce_before = nonce_of(anvil, ESCROW)

        proxy.holding = True
        answer = verify(server, job, claim_id, True, key)
        release = one(answer['payments'], 'release')
        assert_pending_payout(release, '25.00', wallet)
        held = proxy.wait_for_held()          # committed, and the broadcast is in flight
        assert chain.Web3.keccak(hexstr=held['raw']).hex().removeprefix('0x') == release['txHash'][2:]
        if node_has_it:                       # the node takes it, but the server never hears back
            assert 'result' in json.loads(proxy.forward(held['body']))
            mined = anvil.w3.eth.wait_for_transaction_receipt(release['txHash'], timeout=10, poll_latency=0.02)
            assert mined['status'] == 1
        server.kill()
    proxy.holding = False
    held['release'].set()                     # the held request ends without an answer
    assert anvil.balance(wallet) == (PRICE if node_has_it else 0)
    assert proxy.sent == []

    with serving(db, proxy.url, '--sweep-interval', '0.3') as server:
        settle(anvil, lambda: statuses(server, job['id'])['release'] == 'confirmed'
               and anvil.balance(wallet) == PRICE)
        anvil.mine(3)
        time.sleep(1.0)                       # three sweeps more
        assert anvil.balance(wallet) == PRICE
        assert anvil.balance(ESCROW) == 0
        assert nonce_of(anvil, ESCROW) == nonce_before + 1
        shown = one(get_job(server, job['id'])['payments'], 'release')
        assert (shown['status'], shown['txHash']) == ('confirmed', release['txHash'])
        # after the restart the same signed transaction was sent again, and only that one
        assert proxy.sent and {raw for raw, _ in proxy.sent} == {held['raw']}
        if node_has_it:                        # the node had mined it: 'nonce too low', which counts as sent
            assert all(answer['error']['message'].lower() in ('nonce too low', 'already known')
                       for _, answer in proxy.sent), proxy.sent
        else:
            assert proxy.sent[0][1].get('result') == release['txHash'], proxy.sent
        assert server.terminate() == 0
    assert ledger_of(db) == []


# 6. A node that is down, or on another chain ------------------------------------------

def test_a_node_that_does_not_answer(anvil, usdc, tmp_path):
    nowhere = f'http://127.0.0.1:{free_port()}'
    with serving(tmp_path / 'm.db', nowhere) as server:
        started = time.monotonic()
        health = call(server, 'GET', '/api/health')
        assert time.monotonic() - started < 10      # did not hang on the node (refused at once): no latency figure
        assert health.status_code == 200, health.text
        assert health.json()['payments'] == 'onchain'
        assert health.json()['chain'] == {'chainId': 8453, 'latestBlock': None, 'escrowAddress': ESCROW,
                                          'usdcAddress': USDC, 'reachable': False}

        key = new_requester(server)
        started = time.monotonic()
        answer = post_job(server, key, pay_escrow(anvil, PRICE))
        assert time.monotonic() - started < 15
        assert_refused(answer, 503, 'chain_unavailable')
        assert job_total(server) == 0


def wait_for_health(server, reachable, seconds=5):
    """GET /api/health until it shows the node (un)reachable; its last answer."""
    deadline = time.monotonic() + seconds
    while True:
        health = call(server, 'GET', '/api/health').json()
        if health['chain']['reachable'] is reachable or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def test_the_node_stopping_under_load_is_503_never_500_and_the_service_recovers(anvil, usdc, proxy, tmp_path):
    """Readers keep reading while the node is gone; what needs the chain is 503 chain_unavailable; an approval is
    signed and stored offline (200, pending) and paid once the node is back; the refused funding transfers are
    accepted when sent again."""
    db = tmp_path / 'm.db'
    with serving(db, proxy.url, '--sweep-interval', '0.3') as server:
        key, job, claim_id, wallet = funded_delivery(server, anvil)
        transfers = [pay_escrow(anvil, PRICE) for _ in range(3)]
        reads, stopping = [], threading.Event()

        def read_while_it_happens():
            while not stopping.is_set():
                for path in ('/api/health', '/api/jobs', f'/api/jobs/{job["id"]}', '/api/stats'):
                    answer = call(server, 'GET', path)
                    reads.append((path, answer.status_code, proxy.down))

        readers = [threading.Thread(target=read_while_it_happens) for _ in range(3)]
        for reader in readers:
            reader.start()
        try:
            time.sleep(0.3)
            proxy.down = True
            started = time.monotonic()
            refused = [post_job(server, key, tx_hash) for tx_hash in transfers]
            assert time.monotonic() - started < 3 * 15
            health = wait_for_health(server, reachable=False)      # health asks the node every 2 s at most
            approved = verify(server, job, claim_id, True, key)
            time.sleep(0.5)             # sweeps try to send the payout to a node that is not there
            proxy.down = False
            accepted = [post_job(server, key, tx_hash) for tx_hash in transfers]
            time.sleep(0.3)
        finally:
            stopping.set()
            for reader in readers:
                reader.join(20)
        for answer in refused:
            assert_refused(answer, 503, 'chain_unavailable')
        assert health['status'] == 'ok' and health['chain']['reachable'] is False
        release = one(approved['payments'], 'release')
        assert_pending_payout(release, '25.00', wallet)
        assert [answer.status_code for answer in accepted] == [201, 201, 201], [a.text for a in accepted]
        assert {answer.json()['job']['escrowTxHash'] for answer in accepted} == set(transfers)
        assert {path for path, _, down in reads if down} == {'/api/health', '/api/jobs', f'/api/jobs/{job["id"]}',
                                                          '/api/stats'}
        assert [(path, status) for path, status, _ in reads if status != 200] == []
        settle(anvil, lambda: statuses(server, job['id'])['release'] == 'confirmed' and anvil.balance(wallet) == PRICE)
        assert wait_for_health(server, reachable=True)['chain']['latestBlock'] > 0
        assert job_total(server) == 4
        assert server.terminate() == 0
    assert ledger_of(db) == []


def test_a_node_on_another_chain_refuses_to_start(tmp_path):
    other = chain.Anvil(chain_id=1).start()
    try:
        server = LiveServer(tmp_path / 'm.db', onchain_args(other.url), env={'MARKETPLACE_ESCROW_KEY': ESCROW_KEY})
        try:
            with pytest.raises(RuntimeError) as raised:
                server.start()
            assert server.process.returncode not in (0, None)
        finally:
            stop(server)
        message = str(raised.value)
        assert 'server exited' in message
        assert 'on chain 1,' in message and '--chain-id 8453' in message
    finally:
        other.stop()
