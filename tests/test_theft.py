"""The attacks that took other people's money from version 1 (CONTRACT.md 18, docs/security.md "What stops theft"), each
against the real server as a process, on anvil where money moves. The stranger's funding-hash attack is in
test_onchain.py (test_a_stranger_cannot_take_a_requesters_funding_transfer), the six concurrent authorizations in
test_x402_live.py, the private deliverables in test_jobs.py (test_a_deliverable_is_private_on_the_real_server);
the rules themselves are tested in-process in test_disputes.py, test_sweeps.py, test_x402*.py and test_accounts.py.

Only 127.0.0.1. Every test on the chain uses the `usdc` fixture, so the chain is put back as it was after it.
"""

import base64
import json
import re
import sqlite3
import time
from datetime import datetime, timedelta, timezone

import requests

from chain import DEV_ADDRESSES, DEV_KEYS, USDC, Account, Web3, sign_authorization, sign_funding, sign_proof
from conftest import ADMIN_KEY, LiveServer, job_body, random_wallet
from test_onchain import ESCROW, ESCROW_KEY, assert_refused, ledger_of, running
from test_x402 import PAY_TO
from test_x402_verifier import header_of, x_payment

import marketplace as mp

TIMEOUT = 20                # seconds for any one HTTP call: only to avoid hanging, never asserted
ATTACKER_KEY, ATTACKER = DEV_KEYS[3], DEV_ADDRESSES[3]      # the attacker's wallet: funds its farming jobs
VICTIM_KEY, VICTIM = DEV_KEYS[2], DEV_ADDRESSES[2]          # the victim's wallet: funds the job to steal
CENT = 10_000               # 0.01 USDC in base units
DELIVERABLE = {'type': 'url', 'url': 'https://example.com/junk'}


class Caller:
    """One API key against one server: call(method, path, body) → requests' answer."""

    def __init__(self, server, key=None, account=None):
        self.server, self.key, self.account = server, key, account

    def call(self, method, path, body=None, headers=None):
        headers = dict(headers or {}, **({'Authorization': f'Bearer {self.key}'} if self.key else {}))
        return requests.request(method, self.server.url + path, json=body, headers=headers, timeout=TIMEOUT)

    def ok(self, method, path, body=None, status=200):
        answer = self.call(method, path, body)
        assert answer.status_code == status, answer.text
        return answer.json()


def register(server, name, wallet=None):
    """An account through open registration, with an agent when `wallet` is given: (Caller, agent or None)."""
    if wallet is None:
        answer = Caller(server).ok('POST', '/api/accounts', {'name': name}, 201)
        return Caller(server, answer['apiKey'], answer['account']['id']), None
    answer = Caller(server).ok('POST', '/api/agents/register', {'name': name, 'walletAddress': wallet}, 201)
    return Caller(server, answer['apiKey'], answer['agent']['accountId']), answer['agent']


def fund(anvil, payer_key, amount):
    """`amount` minted to the payer and sent to escrow (mined): the transfer's hash."""
    anvil.mint(Account.from_key(payer_key).address, amount)
    return anvil.transfer(payer_key, ESCROW, amount)


def funded_job(anvil, requester, payer_key, amount, **fields):
    """A job funded on chain by `payer_key`'s wallet and signed for the requester's account."""
    tx_hash = fund(anvil, payer_key, amount)
    body = job_body(paymentAmount=mp.format_units(amount, 'USDC'), escrowTxHash=tx_hash,
                    escrowSignature=sign_funding(payer_key, requester.account, tx_hash, ESCROW), **fields)
    return requester.ok('POST', '/api/jobs', body, 201)['job']


