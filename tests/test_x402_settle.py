"""x402 form 2 settled (CONTRACT.md 7, docs/x402.md "Pay per call: x402"): an EIP-3009 authorization pays a priced call,
in-process against a real local EVM (anvil, tests/chain.py) with TestUSDC at the Base USDC address.

The escrow wallet (DEV_ADDRESSES[1]) relays each settlement and pays its gas, while the USDC goes to the x402
address (--x402-pay-to, test_x402.PAY_TO); settlements share its nonces
with the jobs' payouts (chain_state 'next_nonce'), are sent in nonce order and confirmed by the sweeps. A slow
settlement answers 503 and the same X-PAYMENT is answered once it is mined; a reverted one is refused. Every
refusal happens before anything is sent. A paid call without a key acts as the payer wallet's account. Last, the
facilitator path (--facilitator-url), its /verify and /settle faked with `responses` while anvil stays real.

Every test uses the `usdc` fixture (through `start`), so the chain is put back as it was after it, and each app's
ledger must balance when the test ends.
"""

import json
import re
import time
from datetime import datetime, timedelta, timezone
from urllib.parse import quote

import pytest
import requests
import responses

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import DEV_ADDRESSES, DEV_KEYS, USDC, Account, sign_authorization, sign_funding, sign_proof

import marketplace as mp
import pay_per_call
import wiring
from conftest import ADMIN_KEY, Client, assert_error, job_body, make_account
from test_cards import header
from test_x402 import PAY_TO, payment_response      # PAY_TO: --x402-pay-to, where the USDC goes
from test_x402_verifier import header_of, x_payment
from verifier.errors import ChainUnavailable
from verifier.x402 import AUTHORIZATION_CHECKS, ON_CHAIN_ONLY

ESCROW_KEY, ESCROW = DEV_KEYS[1], DEV_ADDRESSES[1]      # relays the settlements and pays their gas
PAYER_KEY, PAYER = DEV_KEYS[2], DEV_ADDRESSES[2]
OTHER_KEY, OTHER = DEV_KEYS[3], DEV_ADDRESSES[3]        # a second payer; also funds on-chain jobs
SOMEONE = DEV_ADDRESSES[4]
MATCH_PRICE, JOBS_PRICE = 10_000, 50_000                # 0.01 and 0.05 USDC in base units
MATCH = '/api/jobs/match?categories=code'
FACILITATOR = 'http://facilitator.test'
SLOW = 0.3                                              # SETTLEMENT_WAIT in the slow tests, seconds
TX_HASH = re.compile(r'0x[0-9a-f]{64}')


# Helpers ---------------------------------------------------------------------

@pytest.fixture
def start(tmp_path, anvil, usdc):
    """A function that builds the app on anvil (settings overridable); each app's ledger must balance after."""
    apps = []

    def start_app(**overrides):
        values = dict(db=str(tmp_path / f'x402-{len(apps)}.db'), rate_limits='off', admin_key=ADMIN_KEY,
                      public_url='http://market.test', rpc_url=anvil.url, escrow_key=ESCROW_KEY, confirmations=1,
                      x402_price=mp.parse_prices('GET /api/jobs/match=0.01; POST /api/jobs=0.05'), x402_pay_to=PAY_TO,
                      allow_simulated_rails=True)       # paid posts make USD jobs, simulated beside real USDC
        values.update(overrides)
        app = wiring.make_app(mp.Settings(**values))
        apps.append(app)
        return app
    yield start_app
    for app in apps:
        problems = mp.ledger_problems(app.service.db)
        app.service.close()
        assert problems == []


@pytest.fixture
def app(start):
    return start()


# `client` comes from conftest.py, built on this module's `app`.

@pytest.fixture
def slow(monkeypatch):
    """A paid call waits SLOW seconds for its settlement instead of 10."""
    monkeypatch.setattr(pay_per_call, 'SETTLEMENT_WAIT', SLOW)


def authorization(anvil, key=PAYER_KEY, to=PAY_TO, value=MATCH_PRICE, valid_after=None, valid_before=None,
                  nonce=None):
    """A form-2 X-PAYMENT object as an x402 client sends it, valid on the server's clock and the chain's alike
    (Anvil.window) unless its window is given."""
    earliest, latest = anvil.window()
    return x_payment(sign_authorization(key, to, value, earliest if valid_after is None else valid_after,
                                        latest if valid_before is None else valid_before, nonce))


def expired(anvil):
    """Expired by every clock: the server's, the newest block's."""
    earliest, _ = anvil.window(0, 0)
    return authorization(anvil, valid_after=earliest - 1200, valid_before=earliest - 60)


def not_yet_valid(anvil):
    latest = anvil.window(0, 0)[1]
    return authorization(anvil, valid_after=latest + 600, valid_before=latest + 1200)


def expiring(anvil):
    """Valid now by the server's clock, but for less than the SETTLE_MARGIN (6 s) that settling may take."""
    return authorization(anvil, valid_after=anvil.window()[0], valid_before=int(time.time()) + 3)


def forged(anvil):
    """An authorization from PAYER signed by OTHER."""
    payment = authorization(anvil, key=OTHER_KEY)
    payment['payload']['authorization']['from'] = PAYER
    return payment


def pay(client, payment, path=MATCH, method='GET', body=None):
    """A call without a key, paid with `payment` as its X-PAYMENT."""
    return client.request(method, path, body, headers={'X-PAYMENT': header_of(payment)})


def check_payment(client, payment, endpoint='GET /api/jobs/match'):
    """POST /api/x402: the payment checked against an endpoint's price, not taken."""
    answer = client.post('/api/x402?endpoint=' + quote(endpoint), headers={'X-PAYMENT': header_of(payment)})
    assert answer.status == 200, answer
    return answer.json


def failed_checks(checks):
    return [name for name, passed in checks.items() if not passed]


def refused(answer, code, check):
    """A 402 of a priced call whose first failed check is `check`; its body."""
    body = assert_error(answer, 402, code)
    assert body['x402Version'] == 1 and body['accepts'][0]['payTo'] == PAY_TO, body
    assert failed_checks(body['checks'])[0] == check, body
    return body


def unavailable(answer):
    body = assert_error(answer, 503, 'chain_unavailable')
    assert int(header(answer, 'Retry-After')) > 0, answer
    return body


def db_of(app):
    return app.service.db


def x402_rows(app):
    return db_of(app).rows('SELECT * FROM x402_payments ORDER BY seq')


def only_row(app):
    rows = x402_rows(app)
    assert len(rows) == 1, rows
    return rows[0]


def next_nonce(app):
    return db_of(app).value("SELECT value FROM chain_state WHERE name = 'next_nonce'")


def used(app, tx_hash):
    return db_of(app).row('SELECT * FROM used_payments WHERE tx_hash = :tx', {'tx': tx_hash})


def eth(anvil, address):
    return anvil.w3.eth.get_balance(address)


def escrow_nonce(anvil):
    return anvil.w3.eth.get_transaction_count(ESCROW, 'pending')


def chain_view(anvil, app):
    """What a refused payment leaves as it was: blocks, the escrow wallet's nonce (node and database), balances."""
    return {'block': anvil.block_number(), 'escrowNonce': escrow_nonce(anvil), 'nextNonce': next_nonce(app),
            'usdc': {address: anvil.balance(address) for address in (PAYER, OTHER, ESCROW, PAY_TO)},
            'eth': {address: eth(anvil, address) for address in (PAYER, ESCROW)}}


def exempt_requester(client):
    """A requester an admin marked x402Exempt (its POST /api/jobs is not priced for it): (account, key)."""
    account, key = make_account(client, 'requester')
    answer = client.patch(f'/api/accounts/{account["id"]}', {'x402Exempt': True}, key=ADMIN_KEY)
    assert answer.status == 200, answer
    return account, key


def exempt_key(client):
    return exempt_requester(client)[1]


def funded_job(anvil, client, account, key):
    """A 25 USDC job funded on chain by OTHER (its refunds go back there), posted and signed for `account`."""
    anvil.mint(OTHER, 25_000_000)
    tx_hash = anvil.transfer(OTHER_KEY, ESCROW, 25_000_000)
    signature = sign_funding(OTHER_KEY, account['id'], tx_hash, ESCROW)
    answer = client.post('/api/jobs', dict(job_body(), escrowTxHash=tx_hash, escrowSignature=signature), key=key)
    assert answer.status == 201, answer
    return answer.json['job']


def cancel(client, job, key):
    """Cancel an open on-chain job: its escrow is refunded (a payout signed by the escrow wallet)."""
    answer = client.post(f'/api/jobs/{job["id"]}/cancel', key=key)
    assert answer.status == 200, answer
    return db_of(client.app).row("SELECT * FROM payments WHERE job_id = :id AND type = 'refund'", {'id': job['id']})


def send_ahead(anvil, key, to, amount):
    """A USDC transfer sent with a high tip and not waited for: with automine off, the next block mines it ahead of
    what is already pending with the node's usual tip."""
    account = Account.from_key(key)
    transaction = anvil.token().functions.transfer(to, amount).build_transaction({
        'from': account.address, 'chainId': anvil.chain_id, 'gas': 100_000,
        'nonce': anvil.w3.eth.get_transaction_count(account.address, 'pending'),
        'maxPriorityFeePerGas': 50 * 10**9, 'maxFeePerGas': 200 * 10**9})
    return '0x' + bytes(anvil.w3.eth.send_raw_transaction(account.sign_transaction(transaction).raw_transaction)).hex()


# Form 2 settled by the escrow wallet -----------------------------------------

def test_an_authorization_pays_a_priced_get_settled_by_the_escrow_wallet(anvil, app, client):
    anvil.mint(PAYER, 1_000_000)
    escrow_usdc, income, payer_eth, escrow_eth, nonce = anvil.balance(ESCROW), anvil.balance(PAY_TO), \
        eth(anvil, PAYER), eth(anvil, ESCROW), escrow_nonce(anvil)
    assert next_nonce(app) == nonce
    payment = authorization(anvil)

    answer = pay(client, payment)
    assert answer.status == 200, answer
    assert answer.json == {'matches': [], 'total': 0}
    paid = payment_response(answer)
    tx_hash = paid['transaction']
    assert TX_HASH.fullmatch(tx_hash), paid
    assert paid == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': PAYER, 'paymentSpent': True}

    # On chain: exactly the price moved, in a transaction of the escrow wallet, which paid its gas.
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE
    assert anvil.balance(PAY_TO) == income + MATCH_PRICE       # to the x402 address, never to escrow
    assert anvil.balance(ESCROW) == escrow_usdc
    transaction, receipt = anvil.w3.eth.get_transaction(tx_hash), anvil.receipt(tx_hash)
    assert (transaction['from'], transaction['to'], transaction['nonce']) == (ESCROW, USDC, nonce)
    assert receipt['status'] == 1
    assert eth(anvil, PAYER) == payer_eth
    assert eth(anvil, ESCROW) == escrow_eth - receipt['gasUsed'] * receipt['effectiveGasPrice']
    assert next_nonce(app) == nonce + 1

    row = only_row(app)
    wallet = db_of(app).row('SELECT * FROM wallet_accounts WHERE address = :a', {'a': PAYER})
    assert {key: row[key] for key in ('form', 'status', 'endpoint', 'payer', 'amount', 'asset', 'chain_id',
                                      'authorization_nonce', 'tx_hash', 'nonce', 'account_id')} == {
        'form': 'authorization', 'status': 'confirmed', 'endpoint': 'GET /api/jobs/match', 'payer': PAYER,
        'amount': MATCH_PRICE, 'asset': USDC, 'chain_id': 8453,
        'authorization_nonce': payment['payload']['authorization']['nonce'], 'tx_hash': tx_hash, 'nonce': nonce,
        'account_id': wallet['account_id']}
    assert row['raw_tx'].startswith('0x02') and row['broadcast_at'] and row['granted_at']
    assert used(app, tx_hash)['purpose'] == 'x402'

    # The settlement's hash cannot be shown again as a form-1 proof: every other check of it passes.
    proof = x_payment({'txHash': tx_hash, 'from': PAYER, 'amount': '0.01', 'to': PAY_TO, 'chainId': 8453,
                       'tokenAddress': USDC, 'timestamp': anvil.timestamp(),
                       'signature': sign_proof(PAYER_KEY, tx_hash, 'GET', '/api/jobs/match', ESCROW)})
    body = refused(pay(client, proof), 'payment_replayed', 'notReplayed')
    assert failed_checks(body['checks']) == ['notReplayed']

    # The same X-PAYMENT again: refused, and nothing moves.
    before = chain_view(anvil, app)
    body = refused(pay(client, payment), 'payment_replayed', 'notReplayed')
    assert body['checks']['signature'] is True
    assert chain_view(anvil, app) == before
    assert len(x402_rows(app)) == 1
    assert client.get('/api/x402').json['settlement'] == 'relayer'