def claim_and_deliver(worker, agent, job):
    claim = worker.ok('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, 201)['claim']
    worker.ok('POST', f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': DELIVERABLE})
    return claim


def onchain_server(db, anvil, *extra):
    """The server in onchain mode (escrow DEV_ADDRESSES[1], one confirmation), arbitration not open."""
    return running(LiveServer(db, ['--rpc-url', anvil.url, '--chain-id', '8453', '--confirmations', '1', *extra],
                              env={'MARKETPLACE_ESCROW_KEY': ESCROW_KEY}))


# 2. One farmed arbitrator decides any dispute alone -----------------------------------------------------

def wait_for_balance(anvil, address, amount, timeout=20):
    """Until `address` holds `amount` (payouts are broadcast after the answer that decides them)."""
    deadline = time.monotonic() + timeout
    while anvil.balance(address) != amount:
        assert time.monotonic() < deadline, f'{address} holds {anvil.balance(address)}, not {amount}'
        time.sleep(0.05)


def test_a_farmed_arbitrator_cannot_release_a_strangers_escrow_on_chain(anvil, usdc, tmp_path):
    """The attack: ten 0.01 jobs between two accounts of one person make an agent an arbitrator (10.00), and one
    PATCH from it released a stranger's disputed 300 USDC to the attacker's worker, labelled "community"."""
    db = tmp_path / 'm.db'
    with onchain_server(db, anvil) as server:
        boss, _ = register(server, 'attacker')
        farmer_wallet = Account.create().address
        farmer, agent = register(server, 'attacker farmer', farmer_wallet)
        thief, thief_agent = register(server, 'attacker worker', Account.create().address)
        admin = Caller(server, ADMIN_KEY)

        # Free simulated jobs no longer farm reputation beside real money.
        answer = boss.call('POST', '/api/jobs', job_body(paymentAmount='0.01', paymentCurrency='USD'))
        assert_refused(answer, 400, 'rail_unavailable')
        # Ten real 0.01 USDC jobs still do (the money goes round in the attacker's hands): reputation 10.00.
        for _ in range(10):
            job = funded_job(anvil, boss, ATTACKER_KEY, CENT)
            claim = claim_and_deliver(farmer, agent, job)
            boss.ok('POST', f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True})
        assert farmer.ok('GET', f'/api/agents/{agent["id"]}')['agent']['reputationScore'] == '10.00'
        wait_for_balance(anvil, farmer_wallet, 10 * CENT)
        arbitrator = farmer.ok('POST', '/api/arbitrators', {'name': 'community', 'walletAddress': ATTACKER,
                                                            'agentId': agent['id']}, 201)['arbitrator']
        assert (arbitrator['status'], arbitrator['trusted']) == ('pending', False)

        # The victim's 300 USDC job, "delivered" by the attacker's other worker and disputed by the victim.
        victim, _ = register(server, 'victim')
        job = funded_job(anvil, victim, VICTIM_KEY, 300_000_000)
        claim = claim_and_deliver(thief, thief_agent, job)
        dispute = victim.ok('POST', f'/api/jobs/{job["id"]}/dispute',
                            {'claimId': claim['id'], 'reason': 'This is not the work.'}, 201)['dispute']
        assert (dispute['panel'], dispute['needsAdmin']) == ([], True)     # no active arbitrator to draw
        escrow_before = anvil.balance(ESCROW)
        assert escrow_before == 300_000_000
        decision = {'outcome': 'worker', 'resolution': 'Delivered as asked.', 'resolvedBy': 'community'}
        vote = {'arbitratorId': arbitrator['id'], 'vote': 'worker', 'reasoning': 'Delivered as asked.'}
        for _ in ('pending', 'active'):
            assert_refused(farmer.call('PATCH', f'/api/disputes/{dispute["id"]}', decision), 403, 'forbidden')
            assert_refused(farmer.call('POST', f'/api/disputes/{dispute["id"]}/vote', vote), 403, 'not_on_panel')
            activated = admin.ok('PATCH', f'/api/arbitrators/{arbitrator["id"]}', {'status': 'active'})
            assert (activated['arbitrator']['status'], activated['arbitrator']['trusted']) == ('active', False)
        assert_refused(thief.call('PATCH', f'/api/disputes/{dispute["id"]}', decision), 403, 'conflict_of_interest')

        detail = Caller(server).ok('GET', f'/api/jobs/{job["id"]}')
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('disputed', 'locked')
        assert [payment['type'] for payment in detail['payments']] == ['escrow']
        assert (anvil.balance(ESCROW), anvil.balance(VICTIM)) == (300_000_000, 0)
        dispute = Caller(server).ok('GET', f'/api/disputes/{dispute["id"]}')['dispute']
        assert (dispute['status'], dispute['votesReceived'], dispute['needsAdmin']) == ('open', 0, True)
        assert server.terminate() == 0
    assert ledger_of(db) == []


def test_a_losing_worker_cannot_freeze_its_dispute_with_a_panel_members_wallet(anvil, usdc, tmp_path):
    """Round 3 (CONTRACT.md 20): the worker copied the public wallet of its dispute's only panel member, a trusted
    arbitrator, onto its agent, and that member's vote and decision were refused as a conflict: the victim's
    10 USDC stayed locked for ever. Now the wallet is locked under the dispute, and the ties it opened with hold."""
    db = tmp_path / 'm.db'
    with onchain_server(db, anvil, '--required-votes', '1') as server:
        admin = Caller(server, ADMIN_KEY)
        judge, _ = register(server, 'judge')
        judge_wallet = Account.create().address
        arbitrator = admin.ok('POST', '/api/arbitrators', {'name': 'Judge', 'walletAddress': judge_wallet,
                                                           'accountId': judge.account}, 201)['arbitrator']
        admin.ok('PATCH', f'/api/arbitrators/{arbitrator["id"]}', {'status': 'active', 'trusted': True})
        victim, _ = register(server, 'victim')
        thief, thief_agent = register(server, 'thief', Account.create().address)
        job = funded_job(anvil, victim, VICTIM_KEY, 10_000_000)
        claim = claim_and_deliver(thief, thief_agent, job)
        dispute = victim.ok('POST', f'/api/jobs/{job["id"]}/dispute',
                            {'claimId': claim['id'], 'reason': 'This is not the work.'}, 201)['dispute']
        assert dispute['panel'] == [arbitrator['id']]

        assert_refused(thief.call('PATCH', f'/api/agents/{thief_agent["id"]}', {'walletAddress': judge_wallet}),
                       409, 'wallet_locked')
        assert thief.ok('GET', f'/api/agents/{thief_agent["id"]}')['agent']['walletAddress'] == \
            thief_agent['walletAddress']
        voted = judge.ok('POST', f'/api/disputes/{dispute["id"]}/vote',
                         {'arbitratorId': arbitrator['id'], 'vote': 'requester', 'reasoning': 'Junk.'}, 201)
        assert (voted['resolved'], voted['outcome']) == (True, 'requester')
        wait_for_balance(anvil, VICTIM, 10_000_000)         # refunded on chain to the wallet that funded it
        detail = Caller(server).ok('GET', f'/api/jobs/{job["id"]}')
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('refunded', 'refunded')
        assert [payment['type'] for payment in detail['payments']] == ['escrow', 'refund']
        assert server.terminate() == 0
    assert ledger_of(db) == []


# 3. A deposit burnt as an x402 proof; x402 prices avoided with a free key or an alias ---------------------

def test_x402_takes_no_deposit_and_binds_member_keys_and_aliases(anvil, usdc, tmp_path):
    db = tmp_path / 'm.db'
    prices = ('--x402-pay-to', PAY_TO, '--x402-price', 'GET /api/jobs/match=0.01',
              '--x402-price', 'GET /.well-known/agent-card.json=0.01')
    with onchain_server(db, anvil, *prices) as server:
        requester, _ = register(server, 'requester')
        # A deposit not yet posted, offered as a form-1 proof by a stranger: refused, and still the owner's.
        tx_hash = fund(anvil, VICTIM_KEY, 100_000_000)
        timestamp = anvil.w3.eth.get_block(anvil.receipt(tx_hash)['blockNumber'])['timestamp']
        proof = header_of(x_payment({'txHash': tx_hash, 'from': VICTIM, 'amount': '0.01', 'to': PAY_TO,
                                     'chainId': 8453, 'tokenAddress': USDC, 'timestamp': timestamp}))
        answer = Caller(server).call('GET', '/api/jobs/match?categories=code', headers={'X-PAYMENT': proof})
        body = assert_refused(answer, 402, 'payment_wrong_recipient')
        assert body['accepts'][0]['payTo'] == PAY_TO and 'X-PAYMENT-RESPONSE' not in answer.headers
        job = requester.ok('POST', '/api/jobs', job_body(
            paymentAmount='100.00', escrowTxHash=tx_hash,
            escrowSignature=sign_funding(VICTIM_KEY, requester.account, tx_hash, ESCROW)), 201)['job']
        assert (job['escrowTxHash'], job['escrowStatus']) == (tx_hash, 'locked')

        # A free key from open registration pays like anyone; an alias of a priced route is priced alike.
        member, _ = register(server, 'member')
        assert_refused(member.call('GET', '/api/jobs/match?categories=code'), 402, 'payment_required')
        for path in ('/.well-known/agent-card.json', '/.well-known/agent.json'):
            assert_refused(member.call('GET', path), 402, 'payment_required')
            assert Caller(server, ADMIN_KEY).call('GET', path).status_code == 200       # admins never pay
        anvil.mint(ATTACKER, CENT)
        payment = header_of(x_payment(sign_authorization(ATTACKER_KEY, PAY_TO, CENT, *anvil.window(ahead=3600))))
        paid = member.call('GET', '/api/jobs/match?categories=code', headers={'X-PAYMENT': payment})
        assert paid.status_code == 200, paid.text
        assert paid.json()['total'] == 1 and 'X-PAYMENT-RESPONSE' in paid.headers
        assert (anvil.balance(ATTACKER), anvil.balance(PAY_TO)) == (0, CENT)    # to the x402 address, not escrow
        assert anvil.balance(ESCROW) == 100_000_000
        assert server.terminate() == 0
    conn = sqlite3.connect(f'file:{db}?mode=ro', uri=True)
    assert conn.execute('SELECT account_id, status FROM x402_payments').fetchall() == [(member.account, 'confirmed')]
    conn.close()
    assert ledger_of(db) == []


# 4. A sybil claim that freezes a job; an admin key that outlives its variable ----------------------------

def backdate_claim(db, claim_id, hours):
    """Move a claim's creation back (the server's clock cannot be moved: the database is its memory)."""
    moment = mp.iso(datetime.now(timezone.utc) - timedelta(hours=hours))
    with sqlite3.connect(db, timeout=10) as conn:
        assert conn.execute('UPDATE claims SET created_at = ? WHERE id = ?', (moment, claim_id)).rowcount == 1


def test_an_overdue_claim_expires_at_the_sweep_and_can_be_released(tmp_path):
    db = tmp_path / 'm.db'
    with running(LiveServer(db, ['--sweep-interval', '3600'])) as server:     # the sweep runs when the test says
        requester, _ = register(server, 'requester')
        sybil, sybil_agent = register(server, 'sybil', Account.create().address)
        honest, honest_agent = register(server, 'honest', Account.create().address)
        job = requester.ok('POST', '/api/jobs', job_body(claimTimeoutHours=2), 201)['job']
        frozen = sybil.ok('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': sybil_agent['id']}, 201)['claim']
        assert_refused(honest.call('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': honest_agent['id']}),
                       409, 'already_claimed')
        release = f'/api/jobs/{job["id"]}/claims/{frozen["id"]}/release'
        assert_refused(requester.call('POST', release), 409, 'claim_not_overdue')
        backdate_claim(db, frozen['id'], hours=2)
        assert_refused(sybil.call('POST', release), 403, 'forbidden')      # the worker cannot release itself

        swept = Caller(server, ADMIN_KEY).ok('POST', '/api/jobs/expire')
        assert swept == {'expired': 0, 'refunded': 0, 'reputationPenalties': 1, 'jobIds': []}
        detail = Caller(server).ok('GET', f'/api/jobs/{job["id"]}')
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('open', 'locked')
        assert [claim['status'] for claim in detail['claims']] == ['expired']
        assert_refused(sybil.call('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': sybil_agent['id']}),
                       409, 'claim_expired')                              # no second freeze by the same agent

        second = honest.ok('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': honest_agent['id']}, 201)['claim']
        backdate_claim(db, second['id'], hours=3)
        released = requester.ok('POST', f'/api/jobs/{job["id"]}/claims/{second["id"]}/release')
        assert (released['claim']['status'], released['job']['status']) == ('expired', 'open')
        assert_refused(requester.call('POST', f'/api/jobs/{job["id"]}/claims/{second["id"]}/release'),
                       409, 'claim_not_claimed')
        history = Caller(server).ok('GET', f'/api/agents/{sybil_agent["id"]}')['reputationHistory']
        assert [(entry['delta'], entry['reason']) for entry in history] == [('-0.50', 'claim expired without delivery')]
        assert server.terminate() == 0
    assert ledger_of(db) == []


def signed_in_browser(server, key):
    """A requests.Session signed in through the sign-in page (its form's CSRF token) with `key`."""
    browser = requests.Session()
    page = browser.get(server.url + '/signin', timeout=TIMEOUT).text
    token = re.search(r'name="csrf" value="([0-9a-f]{64})"', page).group(1)
    answer = browser.post(server.url + '/signin', data={'csrf': token, 'apiKey': key}, allow_redirects=False,
                          timeout=TIMEOUT)
    assert (answer.status_code, answer.headers['Location']) == (303, '/my/jobs'), answer.text
    return browser


def test_a_changed_admin_key_revokes_the_old_one_and_ends_its_sessions_at_start(tmp_path):
    """Issue 29, 3: a session opened with a leaked admin key stayed admin after MARKETPLACE_ADMIN_KEY changed and
    released a stranger's 250.00 escrow to the attacker's junk delivery."""
    db, old, new = tmp_path / 'm.db', 'old-admin-key-' + 'o' * 32, 'new-admin-key-' + 'n' * 32
    with running(LiveServer(db, env={'MARKETPLACE_ADMIN_KEY': old})) as server:
        assert Caller(server, old).ok('POST', '/api/jobs/expire')['expired'] == 0
        victim, _ = register(server, 'victim')
        thief, agent = register(server, 'thief', random_wallet())
        job = victim.ok('POST', '/api/jobs', job_body(paymentAmount='250.00'), 201)['job']
        claim = thief.ok('POST', f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, 201)['claim']
        thief.ok('POST', f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': DELIVERABLE})
        browser = signed_in_browser(server, old)        # the leaked key, signed in before the remedy
        page = browser.get(f'{server.url}/jobs/{job["id"]}', timeout=TIMEOUT).text       # an admin sees the buttons
        token = re.search(r'action="/jobs/[0-9a-f-]+/approve".*?name="csrf" value="([0-9a-f]{64})"', page,
                          re.S).group(1)
        assert server.terminate() == 0
    with running(LiveServer(db, env={'MARKETPLACE_ADMIN_KEY': new})) as server:
        assert_refused(Caller(server, old).call('POST', '/api/jobs/expire'), 401, 'unauthorized')
        assert Caller(server, new).ok('POST', '/api/jobs/expire')['expired'] == 0
        answer = browser.post(f'{server.url}/jobs/{job["id"]}/approve', data={'csrf': token, 'claimId': claim['id']},
                              allow_redirects=False, timeout=TIMEOUT)
        assert (answer.status_code, answer.headers['Location']) == (303, '/signin')
        detail = Caller(server).ok('GET', f'/api/jobs/{job["id"]}')
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('delivered', 'locked')
        assert [payment['type'] for payment in detail['payments']] == ['escrow']
        forged = requests.get(server.url + '/my/jobs', headers={'Host': 'evil.test', 'X-Forwarded-Host': 'evil.test'},
                              allow_redirects=False, timeout=TIMEOUT)
        assert (forged.status_code, forged.headers['Location']) == (303, '/signin')     # never built from Host
        assert server.terminate() == 0
    with sqlite3.connect(db) as conn:
        roles = conn.execute("SELECT a.role, k.revoked_at IS NOT NULL FROM accounts a JOIN api_keys k "
                             "ON k.account_id = a.id WHERE k.from_env = 1 ORDER BY k.created_at").fetchall()
    assert roles == [('member', 1), ('admin', 0)]           # the old key's account is an admin no more


# 5. A settled x402 payment whose call failed, rebuilt from the chain; a form-1 hash copied ------------------

def rebuilt_authorization(anvil, settlement):
    """The X-PAYMENT a stranger rebuilds from a settlement on chain: transferWithAuthorization's arguments (from,
    to, value, validAfter, validBefore, nonce, v, r, s) read back from its calldata."""
    data = bytes(anvil.w3.eth.get_transaction(settlement)['input'])
    assert data[:4].hex() == 'e3ee160e', data[:4].hex()
    words = [data[4 + 32 * i: 36 + 32 * i] for i in range(9)]
    authorization = {'from': Web3.to_checksum_address(words[0][12:]), 'to': Web3.to_checksum_address(words[1][12:]),
                     'value': str(int.from_bytes(words[2], 'big')), 'validAfter': str(int.from_bytes(words[3], 'big')),
                     'validBefore': str(int.from_bytes(words[4], 'big')), 'nonce': '0x' + words[5].hex()}
    signature = '0x' + words[7].hex() + words[8].hex() + format(int.from_bytes(words[6], 'big'), '02x')
    return header_of(x_payment({'signature': signature, 'authorization': authorization}))


def paid_header(anvil, key, amount=CENT):
    return header_of(x_payment(sign_authorization(key, PAY_TO, amount, *anvil.window(ahead=3600))))


def receipt_of(answer):
    return json.loads(base64.b64decode(answer.headers['X-PAYMENT-RESPONSE']))


def test_a_settled_payment_whose_call_failed_cannot_approve_a_strangers_delivery(anvil, usdc, tmp_path):
    """The attack: the victim's paid, keyless verify had a typo in its claim id (404, after its authorization was
    settled); a stranger rebuilt the authorization from the chain and, with no key, approved its own junk delivery
    as the victim's wallet account: the 10 USDC escrow went to the attacker. The same settlement also paid the
    stranger's own keyed calls. Now the payment pays only the call it was taken for."""
    db = tmp_path / 'm.db'
    prices = ('--x402-pay-to', PAY_TO, '--x402-price', 'POST /api/jobs=0.01',
              '--x402-price', 'POST /api/jobs/:id/verify=0.01', '--x402-price', 'GET /api/jobs/match=0.01')
    with onchain_server(db, anvil, *prices) as server:
        anvil.mint(VICTIM, 10_000_000 + 10 * CENT)
        funding = anvil.transfer(VICTIM_KEY, ESCROW, 10_000_000)
        body = job_body(paymentAmount='10.00', escrowTxHash=funding)

        # The victim posts its job without a key, as its wallet: told which account to sign the funding for,
        # the same account on every try (it is kept though the first call was refused).
        told = []
        for _ in range(2):
            answer = Caller(server).call('POST', '/api/jobs', body,
                                         headers={'X-PAYMENT': paid_header(anvil, VICTIM_KEY)})
            refused = assert_refused(answer, 402, 'payment_signature_invalid')
            told.append(refused['fundingTypedData']['message']['account'])
            assert receipt_of(answer)['paymentSpent'] is False
        assert told[0] == told[1], told
        signed = dict(body, escrowSignature=sign_funding(VICTIM_KEY, told[0], funding, ESCROW))
        answer = Caller(server).call('POST', '/api/jobs', signed, headers={'X-PAYMENT': paid_header(anvil, VICTIM_KEY)})
        assert answer.status_code == 201, answer.text
        job = answer.json()['job']
        assert job['requesterId'] == told[0] and receipt_of(answer)['paymentSpent'] is True

        thief, agent = register(server, 'attacker worker', ATTACKER)
        claim = claim_and_deliver(thief, agent, job)

        # The victim's verify with a typo in the claim id: its payment settles, the call answers 404.
        typo = {'claimId': '3f2504e0-4f89-11d3-9a0c-0305e82c3301', 'approved': False, 'reason': 'Junk.'}
        victims = paid_header(anvil, VICTIM_KEY)
        answer = Caller(server).call('POST', f'/api/jobs/{job["id"]}/verify', typo, headers={'X-PAYMENT': victims})
        assert_refused(answer, 404, 'not_found')
        settlement = receipt_of(answer)['transaction']
        assert receipt_of(answer)['paymentSpent'] is False
        stolen = rebuilt_authorization(anvil, settlement)

        # The stranger approves its own delivery with it, without a key: refused, nothing done.
        approve = {'claimId': claim['id'], 'approved': True}
        answer = Caller(server).call('POST', f'/api/jobs/{job["id"]}/verify', approve, headers={'X-PAYMENT': stolen})
        refused = assert_refused(answer, 402, 'payment_replayed')
        assert (refused['paymentSpent'], refused['checks']['notReplayed']) == (False, False), refused
        assert 'X-PAYMENT-RESPONSE' not in answer.headers
        # ... nor does it pay for the stranger's own keyed call.
        answer = thief.call('GET', '/api/jobs/match?categories=code', headers={'X-PAYMENT': stolen})
        assert assert_refused(answer, 402, 'payment_replayed')['paymentSpent'] is False

        detail = Caller(server, ADMIN_KEY).ok('GET', f'/api/jobs/{job["id"]}')
        assert (detail['job']['status'], detail['job']['escrowStatus']) == ('delivered', 'locked'), detail['job']
        assert [payment['type'] for payment in detail['payments']] == ['escrow']
        assert (anvil.balance(ESCROW), anvil.balance(ATTACKER)) == (10_000_000, 0)

        # The victim's own call, sent again with the same payment: still its own (the same 404), never spent.
        for header in (victims, stolen):        # as the stranger rebuilt it, too: it is the same payment
            answer = Caller(server).call('POST', f'/api/jobs/{job["id"]}/verify', typo, headers={'X-PAYMENT': header})
            assert_refused(answer, 404, 'not_found')
            assert receipt_of(answer) == {'success': True, 'transaction': settlement, 'network': 'base',
                                          'payer': VICTIM, 'paymentSpent': False}
        assert server.terminate() == 0
    conn = sqlite3.connect(f'file:{db}?mode=ro', uri=True)
    rows = conn.execute('SELECT endpoint, granted_at IS NOT NULL FROM x402_payments ORDER BY seq').fetchall()
    conn.close()
    assert rows == [('POST /api/jobs', 0), ('POST /api/jobs', 0), ('POST /api/jobs', 1),
                    ('POST /api/jobs/{job_id}/verify', 0)]
    assert ledger_of(db) == []


def test_a_copied_form1_hash_is_worth_nothing_to_whoever_did_not_send_it(anvil, usdc, tmp_path):
    """A form-1 proof names a public transaction: without its sender's PaymentProof signature, or with anyone
    else's, it pays nothing (payment_signature_invalid) and stays the sender's to use."""
    db = tmp_path / 'm.db'
    with onchain_server(db, anvil, '--x402-pay-to', PAY_TO, '--x402-price', 'GET /api/jobs/match=0.01') as server:
        anvil.mint(VICTIM, CENT)
        tx_hash = anvil.transfer(VICTIM_KEY, PAY_TO, CENT)
        timestamp = anvil.w3.eth.get_block(anvil.receipt(tx_hash)['blockNumber'])['timestamp']
        claims = {'txHash': tx_hash, 'from': VICTIM, 'amount': '0.01', 'to': PAY_TO, 'chainId': 8453,
                  'tokenAddress': USDC, 'timestamp': timestamp}
        stranger, _ = register(server, 'stranger')
        path = '/api/jobs/match'
        for signature in (None, sign_proof(ATTACKER_KEY, tx_hash, 'GET', path, ESCROW),
                          sign_proof(VICTIM_KEY, tx_hash, 'GET', '/api/agents/match', ESCROW)):
            proof = header_of(x_payment(dict(claims, **({'signature': signature} if signature else {}))))
            for caller in (Caller(server), stranger):
                answer = caller.call('GET', path + '?categories=code', headers={'X-PAYMENT': proof})
                body = assert_refused(answer, 402, 'payment_signature_invalid')
                assert [name for name, passed in body['checks'].items() if not passed] == ['signature'], body
                assert body['proofTypedData']['message'] == {'txHash': None, 'method': 'GET', 'path': path}
        own = header_of(x_payment(dict(claims, signature=sign_proof(VICTIM_KEY, tx_hash, 'GET', path, ESCROW))))
        answer = Caller(server).call('GET', path + '?categories=code', headers={'X-PAYMENT': own})
        assert answer.status_code == 200, answer.text
        assert receipt_of(answer) == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': VICTIM,
                                      'paymentSpent': True}
        answer = stranger.call('GET', path + '?categories=code', headers={'X-PAYMENT': own})
        assert assert_refused(answer, 402, 'payment_replayed')['paymentSpent'] is True
        assert server.terminate() == 0