def settled_outside(anvil):
    """An authorization settled directly on the token (the gas paid by DEV_KEYS[0]), never by the service."""
    signed = authorization(anvil)['payload']
    anvil.transfer_with_authorization(signed)
    return x_payment(signed)


@pytest.mark.parametrize('make, minted, code, check', [
    (forged, 1_000_000, 'payment_signature_invalid', 'signature'),
    (lambda anvil: authorization(anvil, to=SOMEONE), 1_000_000, 'payment_wrong_recipient', 'recipient'),
    (lambda anvil: authorization(anvil, value=MATCH_PRICE - 1), 1_000_000, 'payment_insufficient', 'amount'),
    (expired, 1_000_000, 'payment_expired', 'fresh'),
    (not_yet_valid, 1_000_000, 'payment_expired', 'fresh'),
    (expiring, 1_000_000, 'payment_expired', 'fresh'),
    (settled_outside, 1_000_000, 'payment_replayed', 'notReplayed'),
    (lambda anvil: authorization(anvil), MATCH_PRICE - 1, 'payment_insufficient', 'balance'),
], ids=['signature', 'recipient', 'amount', 'expired', 'not-yet-valid', 'expires-too-soon', 'used-on-chain',
        'balance'])
def test_a_refused_authorization_sends_nothing(anvil, app, client, make, minted, code, check):
    anvil.mint(PAYER, minted)
    payment = make(anvil)
    before = chain_view(anvil, app)

    body = refused(pay(client, payment), code, check)
    assert failed_checks(body['checks']) == [check]
    assert list(body['checks']) == list(AUTHORIZATION_CHECKS)
    checked = check_payment(client, payment)
    assert {key: checked[key] for key in ('valid', 'checks', 'code', 'form', 'endpoint')} == {
        'valid': False, 'checks': body['checks'], 'code': code, 'form': 'authorization',
        'endpoint': 'GET /api/jobs/match'}

    assert chain_view(anvil, app) == before
    assert x402_rows(app) == []
    assert db_of(app).value('SELECT count(*) FROM wallet_accounts') == 0


def test_a_settlement_that_would_revert_is_refused_before_anything_is_signed(anvil, app, client, real_clock):
    """The server's clock runs ahead of the chain's: by the server's the authorization is valid, in the block being
    built not yet. The simulation (an eth_call from the escrow wallet) finds the revert; nothing is signed."""
    anvil.mint(PAYER, 1_000_000)
    latest = anvil.window(0, 0)[1]
    payment = authorization(anvil, valid_after=latest + 3600, valid_before=latest + 7200)
    real_clock.set(mp.now() + timedelta(minutes=90))
    before = chain_view(anvil, app)

    body = refused(pay(client, payment), 'payment_reverted', 'settles')
    assert 'would revert on chain (TestUSDC: authorization is not yet valid)' in body['error'], body
    assert list(body['checks']) == [*AUTHORIZATION_CHECKS, 'settles']
    assert failed_checks(body['checks']) == ['settles']
    checked = check_payment(client, payment)
    assert (checked['valid'], checked['code'], checked['checks']) == (False, 'payment_reverted', body['checks'])

    assert chain_view(anvil, app) == before         # no nonce taken, nothing sent, no gas paid
    assert x402_rows(app) == []
    assert db_of(app).value('SELECT count(*) FROM used_payments') == 0


def test_a_settlement_reserved_between_the_balance_check_and_the_simulation_makes_it_payment_insufficient(
        anvil, app, client, monkeypatch):
    """The race of test_x402_live's six authorizations, made certain: the second payment's balance is judged before
    the first is reserved, and its settlement simulated after the first was mined. It is refused for the balance
    the first took (payment_insufficient), as every other of the six is, not as a revert."""
    anvil.mint(PAYER, MATCH_PRICE)      # enough for one call
    first, second = authorization(anvil), authorization(anvil)
    x402 = app.service.x402
    simulate = x402.check_settles

    def first_settled_meanwhile(payment):
        """What a racing request does between the two: the first reserved (its row), sent and mined."""
        auth = first['payload']['authorization']
        db_of(app).insert('x402_payments', {
            'id': 'racing', 'form': 'authorization', 'endpoint': 'GET /api/jobs/match', 'chain_id': anvil.chain_id,
            'asset': USDC, 'payer': PAYER, 'amount': MATCH_PRICE, 'authorization_nonce': auth['nonce'].lower(),
            'status': 'pending', 'created_at': mp.now_iso()})
        anvil.transfer_with_authorization({'authorization': auth, 'signature': first['payload']['signature']})
        simulate(payment)
    monkeypatch.setattr(x402, 'check_settles', first_settled_meanwhile)

    body = refused(pay(client, second), 'payment_insufficient', 'balance')
    assert failed_checks(body['checks']) == ['balance', 'settles']
    assert f'holds {MATCH_PRICE} base units of USDC, {MATCH_PRICE} of them promised' in body['error'], body
    assert anvil.balance(PAYER) == 0


def test_pending_authorizations_of_a_payer_count_against_its_balance(anvil, app, client, slow):
    anvil.mint(PAYER, MATCH_PRICE + MATCH_PRICE // 2)      # enough for one call and a half
    anvil.automine(False)
    first, second = authorization(anvil), authorization(anvil)
    unavailable(pay(client, first))         # reserved, signed and sent; not mined, so not in the balance yet
    before = chain_view(anvil, app)

    body = refused(pay(client, second), 'payment_insufficient', 'balance')
    assert failed_checks(body['checks']) == ['balance']
    assert f'holds {MATCH_PRICE + MATCH_PRICE // 2} base units of USDC, {MATCH_PRICE} of them promised' in \
        body['error'], body
    checked = check_payment(client, second)
    assert (checked['valid'], checked['code'], checked['checks']) == (False, 'payment_insufficient', body['checks'])
    assert chain_view(anvil, app) == before
    assert len(x402_rows(app)) == 1

    anvil.mine()
    assert pay(client, first).status == 200
    refused(pay(client, second), 'payment_insufficient', 'balance')     # the chain shows it now: half a call left
    anvil.automine(True)
    anvil.mint(PAYER, MATCH_PRICE // 2)
    answer = pay(client, second)
    assert answer.status == 200, answer
    assert [row['status'] for row in x402_rows(app)] == ['confirmed', 'confirmed']
    assert anvil.balance(PAYER) == 0


# The escrow wallet's nonces: settlements and payouts -----------------------------

def test_a_settlement_after_a_payout_takes_the_next_nonce_and_both_confirm(anvil, app, client):
    account, key = exempt_requester(client)
    job = funded_job(anvil, client, account, key)
    anvil.mint(PAYER, 1_000_000)
    first, other_usdc = escrow_nonce(anvil), anvil.balance(OTHER)
    assert next_nonce(app) == first

    refund = cancel(client, job, key)
    assert refund['nonce'] == first and refund['broadcast_at']
    answer = pay(client, authorization(anvil))
    assert answer.status == 200, answer
    row = only_row(app)
    assert (row['nonce'], row['status']) == (first + 1, 'confirmed')
    assert row['tx_hash'] == payment_response(answer)['transaction']

    assert mp.run_sweeps(db_of(app), app.service.settings)['payouts']['confirmed'] == 1     # the refund
    refund = db_of(app).row('SELECT * FROM payments WHERE id = :id', {'id': refund['id']})
    assert refund['status'] == 'confirmed'
    assert only_row(app)['status'] == 'confirmed'
    for tx_hash, nonce in ((refund['tx_hash'], first), (row['tx_hash'], first + 1)):
        assert anvil.receipt(tx_hash)['status'] == 1
        assert anvil.w3.eth.get_transaction(tx_hash)['nonce'] == nonce
    assert next_nonce(app) == escrow_nonce(anvil) == first + 2
    assert anvil.balance(OTHER) == other_usdc + 25_000_000
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE


def test_a_settlement_the_node_did_not_take_is_sent_before_a_later_payout(anvil, app, client, slow, monkeypatch):
    account, key = exempt_requester(client)
    job = funded_job(anvil, client, account, key)
    anvil.mint(PAYER, 1_000_000)
    first = escrow_nonce(anvil)
    chain, sent, refusing = app.service.settings.onchain.chain, [], [True]
    real_send = chain.send_raw

    def send_raw(raw):
        if refusing[0]:
            raise ChainUnavailable('The node did not take the transaction (test).')
        sent.append(raw)
        return real_send(raw)
    monkeypatch.setattr(chain, 'send_raw', send_raw)

    payment = authorization(anvil)
    unavailable(pay(client, payment))       # signed and stored, never sent: not mined in time
    row = only_row(app)
    assert (row['status'], row['nonce'], row['broadcast_at'], row['granted_at']) == ('pending', first, None, None)
    assert row['raw_tx'] and escrow_nonce(anvil) == first and anvil.balance(PAYER) == 1_000_000

    refusing[0] = False
    refund = cancel(client, job, key)       # nonce first + 1; the broadcast after it sends both, oldest first
    assert refund['nonce'] == first + 1
    assert sent == [row['raw_tx'], refund['raw_tx']]
    assert only_row(app)['broadcast_at'] is not None
    assert anvil.w3.eth.get_transaction(row['tx_hash'])['nonce'] == first

    assert mp.run_sweeps(db_of(app), app.service.settings)['payouts'] == \
        {'confirmed': 2, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert only_row(app)['status'] == 'confirmed'
    assert db_of(app).value('SELECT status FROM payments WHERE id = :id', {'id': refund['id']}) == 'confirmed'
    assert anvil.receipt(row['tx_hash'])['status'] == anvil.receipt(refund['tx_hash'])['status'] == 1

    answer = pay(client, payment)           # the same X-PAYMENT: answered with the settlement made then
    assert answer.status == 200, answer
    assert payment_response(answer)['transaction'] == row['tx_hash']
    assert only_row(app)['granted_at'] is not None
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE
    assert next_nonce(app) == escrow_nonce(anvil) == first + 2


def test_a_settlement_the_node_lost_is_sent_again_by_the_sweep(anvil, app, client, slow, real_clock):
    anvil.mint(PAYER, 1_000_000)
    anvil.automine(False)
    payment = authorization(anvil)

    unavailable(pay(client, payment))       # sent, then lost by the node before it was mined
    row = only_row(app)
    assert row['broadcast_at'] is not None
    anvil.rpc('anvil_dropTransaction', row['tx_hash'])
    anvil.mine()
    chain = app.service.settings.onchain.chain
    assert chain.receipt(row['tx_hash']) is None

    def sweep():
        return mp.run_sweeps(db_of(app), app.service.settings)['payouts']
    # sent under 30 s ago: not yet
    assert sweep() == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    real_clock.set(mp.now() + timedelta(seconds=31))
    assert sweep() == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    anvil.mine()
    assert sweep() == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert (only_row(app)['status'], only_row(app)['granted_at']) == ('confirmed', None)
    assert chain.receipt(row['tx_hash'])['status'] == 1

    answer = pay(client, payment)
    assert answer.status == 200, answer
    assert payment_response(answer)['transaction'] == row['tx_hash']
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE



def test_a_settlement_whose_nonce_another_transaction_used_is_signed_again_with_a_new_one(anvil, app, client, slow,
                                                                                         real_clock):
    """The escrow key used elsewhere while the service runs (its nonce now behind the chain's): the node answers
    "nonce too low", which reads as already sent; once the nonce is used --confirmations deep by a transaction none of
    the settlement's hashes is, and --payout-rebroadcast-minutes have passed, the sweep signs it again with a new
    nonce. The payer pays once."""
    anvil.mint(PAYER, 1_000_000)
    first = next_nonce(app)
    anvil.transfer(ESCROW_KEY, SOMEONE, 0)              # the operator's own transaction, with the key the service uses
    assert escrow_nonce(anvil) == first + 1
    payment = authorization(anvil)
    unavailable(pay(client, payment))                   # signed with `first`: taken; the node says "nonce too low"
    row, chain = only_row(app), app.service.settings.onchain.chain
    assert (row['nonce'], row['broadcast_at'] is not None, chain.receipt(row['tx_hash'])) == (first, True, None)

    def sweep():
        return mp.run_sweeps(db_of(app), app.service.settings)['payouts']
    real_clock.set(mp.now() + timedelta(minutes=9))     # not before --payout-rebroadcast-minutes (10)
    assert sweep() == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    assert only_row(app)['tx_hash'] == row['tx_hash']
    real_clock.set(mp.now() + timedelta(minutes=2))
    assert sweep() == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 1}
    again = only_row(app)
    assert (again['nonce'], again['status']) == (first + 1, 'pending') and again['tx_hash'] != row['tx_hash']
    assert [(signed['tx_hash'], signed['nonce']) for signed in db_of(app).rows(
        'SELECT tx_hash, nonce FROM signed_transactions WHERE payment_id = :id ORDER BY seq', {'id': row['id']})] == \
        [(row['tx_hash'], first), (again['tx_hash'], first + 1)]
    assert sweep() == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert next_nonce(app) == escrow_nonce(anvil) == first + 2
    answer = pay(client, payment)                       # the same payment again: its call answered, paid once
    assert answer.status == 200, answer
    assert payment_response(answer)['transaction'] == again['tx_hash']
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE
    assert sweep() == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}


# Slow and reverted settlements ---------------------------------------------------

def test_a_slow_settlement_is_answered_when_the_same_payment_comes_again(anvil, app, client, slow):
    anvil.mint(PAYER, 1_000_000)
    income = anvil.balance(PAY_TO)
    anvil.automine(False)
    payment = authorization(anvil)

    unavailable(pay(client, payment))
    row = only_row(app)
    assert (row['status'], row['granted_at']) == ('pending', None)
    assert row['broadcast_at'] and TX_HASH.fullmatch(row['tx_hash'])
    assert app.service.settings.onchain.chain.receipt(row['tx_hash']) is None
    assert anvil.balance(PAYER) == 1_000_000
    other = refused(pay(client, payment, MATCH + '&limit=1'), 'payment_replayed', 'notReplayed')   # another call
    assert other['paymentSpent'] is False and only_row(app)['tx_hash'] == row['tx_hash']

    anvil.mine()
    answer = pay(client, payment)
    assert answer.status == 200, answer
    assert payment_response(answer) == {'success': True, 'transaction': row['tx_hash'], 'network': 'base',
                                        'payer': PAYER, 'paymentSpent': True}
    assert (only_row(app)['status'], bool(only_row(app)['granted_at'])) == ('confirmed', True)
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE
    assert anvil.balance(PAY_TO) == income + MATCH_PRICE

    before = chain_view(anvil, app)
    refused(pay(client, payment), 'payment_replayed', 'notReplayed')
    anvil.mine()
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE
    assert chain_view(anvil, app) == dict(before, block=before['block'] + 1)


def test_a_settled_payment_pays_only_its_own_call_for_an_hour_whatever_its_valid_before(anvil, app, client,
                                                                                         real_clock):
    """Settled for a call that answered 400: after the authorization's validBefore another call is still refused
    as a replay (not as expired: the window is the service's hour), its own call is still answered as itself, and
    once the hour has passed it is payment_expired for every call, never spent."""
    anvil.mint(PAYER, 1_000_000)
    payment = authorization(anvil)
    typo = MATCH + '&min_pay=abc'
    assert_error(pay(client, payment, typo), 400, 'invalid_parameter')
    valid_before = int(payment['payload']['authorization']['validBefore'])
    real_clock.set(datetime.fromtimestamp(valid_before + 60, timezone.utc))         # past validBefore
    body = refused(pay(client, payment), 'payment_replayed', 'fresh')
    assert (body['paymentSpent'], body['checks']['notReplayed']) == (False, False)
    assert_error(pay(client, payment, typo), 400, 'invalid_parameter')             # its own call: still its own
    real_clock.advance(hours=1)
    for path in (typo, MATCH):
        body = refused(pay(client, payment, path), 'payment_expired', 'fresh')
        assert body['paymentSpent'] is False, body
    assert only_row(app)['granted_at'] is None
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE                          # settled once, never again


def test_a_settlement_that_reverts_is_refused_when_the_payment_comes_again(anvil, app, client, slow):
    anvil.mint(PAYER, MATCH_PRICE)
    income = anvil.balance(PAY_TO)
    anvil.automine(False)
    payment = authorization(anvil)

    unavailable(pay(client, payment))       # checked (the payer held the price), signed, sent, not mined
    row = only_row(app)
    moved = send_ahead(anvil, PAYER_KEY, SOMEONE, MATCH_PRICE)     # the payer's USDC goes first
    anvil.mine()
    assert anvil.receipt(moved)['status'] == 1
    assert anvil.receipt(row['tx_hash'])['status'] == 0

    body = assert_error(pay(client, payment), 402, 'payment_reverted')
    assert row['tx_hash'] in body['error']
    row = only_row(app)
    assert (row['status'], row['granted_at']) == ('failed', None)
    assert anvil.balance(PAYER) == 0
    assert anvil.balance(SOMEONE) == MATCH_PRICE
    assert anvil.balance(PAY_TO) == income
    assert db_of(app).value('SELECT count(*) FROM wallet_accounts') == 0


def test_a_settlement_the_sweep_found_reverted_is_still_refused_as_reverted(anvil, app, client, slow):
    """Once a sweep (OnChain.confirm) has marked a reverted settlement 'failed', the same X-PAYMENT is refused as
    payment_reverted too, as it is before the sweep (the test above): the answer does not depend on whether a
    sweep ran in between. (It was payment_replayed, "used already", though nothing was paid.)"""
    anvil.mint(PAYER, MATCH_PRICE)
    anvil.automine(False)
    payment = authorization(anvil)
    unavailable(pay(client, payment))
    row = only_row(app)
    send_ahead(anvil, PAYER_KEY, SOMEONE, MATCH_PRICE)
    anvil.mine()
    assert anvil.receipt(row['tx_hash'])['status'] == 0
    assert mp.run_sweeps(db_of(app), app.service.settings)['payouts'] == \
        {'confirmed': 0, 'failed': 1, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert only_row(app)['status'] == 'failed'
    nonce = payment['payload']['authorization']['nonce']
    assert not app.service.settings.onchain.chain.authorization_used(USDC, PAYER, nonce)     # unused on chain

    body = assert_error(pay(client, payment), 402, 'payment_reverted')     # fails here: payment_replayed
    assert row['tx_hash'] in body['error']


# A paid write acts as the payer wallet's account ------------------------------------

def stripe_job(**overrides):
    return job_body(paymentCurrency='USD', paymentRail='stripe', **overrides)


def wallet_account_of(app, address):
    return db_of(app).row('''SELECT a.* FROM wallet_accounts w JOIN accounts a ON a.id = w.account_id
                             WHERE w.address = :address''', {'address': address})


def test_a_paid_post_acts_as_the_payer_wallets_account(anvil, app, client):
    anvil.mint(PAYER, 1_000_000)
    anvil.mint(OTHER, 1_000_000)

    answer = pay(client, authorization(anvil, value=JOBS_PRICE), '/api/jobs', 'POST', stripe_job(title='first'))
    assert answer.status == 201, answer
    account = wallet_account_of(app, PAYER)
    assert (account['name'], account['role']) == (f'wallet {PAYER}', 'member')
    assert answer.json['job']['requesterId'] == account['id']
    assert answer.json['job']['paymentCurrency'] == 'USD'
    assert payment_response(answer)['payer'] == PAYER

    again = pay(client, authorization(anvil, value=JOBS_PRICE), '/api/jobs', 'POST', stripe_job(title='second'))
    assert again.status == 201, again
    assert again.json['job']['requesterId'] == account['id']

    other = pay(client, authorization(anvil, key=OTHER_KEY, value=JOBS_PRICE), '/api/jobs', 'POST', stripe_job())
    assert other.status == 201, other
    other_account = wallet_account_of(app, OTHER)
    assert other.json['job']['requesterId'] == other_account['id'] != account['id']
    assert other_account['name'] == f'wallet {OTHER}'

    assert db_of(app).value('SELECT count(*) FROM wallet_accounts') == 2
    assert [(row['payer'], row['account_id'], row['endpoint']) for row in x402_rows(app)] == [
        (PAYER, account['id'], 'POST /api/jobs'), (PAYER, account['id'], 'POST /api/jobs'),
        (OTHER, other_account['id'], 'POST /api/jobs')]
    assert anvil.balance(PAYER) == 1_000_000 - 2 * JOBS_PRICE
    assert anvil.balance(OTHER) == 1_000_000 - JOBS_PRICE


def test_a_member_key_pays_and_its_paid_calls_act_as_its_account(anvil, app, client):
    account, key = make_account(client, 'member')       # open registration: a key costs nothing
    anvil.mint(PAYER, 1_000_000)
    assert_error(client.get(MATCH, key=key), 402, 'payment_required')
    assert_error(client.post('/api/jobs', stripe_job(), key=key), 402, 'payment_required')

    answer = client.get(MATCH, key=key, headers={'X-PAYMENT': header_of(authorization(anvil))})
    assert answer.status == 200, answer
    posted = client.post('/api/jobs', stripe_job(), key=key,
                         headers={'X-PAYMENT': header_of(authorization(anvil, value=JOBS_PRICE))})
    assert posted.status == 201, posted
    assert posted.json['job']['requesterId'] == account['id']
    assert [(row['endpoint'], row['account_id'], row['status']) for row in x402_rows(app)] == [
        ('GET /api/jobs/match', account['id'], 'confirmed'), ('POST /api/jobs', account['id'], 'confirmed')]
    assert db_of(app).value('SELECT count(*) FROM wallet_accounts') == 0      # the key's account, not the wallet's
    assert anvil.balance(PAYER) == 1_000_000 - MATCH_PRICE - JOBS_PRICE

    for free in (ADMIN_KEY, exempt_key(client)):
        assert client.get(MATCH, key=free).status == 200
        assert client.post('/api/jobs', stripe_job(), key=free).status == 201
    assert len(x402_rows(app)) == 2


def test_an_x402_settlement_cannot_fund_a_job(anvil, app, client):
    anvil.mint(PAYER, 1_000_000)
    tx_hash = payment_response(pay(client, authorization(anvil)))['transaction']
    assert anvil.receipt(tx_hash)['status'] == 1
    posted = client.post('/api/jobs', dict(job_body(paymentAmount='0.01'), escrowTxHash=tx_hash),
                         key=exempt_key(client))
    # the hash paid for a call already (and sent the USDC to the x402 address, not to escrow)
    assert_error(posted, 409, 'payment_replayed')
    assert db_of(app).value('SELECT count(*) FROM jobs') == 0
    assert used(app, tx_hash)['purpose'] == 'x402'


def test_a_paid_post_with_an_invalid_body_spends_nothing_and_pays_only_that_call(anvil, app, client):
    """Settled for a call that answered 400: not spent, and bound to that call (CONTRACT.md 20). The corrected call
    is another call: refused with payment_replayed, paymentSpent false, nothing done; the same call may send it
    again (and gets its 400 again); the payer's account is kept."""
    anvil.mint(PAYER, 1_000_000)
    first = escrow_nonce(anvil)
    payment = authorization(anvil, value=JOBS_PRICE)

    typo = stripe_job(category='cooking')
    answer = pay(client, payment, '/api/jobs', 'POST', typo)
    assert_error(answer, 400, 'validation_failed', fields=['category'])
    receipt = payment_response(answer)
    row = only_row(app)
    assert (receipt['transaction'], receipt['paymentSpent']) == (row['tx_hash'], False), receipt
    assert (row['status'], row['granted_at'], row['account_id']) == ('confirmed', None, None)
    assert db_of(app).value('SELECT count(*) FROM jobs') == 0
    assert anvil.balance(PAYER) == 1_000_000 - JOBS_PRICE        # settled: the money moved once
    account = wallet_account_of(app, PAYER)
    assert account is not None                                   # kept, though the call was refused

    body = refused(pay(client, payment, '/api/jobs', 'POST', stripe_job()), 'payment_replayed', 'notReplayed')
    assert body['paymentSpent'] is False
    assert db_of(app).value('SELECT count(*) FROM jobs') == 0
    assert_error(pay(client, payment, '/api/jobs', 'POST', typo), 400, 'validation_failed', fields=['category'])
    assert only_row(app)['granted_at'] is None
    assert anvil.balance(PAYER) == 1_000_000 - JOBS_PRICE        # no second transfer
    assert escrow_nonce(anvil) == next_nonce(app) == first + 1
    assert wallet_account_of(app, PAYER) == account


# Settled by a facilitator ----------------------------------------------------------

SETTLED = '0x' + 'ab' * 32      # the facilitator's settlement transaction


@pytest.fixture
def facilitator(anvil):
    """The facilitator at FACILITATOR, faked by `responses`; anvil stays real (web3 uses requests too)."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        mock.add_passthru(anvil.url)
        yield mock


@pytest.fixture
def app_f(start, facilitator):
    """The app settling authorizations through the facilitator (--facilitator-url)."""
    return start(facilitator_url=FACILITATOR)


@pytest.fixture
def client_f(app_f):
    return Client(app_f)


def answers(facilitator, verify=None, settle=None):
    """What /verify and /settle answer (a dict as JSON, or responses' keyword arguments)."""
    for step, answer in (('verify', verify or {'isValid': True, 'payer': PAYER}),
                         ('settle', settle or {'success': True, 'transaction': SETTLED, 'network': 'base',
                                               'payer': PAYER})):
        kwargs = answer if {'json', 'body', 'status'} & set(answer) else {'json': answer}
        facilitator.upsert(responses.POST, f'{FACILITATOR}/{step}', **kwargs)


def calls(facilitator, step):
    """The JSON bodies POSTed to the facilitator's /step, in order."""
    return [json.loads(call.request.body) for call in facilitator.calls if call.request.url == f'{FACILITATOR}/{step}']


def facilitator_calls(facilitator):
    return [call for call in facilitator.calls if call.request.url.startswith(FACILITATOR)]


def test_a_facilitator_settles_an_authorization(anvil, app_f, client_f, facilitator):
    anvil.mint(PAYER, 1_000_000)
    answers(facilitator)
    listing = client_f.get('/api/x402').json
    assert listing['settlement'] == 'facilitator'
    requirements = next(endpoint['accepts'][0] for endpoint in listing['endpoints']
                        if endpoint['path'] == '/api/jobs/match')
    assert (requirements['maxAmountRequired'], requirements['resource'], requirements['payTo']) == (
        str(MATCH_PRICE), 'http://market.test/api/jobs/match', PAY_TO)
    before = chain_view(anvil, app_f)
    payment = authorization(anvil)

    answer = pay(client_f, payment)
    assert answer.status == 200, answer
    assert payment_response(answer) == {'success': True, 'transaction': SETTLED, 'network': 'base', 'payer': PAYER,
                                        'paymentSpent': True}
    expected = {'x402Version': 1, 'paymentPayload': payment, 'paymentRequirements': requirements}
    assert calls(facilitator, 'verify') == [expected]
    assert calls(facilitator, 'settle') == [expected]

    row = only_row(app_f)
    assert (row['status'], row['tx_hash'], row['raw_tx'], row['nonce'], row['broadcast_at']) == (
        'confirmed', SETTLED, None, None, None)
    assert row['granted_at'] is not None
    assert used(app_f, SETTLED)['purpose'] == 'x402'
    assert chain_view(anvil, app_f) == before       # the escrow wallet signed and sent nothing

    refused(pay(client_f, payment), 'payment_replayed', 'notReplayed')
    assert len(facilitator_calls(facilitator)) == 2


@pytest.mark.parametrize('reason, code, check', [
    ('insufficient_funds', 'payment_insufficient', 'balance'),
    ('invalid_exact_evm_payload_signature', 'payment_signature_invalid', 'signature'),
])
def test_a_facilitators_refusal_is_a_402_naming_its_check(anvil, app_f, client_f, facilitator, reason, code, check):
    answers(facilitator, verify={'isValid': False, 'invalidReason': reason, 'payer': PAYER})
    payment = authorization(anvil)

    body = refused(pay(client_f, payment), code, check)
    assert failed_checks(body['checks']) == [check]
    checked = check_payment(client_f, payment)
    assert (checked['valid'], checked['code'], checked['checks']) == (False, code, body['checks'])
    assert len(calls(facilitator, 'verify')) == 2
    assert calls(facilitator, 'settle') == []
    assert x402_rows(app_f) == []


def test_a_failed_facilitator_settlement_releases_the_authorization(anvil, app_f, client_f, facilitator):
    answers(facilitator, settle={'success': False, 'errorReason': 'insufficient_funds', 'transaction': '',
                                 'network': 'base', 'payer': PAYER})
    payment = authorization(anvil)

    assert_error(pay(client_f, payment), 402, 'payment_insufficient')
    assert x402_rows(app_f) == []

    answers(facilitator)
    answer = pay(client_f, payment)
    assert answer.status == 200, answer
    assert payment_response(answer)['transaction'] == SETTLED
    assert len(calls(facilitator, 'settle')) == 2
    assert only_row(app_f)['status'] == 'confirmed'


@pytest.mark.parametrize('step', ['verify', 'settle'])
@pytest.mark.parametrize('failure', [
    {'body': requests.ConnectionError('unreachable')},
    {'status': 500, 'json': {'error': 'internal'}},
    {'status': 200, 'body': 'not json', 'content_type': 'text/plain'},
    {'status': 200, 'json': ['not', 'an', 'object']},
], ids=['unreachable', '500', 'not-json', 'not-an-object'])
def test_a_facilitator_that_does_not_answer_is_503_and_releases_the_authorization(
        anvil, app_f, client_f, facilitator, step, failure):
    answers(facilitator, **{step: failure})
    payment = authorization(anvil)

    unavailable(pay(client_f, payment))
    assert x402_rows(app_f) == []
    assert len(calls(facilitator, 'settle')) == (1 if step == 'settle' else 0)

    answers(facilitator)
    answer = pay(client_f, payment)
    assert answer.status == 200, answer
    assert payment_response(answer)['transaction'] == SETTLED


def test_a_facilitator_settlement_of_a_call_that_failed_is_not_settled_again(anvil, app_f, client_f, facilitator):
    answers(facilitator)
    payment = authorization(anvil, value=JOBS_PRICE)

    typo = stripe_job(category='cooking')
    assert_error(pay(client_f, payment, '/api/jobs', 'POST', typo), 400, 'validation_failed', fields=['category'])
    row = only_row(app_f)
    assert (row['status'], row['tx_hash'], row['granted_at']) == ('confirmed', SETTLED, None)

    refused(pay(client_f, payment, '/api/jobs', 'POST', stripe_job()), 'payment_replayed', 'notReplayed')
    assert_error(pay(client_f, payment, '/api/jobs', 'POST', typo), 400, 'validation_failed',
                 fields=['category'])      # its own call again: not settled again
    assert (len(calls(facilitator, 'verify')), len(calls(facilitator, 'settle'))) == (1, 1)
    assert only_row(app_f)['granted_at'] is None
    assert db_of(app_f).value('SELECT count(*) FROM jobs') == 0


def test_our_own_checks_run_before_the_facilitator_is_asked(anvil, app_f, client_f, facilitator):
    answers(facilitator)
    payment = forged(anvil)

    refused(pay(client_f, payment), 'payment_signature_invalid', 'signature')
    checked = check_payment(client_f, payment)
    assert (checked['valid'], checked['code']) == (False, 'payment_signature_invalid')
    assert not set(checked['checks']) & set(ON_CHAIN_ONLY)       # the chain's checks are the facilitator's
    assert facilitator_calls(facilitator) == []
    assert x402_rows(app_f) == []
