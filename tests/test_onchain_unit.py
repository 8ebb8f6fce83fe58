"""The service in onchain mode (CONTRACT.md 7, docs/payments-on-chain.md "USDC on Base: onchain mode"), in-process, against a
fake JSON-RPC node served by `responses` (test_verifier.FakeNode): nothing leaves the process.

Funding (POST /api/jobs on rail base with escrowTxHash and the payer's escrowSignature), payouts and refunds signed with the escrow key,
broadcast after the commit, and confirmed, re-sent or failed by the sweep. The ledger must balance after
every test (the `started` fixture checks mp.ledger_problems of every app it built when the test ends).
"""

import re
import time
from datetime import timedelta
from decimal import Decimal

import pytest
import requests
import responses

# eth_account through chain.py first: it keeps the recursion limit as it was (see there).
from chain import DEV_ADDRESSES, DEV_KEYS, Account, funding_typed_data, sign_funding
from eth_utils import keccak
from hexbytes import HexBytes

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, Market, assert_error, in_hours, job_body, make_account, make_agent
from test_openapi import Checker
from test_verifier import (BASE_CHAIN, ESCROW, ESCROW_KEY, NODE_URL, OTHER_TOKEN, PAYER, SOMEONE, USDC, FakeNode,
                           block_hash_of, decode, make_receipt, transfer_data, transfer_log, tx_hash_of)
from verifier.errors import ChainUnavailable, VerificationError

TX_HASH = re.compile(r'^0x[0-9a-f]{64}$')
NODE_NONCE = 7          # the escrow wallet's next nonce, as the fake node reports it
PAYER_KEY = DEV_KEYS[1]     # PAYER's: FakeNode.pay's transfers come from it


def onchain_settings(tmp_path, **overrides):
    values = dict(db=str(tmp_path / 'onchain.db'), rate_limits='off', admin_key=ADMIN_KEY,
                  public_url='http://market.test', allow_private_webhooks=True, rpc_url=NODE_URL,
                  chain_id=BASE_CHAIN, escrow_key=ESCROW_KEY, confirmations=2)
    values.update(overrides)
    return mp.Settings(**values)


@pytest.fixture
def node():
    """The fake node at NODE_URL, inside a RequestsMock: any other HTTP request fails."""
    with responses.RequestsMock(assert_all_requests_are_fired=False) as mock:
        yield FakeNode(nonce=NODE_NONCE).install(mock)


@pytest.fixture
def started(tmp_path, node):
    """A function that builds the onchain app (settings overridable); each app's ledger must balance after."""
    apps = []

    def start(**overrides):
        app = wiring.make_app(onchain_settings(tmp_path, **overrides))
        apps.append(app)
        return app
    yield start
    for app in apps:
        problems = mp.ledger_problems(app.service.db)
        app.service.close()
        assert problems == []


@pytest.fixture
def app(started):
    return started()


# `client` and `market` come from conftest.py, built on this module's `app`.


def db_of(market):
    return market.client.app.service.db


def post_job(market, tx_hash=None, key=None, account=None, signer=PAYER_KEY, **overrides):
    """POST /api/jobs by `key` (the market's requester by default) with `tx_hash`, signed by `signer` (the
    payer's key; None sends no escrowSignature) for `account` (the key's account, the requester's by default)."""
    body = job_body(**overrides)
    if tx_hash is not None:
        body['escrowTxHash'] = tx_hash
        if signer is not None and isinstance(tx_hash, str) and TX_HASH.fullmatch(tx_hash.lower()):
            body['escrowSignature'] = sign_funding(signer, (account or market.requester)['id'], tx_hash, ESCROW)
    return market.client.post('/api/jobs', body, key=key or market.requester_key)


def funded_job(market, node, amount=25_000_000, **overrides):
    """An open job on rail base funded on chain by PAYER with `amount` base units."""
    answer = post_job(market, node.pay(amount), **overrides)
    assert answer.status == 201, answer
    return answer.json['job']


def count_jobs(market):
    return db_of(market).value('SELECT count(*) FROM jobs')


def stored(market, tx_hash):
    return db_of(market).row('SELECT * FROM payments WHERE tx_hash = :hash', {'hash': tx_hash})


def by_type(payments, kind):
    found = [p for p in payments if p['type'] == kind]
    assert len(found) == 1, payments
    return found[0]


def approve(market, job):
    """Claim, deliver and approve: the verify answer."""
    claim = market.deliver(job, market.claim(job))
    answer = market.verify(job, claim, True)
    assert answer.status == 200, answer
    return answer.json


def assert_pays(raw, to, amount, nonce):
    """A raw transaction: a USDC transfer signed by the escrow key on Base paying `to` `amount`."""
    assert Account.recover_transaction(raw) == ESCROW
    tx = decode(raw)
    assert (tx['type'], tx['chainId'], tx['nonce'], tx['value']) == (2, BASE_CHAIN, nonce, 0)
    assert tx['to'].hex() == USDC[2:].lower()
    assert '0x' + tx['data'].hex() == transfer_data(to, amount)


# ----- start and health -----

def test_a_node_on_another_chain_refuses_to_start(tmp_path, node):
    node.chain_id = 1
    with pytest.raises(ValueError) as raised:
        wiring.make_app(onchain_settings(tmp_path))
    assert 'chain 1' in str(raised.value) and '8453' in str(raised.value)
    assert node.methods() == ['eth_chainId']


def test_an_unreachable_node_does_not_stop_the_start_and_health_says_so(tmp_path, node, started):
    node.fail = requests.exceptions.ConnectionError('connection refused')
    app = started()
    answer = Client(app).get('/api/health')
    assert answer.status == 200, answer
    assert answer.json['status'] == 'ok'
    assert answer.json['payments'] == 'onchain'
    assert answer.json['rails'] == {'base': 'onchain', 'stripe': 'simulated'}
    assert answer.json['chain'] == {'chainId': 8453, 'latestBlock': None, 'escrowAddress': ESCROW,
                                    'usdcAddress': USDC, 'reachable': False}


def test_a_reachable_node_shows_its_latest_block(node, client):
    node.latest = 4321
    answer = client.get('/api/health')
    assert answer.status == 200, answer
    assert answer.json['payments'] == 'onchain'
    assert answer.json['chain'] == {'chainId': 8453, 'latestBlock': 4321, 'escrowAddress': ESCROW,
                                    'usdcAddress': USDC, 'reachable': True}
    # at start: the chain id, then the escrow wallet's nonce and the fees
    assert node.calls[0] == ('eth_chainId', [])
    assert ('eth_getTransactionCount', [ESCROW, 'pending']) in node.calls


def test_health_asks_the_node_at_most_once_per_block_time(node, client):
    node.latest = 4321
    before = node.count('eth_blockNumber')
    assert [client.get('/api/health').json['chain']['latestBlock'] for _ in range(5)] == [4321] * 5
    assert node.count('eth_blockNumber') == before + 1
    onchain = client.app.service.settings.onchain
    onchain.latest = (time.monotonic() - 2.5, onchain.latest[1])     # its view is now older than a block time
    node.latest = 4322
    assert client.get('/api/health').json['chain']['latestBlock'] == 4322
    assert node.count('eth_blockNumber') == before + 2


def null_answers(node, *methods):
    """The node answers `result: null` (not a number, not an answer) to these methods."""
    for method in methods:
        node.answers[method] = lambda params: (200, {}, '{"jsonrpc": "2.0", "id": 0, "result": null}')


def test_a_node_answering_nonsense_at_start_is_unreachable_not_a_crash(node, started):
    """CONTRACT.md 7: a node that gives no answer (`result: null` for its chain id) is no reason not to
    start, and not a TypeError out of make_app."""
    null_answers(node, 'eth_chainId')
    client = Client(started())
    health = client.get('/api/health')
    assert health.status == 200, health
    assert health.json['payments'] == 'onchain'


def test_a_node_answering_nonsense_is_unreachable_in_health_and_503_for_payments(node, market):
    """`result: null` for eth_blockNumber: health says unreachable (not a 500), and a funding that needs the
    block number answers 503 chain_unavailable (never 500)."""
    tx_hash = node.pay(25_000_000)
    null_answers(node, 'eth_blockNumber')
    health = market.client.get('/api/health')
    assert health.status == 200, health
    assert (health.json['chain']['reachable'], health.json['chain']['latestBlock']) == (False, None)
    assert_error(post_job(market, tx_hash), 503, 'chain_unavailable')
    assert count_jobs(market) == 0


@pytest.mark.parametrize('code, status', [
    ('payment_required', 402), ('payment_invalid', 400), ('payment_not_found', 402), ('payment_reverted', 402),
    ('payment_wrong_chain', 402), ('payment_wrong_token', 402), ('payment_wrong_recipient', 402),
    ('payment_wrong_payer', 402), ('payment_insufficient', 402), ('payment_pending', 402),
    ('payment_reorged', 402), ('payment_expired', 402), ('payment_signature_invalid', 402),
    ('payment_replayed', 409), ('chain_unavailable', 503)])
def test_payment_error_statuses(code, status):
    error = mp.payment_error(VerificationError('It did not check out.', code))
    assert (error.status, error.code, error.message) == (status, code, 'It did not check out.')
    assert error.body() == {'error': 'It did not check out.', 'code': code, 'status': status}
    assert error.headers == ({'Retry-After': '5'} if code == 'chain_unavailable' else {})


def test_payment_error_retry_after():
    assert mp.payment_error(VerificationError('wait', 'payment_pending', retry_after=4)).headers == {'Retry-After': '4'}
    assert mp.payment_error(ChainUnavailable('down')).headers == {'Retry-After': '5'}
    assert mp.payment_error(ChainUnavailable('down')).status == 503


def test_sync_keeps_the_higher_of_the_stored_and_the_nodes_nonce(market, node):
    onchain, db = market.client.app.service.settings.onchain, db_of(market)
    next_nonce = "SELECT value FROM chain_state WHERE name = 'next_nonce'"
    assert db.value(next_nonce) == NODE_NONCE
    node.nonce = 3                         # the node lags (or forgot what we signed): never go back
    onchain.sync(db)
    assert db.value(next_nonce) == NODE_NONCE
    node.nonce = 12                        # the wallet was used elsewhere: skip ahead
    onchain.sync(db)
    assert db.value(next_nonce) == 12
    release = by_type(approve(market, funded_job(market, node))['payments'], 'release')
    assert stored(market, release['txHash'])['nonce'] == 12
    assert decode(node.sent[-1])['nonce'] == 12


# ----- funding a job -----

def test_a_base_job_without_escrow_tx_hash_gets_402_payment_required(market, node):
    answer = post_job(market)
    body = assert_error(answer, 402, 'payment_required')
    assert body['paymentRequirements'] == {'payTo': ESCROW, 'amount': '25000000', 'asset': USDC,
                                           'network': 'base', 'chainId': 8453}
    assert body['fundingTypedData'] == funding_typed_data(market.requester['id'], None, ESCROW)
    assert post_job(market, paymentAmount='0.01').json['paymentRequirements']['amount'] == '10000'
    assert count_jobs(market) == 0
    assert node.count('eth_getTransactionReceipt') == 0


@pytest.mark.parametrize('bad', ['0x1234', 'a' * 64, '0x' + 'g' * 64, '0x' + 'a' * 65, 12, ['0x' + 'a' * 64], '',
                                 '0x' + 'a' * 64 + '\n'])
def test_a_malformed_escrow_tx_hash_is_400_payment_invalid(market, node, bad):
    body = assert_error(post_job(market, bad), 400, 'payment_invalid', fields=['escrowTxHash'])
    assert body['fundingTypedData'] == funding_typed_data(market.requester['id'], None, ESCROW)
    assert count_jobs(market) == 0
    assert node.count('eth_getTransactionReceipt') == 0


def test_a_good_funding_transfer_opens_the_job(market, node):
    tx_hash = node.pay(25_000_000)
    answer = post_job(market, tx_hash)
    assert answer.status == 201, answer
    job = answer.json['job']
    assert (job['status'], job['escrowStatus'], job['escrowTxHash']) == ('open', 'locked', tx_hash)
    assert (job['paymentAmount'], job['paymentCurrency'], job['paymentRail']) == ('25.00', 'USDC', 'base')
    payments = market.get_job(job)['payments']
    assert len(payments) == 1
    escrow = payments[0]
    assert {k: escrow[k] for k in ('type', 'amount', 'currency', 'rail', 'status', 'recipient', 'txHash')} == {
        'type': 'escrow', 'amount': '25.00', 'currency': 'USDC', 'rail': 'base', 'status': 'confirmed',
        'recipient': ESCROW, 'txHash': tx_hash}
    row = db_of(market).row('SELECT * FROM jobs WHERE id = :id', {'id': job['id']})
    assert row['refund_address'] == PAYER
    used = db_of(market).row('SELECT * FROM used_payments WHERE tx_hash = :hash', {'hash': tx_hash})
    assert (used['chain_id'], used['purpose'], used['job_id'], used['account_id']) == (
        8453, 'escrow', job['id'], market.requester['id'])
    assert mp.ledger_problems(db_of(market)) == []


def test_an_uppercase_hash_is_stored_lowercase(market, node):
    tx_hash = node.pay(25_000_000)
    answer = post_job(market, '0x' + tx_hash[2:].upper())
    assert answer.status == 201, answer
    assert answer.json['job']['escrowTxHash'] == tx_hash


def test_posting_the_same_hash_again_gives_the_same_job_to_its_requester_only(market, node):
    tx_hash = node.pay(25_000_000)
    deadline = in_hours(48)             # the same job again: every field the same
    first = post_job(market, tx_hash, deadline=deadline)
    assert first.status == 201, first
    again = post_job(market, tx_hash, deadline=deadline)
    assert again.status == 200, again
    assert again.json['job']['id'] == first.json['job']['id']
    assert post_job(market, '0x' + tx_hash[2:].upper(), deadline=deadline).json['job']['id'] == first.json['job']['id']
    other, other_key = make_account(market.client, 'other requester')
    body = assert_error(post_job(market, tx_hash, key=other_key, account=other), 409, 'payment_replayed')
    assert body['fundingTypedData'] == funding_typed_data(other['id'], tx_hash, ESCROW)
    again = post_job(market, tx_hash, signer=None, deadline=deadline)              # its requester needs no signature to get it back
    assert (again.status, again.json['job']['id']) == (200, first.json['job']['id'])
    other_job = post_job(market, tx_hash, deadline=deadline, title='Another job')      # not a retry: another job
    assert assert_error(other_job, 409, 'payment_replayed')['jobId'] == first.json['job']['id']
    assert count_jobs(market) == 1
    assert db_of(market).value('SELECT count(*) FROM payments') == 1
    assert node.count('eth_getTransactionReceipt') == 1          # checked on chain once, when it was new


def test_a_hash_that_funded_a_job_cannot_fund_another_one_even_for_another_price(market, node):
    tx_hash = node.pay(50_000_000)
    first = post_job(market, tx_hash, paymentAmount='25.00')
    assert first.status == 201, first
    other, other_key = make_account(market.client, 'other requester')
    assert_error(post_job(market, tx_hash, key=other_key, account=other, paymentAmount='25.00'), 409,
                 'payment_replayed')
    assert count_jobs(market) == 1


def test_a_hash_that_paid_an_x402_call_cannot_fund_a_job(market, node):
    tx_hash = node.pay(25_000_000)
    db_of(market).execute("""INSERT INTO used_payments (chain_id, tx_hash, purpose, account_id, job_id, created_at)
                             VALUES (8453, :hash, 'x402', :account, NULL, :now)""",
                          {'hash': tx_hash, 'account': market.requester['id'], 'now': mp.now_iso()})
    assert_error(post_job(market, tx_hash), 409, 'payment_replayed')
    assert count_jobs(market) == 0
    assert node.count('eth_getTransactionReceipt') == 0


BAD_FUNDING = {
    'wrong token': (dict(token=OTHER_TOKEN), 'payment_wrong_token'),
    'wrong recipient': (dict(to=SOMEONE), 'payment_wrong_recipient'),
    'insufficient': (dict(amount=24_990_000), 'payment_insufficient'),
    'reverted': (dict(status=0), 'payment_reverted'),
    'wrong chain': (dict(chain_id=1), 'payment_wrong_chain'),
    'reorged': (dict(block_hash=block_hash_of(100, fork='orphaned')), 'payment_reorged'),
    'expired': (dict(timestamp=int(time.time()) - 2 * 86400), 'payment_expired'),
}


@pytest.mark.parametrize('case', sorted(BAD_FUNDING))
def test_each_bad_funding_has_its_code_and_creates_no_job(market, node, case):
    overrides, code = BAD_FUNDING[case]
    tx_hash = node.pay(**overrides)
    body = assert_error(post_job(market, tx_hash), 402, code)
    assert 'paymentRequirements' not in body
    assert body['fundingTypedData'] == funding_typed_data(market.requester['id'], tx_hash, ESCROW)
    assert count_jobs(market) == 0
    assert db_of(market).value('SELECT count(*) FROM used_payments') == 0
    assert db_of(market).value('SELECT count(*) FROM payments') == 0


def test_a_transfer_not_yet_deep_enough_is_payment_pending_with_retry_after(market, node):
    tx_hash = node.pay(block=100)
    node.latest = 100                      # its own block counts as one: 1 of 2
    answer = post_job(market, tx_hash)
    assert_error(answer, 402, 'payment_pending')
    assert answer.headers['Retry-After'] == '2'
    assert count_jobs(market) == 0
    node.latest = 101                      # now 2 of 2: the same hash funds the job
    answer = post_job(market, tx_hash)
    assert answer.status == 201, answer
    assert count_jobs(market) == 1


def test_an_unknown_hash_is_payment_not_found(market, node):
    answer = post_job(market, tx_hash_of('never sent'))
    assert_error(answer, 402, 'payment_not_found')
    assert answer.headers['Retry-After'] == '2'
    assert count_jobs(market) == 0


@pytest.mark.parametrize('failure', [requests.exceptions.ConnectionError('refused'),
                                     requests.exceptions.ReadTimeout('timed out')])
def test_a_node_that_is_down_is_503_chain_unavailable_and_no_job(market, node, failure):
    node.calls.clear()
    node.fail = failure
    answer = post_job(market, tx_hash_of('any'))
    body = assert_error(answer, 503, 'chain_unavailable')
    assert body['fundingTypedData'] == funding_typed_data(market.requester['id'], tx_hash_of('any'), ESCROW)
    assert answer.headers['Retry-After'] == '5'
    assert count_jobs(market) == 0
    assert node.methods() == ['eth_getTransactionReceipt']


# ----- the funding signature (CONTRACT.md 18): a hash alone is no proof of whose money it is -----

def assert_refused_unused(market, answer, tx_hash, account=None, status=402, code='payment_signature_invalid'):
    """Refused with fundingTypedData for `account` and the hash; nothing stored, the hash still unused."""
    body = assert_error(answer, status, code)
    assert body['fundingTypedData'] == funding_typed_data((account or market.requester)['id'], tx_hash, ESCROW)
    assert count_jobs(market) == 0
    assert db_of(market).value('SELECT count(*) FROM used_payments') == 0
    assert db_of(market).value('SELECT count(*) FROM payments') == 0
    return body


def test_a_funding_without_a_signature_is_refused_before_the_node_is_asked(market, node):
    tx_hash = node.pay(25_000_000)
    assert_refused_unused(market, post_job(market, tx_hash, signer=None), tx_hash)
    assert node.count('eth_getTransactionReceipt') == 0
    answer = post_job(market, tx_hash)                          # its owner can still post it, signed
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == market.requester['id']


@pytest.mark.parametrize('bad', [None, 12, '', '0x1234', '0x' + 'ab' * 64, '0x' + 'ab' * 66, '0x' + 'zz' * 65,
                                 '0x' + '11' * 64 + '1d', '0x' + '11' * 32 + 'ff' * 32 + '1b', '0x' + '00' * 65])
def test_a_malformed_signature_is_payment_signature_invalid(market, node, bad):
    tx_hash = node.pay(25_000_000)
    body = job_body(escrowTxHash=tx_hash, escrowSignature=bad)
    answer = market.client.post('/api/jobs', body, key=market.requester_key)
    assert_refused_unused(market, answer, tx_hash)


def test_a_signature_by_anyone_but_the_transfers_sender_is_refused(market, node):
    tx_hash = node.pay(25_000_000)                              # sent by PAYER
    assert_refused_unused(market, post_job(market, tx_hash, signer=DEV_KEYS[2]), tx_hash)      # SOMEONE's key
    assert_refused_unused(market, post_job(market, tx_hash, signer=ESCROW_KEY), tx_hash)       # the escrow's
    assert post_job(market, tx_hash).status == 201


def test_a_payers_signature_binds_the_account_it_names(market, node):
    """A stranger who copies the payer's signature for the requester gets nothing: it names another account."""
    tx_hash = node.pay(25_000_000)
    stranger, stranger_key = make_account(market.client, 'stranger')
    signed_for_requester = sign_funding(PAYER_KEY, market.requester['id'], tx_hash, ESCROW)
    answer = market.client.post('/api/jobs', job_body(escrowTxHash=tx_hash, escrowSignature=signed_for_requester),
                                key=stranger_key)
    assert_refused_unused(market, answer, tx_hash, account=stranger)
    answer = post_job(market, tx_hash, account=stranger)        # the requester, with a signature for the stranger
    assert_refused_unused(market, answer, tx_hash)
    for other in (tx_hash_of('another transfer'), '0x' + 'ab' * 32):      # a signature of another hash
        signed = sign_funding(PAYER_KEY, market.requester['id'], other, ESCROW)
        answer = market.client.post('/api/jobs', job_body(escrowTxHash=tx_hash, escrowSignature=signed),
                                    key=market.requester_key)
        assert_refused_unused(market, answer, tx_hash)
    answer = market.client.post('/api/jobs', job_body(escrowTxHash=tx_hash, escrowSignature=signed_for_requester),
                                key=market.requester_key)
    assert answer.status == 201, answer
    assert_error(post_job(market, tx_hash, key=stranger_key, account=stranger), 409, 'payment_replayed')


def test_an_admin_posting_for_someone_signs_for_its_own_account(market, node):
    """`account` is the caller's id: an admin posting on behalf of a requester has the payer sign for the admin."""
    admin_id = db_of(market).value("SELECT id FROM accounts WHERE role = 'admin'")
    tx_hash = node.pay(25_000_000)
    on_behalf = dict(requesterId=market.requester['id'])
    answer = post_job(market, tx_hash, key=ADMIN_KEY, **on_behalf)          # signed for the requester
    assert_refused_unused(market, answer, tx_hash, account={'id': admin_id})
    answer = post_job(market, tx_hash, key=ADMIN_KEY, account={'id': admin_id}, **on_behalf)
    assert answer.status == 201, answer
    assert answer.json['job']['requesterId'] == market.requester['id']


@pytest.mark.parametrize('second_sender', [PAYER, SOMEONE])
def test_a_funding_with_several_transfers_to_escrow_is_payment_invalid(market, node, second_sender):
    """Only one sender can be refunded: a transaction moving USDC to escrow twice is refused, even with a
    valid signature by the first sender."""
    receipt = make_receipt(logs=[transfer_log(USDC, PAYER, ESCROW, 25_000_000),
                                 transfer_log(USDC, second_sender, ESCROW, 25_000_000)],
                           tx_hash=tx_hash_of(f'two transfers from {second_sender}'))
    tx_hash = node.add(receipt)
    assert_refused_unused(market, post_job(market, tx_hash), tx_hash, status=400, code='payment_invalid')


def test_a_funding_with_one_transfer_to_escrow_among_others_is_accepted(market, node):
    receipt = make_receipt(logs=[transfer_log(USDC, PAYER, SOMEONE, 5_000_000),
                                 transfer_log(USDC, PAYER, ESCROW, 25_000_000)], tx_hash=tx_hash_of('one of two'))
    answer = post_job(market, node.add(receipt))
    assert answer.status == 201, answer


def test_funding_answers_follow_the_openapi_document(market, node):
    check = Checker(market.client.get('/api/openapi.json').json)
    tx_hash = node.pay(25_000_000)
    other, other_key = make_account(market.client, 'other requester')
    deadline = in_hours(48)
    answers = [(post_job(market), 402), (post_job(market, '0x1234'), 400),
               (post_job(market, tx_hash, signer=None), 402),
               (post_job(market, tx_hash, deadline=deadline), 201), (post_job(market, tx_hash, deadline=deadline), 200),
               (post_job(market, tx_hash, key=other_key, account=other), 409),
               (post_job(market, tx_hash, title='Another job'), 409)]
    for answer, status in answers:
        assert ('fundingTypedData' in answer.json) is (status >= 400), answer
        check(answer, 'POST', '/api/jobs', status)


# ----- agent wallets are never the service's own -----

@pytest.mark.parametrize('wallet', [ESCROW, ESCROW.lower(), DEV_ADDRESSES[3]])
def test_an_agent_wallet_equal_to_the_escrow_or_x402_address_is_refused(started, node, wallet):
    market = Market(Client(started(x402_pay_to=DEV_ADDRESSES[3])))
    client, key = market.client, market.worker_key
    expected = 'must not be the escrow address of this service' if wallet != DEV_ADDRESSES[3] else \
        'must not be the x402 payTo address of this service'
    body = {'name': 'thief', 'walletAddress': wallet}
    for answer in (client.post('/api/agents', body, key=key), client.post('/api/agents/register', body),
                   client.patch(f'/api/agents/{market.agent["id"]}', {'walletAddress': wallet}, key=key)):
        refused = assert_error(answer, 400, 'validation_failed', fields=['walletAddress'])
        assert refused['fields']['walletAddress'] == expected
    assert db_of(market).value('SELECT count(*) FROM agents') == 1
    assert db_of(market).value('SELECT wallet_address FROM agents') == market.agent['walletAddress']


def test_a_usd_job_on_rail_stripe_is_refused_beside_real_money(market, node):
    """Simulated money does not mix with real money (CONTRACT.md 18): free USD jobs would farm reputation."""
    before = len(node.calls)
    for body in ({'paymentCurrency': 'USD'}, {'paymentCurrency': 'USD', 'paymentRail': 'stripe'}):
        answer = post_job(market, **body)
        error = assert_error(answer, 400, 'rail_unavailable')
        assert 'stripe' in error['error'] and 'base' in error['error']
    assert count_jobs(market) == 0
    assert len(node.calls) == before                   # refused before the node is asked anything


def test_with_allow_simulated_rails_a_usd_job_on_rail_stripe_stays_simulated(started, node):
    market = Market(Client(started(allow_simulated_rails=True)))
    before = len(node.calls)
    answer = post_job(market, paymentCurrency='USD')
    assert answer.status == 201, answer
    job = answer.json['job']
    assert (job['paymentRail'], job['escrowTxHash']) == ('stripe', None)
    payments = market.get_job(job)['payments']
    assert [(p['type'], p['status'], p['txHash']) for p in payments] == [('escrow', 'simulated', None)]
    result = approve(market, job)
    assert [(p['type'], p['amount'], p['status'], p['txHash']) for p in result['payments']] == [
        ('release', '25.00', 'simulated', None)]
    assert len(node.calls) == before                   # the node was never asked
    assert node.sent == []


# ----- payouts -----

def test_an_approval_signs_stores_and_broadcasts_the_release(market, node):
    job = funded_job(market, node)
    result = approve(market, job)
    assert result['job']['status'] == 'completed'
    assert result['escrowStatus'] == 'released'
    release = by_type(result['payments'], 'release')
    wallet = market.agent['walletAddress']
    assert (release['status'], release['amount'], release['currency'], release['rail'], release['recipient']) == (
        'pending', '25.00', 'USDC', 'base', wallet)
    assert TX_HASH.match(release['txHash'])
    assert [p['type'] for p in result['payments']] == ['release']
    assert node.count('eth_sendRawTransaction') == 1
    raw = node.sent[0]
    assert_pays(raw, wallet, 25_000_000, NODE_NONCE)
    row = stored(market, release['txHash'])
    assert (row['raw_tx'], row['nonce'], row['status']) == (raw, NODE_NONCE, 'pending')
    assert row['broadcast_at'] is not None
    assert mp.ledger_problems(db_of(market)) == []


def test_the_operator_fee_stays_in_escrow_as_a_confirmed_record(started, node):
    market = Market(Client(started(fee_percent=Decimal('10'))))
    job = funded_job(market, node)
    result = approve(market, job)
    release, fee = by_type(result['payments'], 'release'), by_type(result['payments'], 'fee')
    assert (release['amount'], release['status']) == ('22.50', 'pending')
    assert (fee['amount'], fee['status'], fee['txHash'], fee['recipient']) == ('2.50', 'confirmed', None, 'operator')
    assert node.count('eth_sendRawTransaction') == 1
    assert_pays(node.sent[0], market.agent['walletAddress'], 22_500_000, NODE_NONCE)
    assert mp.ledger_problems(db_of(market)) == []


def test_nonces_of_successive_payouts_are_consecutive_from_the_nodes_count(market, node):
    first, second = funded_job(market, node), funded_job(market, node, title='Another one')
    hashes = [by_type(approve(market, job)['payments'], 'release')['txHash'] for job in (first, second)]
    assert [stored(market, h)['nonce'] for h in hashes] == [NODE_NONCE, NODE_NONCE + 1]
    assert [decode(raw)['nonce'] for raw in node.sent] == [NODE_NONCE, NODE_NONCE + 1]
    assert db_of(market).value("SELECT value FROM chain_state WHERE name = 'next_nonce'") == NODE_NONCE + 2


def test_overfunding_is_refunded_to_the_payer_when_the_job_completes(market, node):
    job = funded_job(market, node, 30_000_000)
    escrow = market.get_job(job)['payments'][0]
    assert (escrow['type'], escrow['amount']) == ('escrow', '30.00')
    result = approve(market, job)
    release, refund = by_type(result['payments'], 'release'), by_type(result['payments'], 'refund')
    assert (release['amount'], release['status']) == ('25.00', 'pending')
    assert (refund['amount'], refund['status'], refund['recipient']) == ('5.00', 'pending', PAYER)
    assert TX_HASH.match(refund['txHash']) and refund['txHash'] != release['txHash']
    assert len(node.sent) == 2
    assert_pays(node.sent[0], market.agent['walletAddress'], 25_000_000, NODE_NONCE)
    assert_pays(node.sent[1], PAYER, 5_000_000, NODE_NONCE + 1)
    assert result['escrowStatus'] == 'released'
    assert mp.ledger_problems(db_of(market)) == []


def test_a_rejection_refunds_the_funding_transfers_sender(market, node):
    job = funded_job(market, node)
    claim = market.deliver(job, market.claim(job))
    answer = market.verify(job, claim, False)
    assert answer.status == 200, answer
    assert (answer.json['job']['status'], answer.json['escrowStatus']) == ('rejected', 'refunded')
    refund = by_type(answer.json['payments'], 'refund')
    assert (refund['amount'], refund['status'], refund['recipient']) == ('25.00', 'pending', PAYER)
    assert TX_HASH.match(refund['txHash'])
    assert len(answer.json['payments']) == 1
    assert len(node.sent) == 1
    assert_pays(node.sent[0], PAYER, 25_000_000, NODE_NONCE)
    assert stored(market, refund['txHash'])['raw_tx'] == node.sent[0]
    assert mp.ledger_problems(db_of(market)) == []


def test_a_cancelled_job_is_refunded_on_chain(market, node):
    job = funded_job(market, node)
    answer = market.client.post(f'/api/jobs/{job["id"]}/cancel', key=market.requester_key)
    assert answer.status == 200, answer
    refund = by_type(market.get_job(job)['payments'], 'refund')
    assert (refund['amount'], refund['status'], refund['recipient']) == ('25.00', 'pending', PAYER)
    assert_pays(node.sent[0], PAYER, 25_000_000, NODE_NONCE)


def test_a_payout_decided_while_the_node_is_down_is_stored_and_sent_by_the_sweep(market, node):
    job = funded_job(market, node)
    node.fail = requests.exceptions.ConnectionError('down')
    result = approve(market, job)                       # the decision does not wait for the node
    release = by_type(result['payments'], 'release')
    assert (release['status'], TX_HASH.match(release['txHash']) is not None) == ('pending', True)
    row = stored(market, release['txHash'])
    assert row['broadcast_at'] is None and row['raw_tx'].startswith('0x02')
    node.fail = None
    mp.run_sweeps(db_of(market), market.client.app.service.settings)
    assert node.sent[-1] == row['raw_tx']
    assert stored(market, release['txHash'])['broadcast_at'] is not None


# ----- the sweep -----

def sweep(market):
    return mp.run_sweeps(db_of(market), market.client.app.service.settings)['payouts']


def mine(node, tx_hash, status=1, block=101):
    """The node reports the payout mined at `block` (status 1: success, 0: reverted)."""
    node.add(make_receipt(status=status, block=block, tx_hash=tx_hash), frm=ESCROW)


def released(market, node):
    job = funded_job(market, node)
    release = by_type(approve(market, job)['payments'], 'release')
    return job, release


def test_the_sweep_confirms_a_payout_deep_enough(market, node):
    job, release = released(market, node)
    mine(node, release['txHash'], block=101)
    node.latest = 102
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert by_type(market.get_job(job)['payments'], 'release')['status'] == 'confirmed'
    assert stored(market, release['txHash'])['status'] == 'confirmed'
    assert node.count('eth_sendRawTransaction') == 1                       # nothing sent again
    # nothing left to do
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert mp.ledger_problems(db_of(market)) == []


def test_the_sweep_waits_for_enough_confirmations(market, node):
    job, release = released(market, node)
    mine(node, release['txHash'], block=101)
    node.latest = 101                                                        # 1 of 2
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert stored(market, release['txHash'])['status'] == 'pending'
    node.latest = 102
    assert sweep(market) == {'confirmed': 1, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}


def test_the_sweep_does_not_confirm_a_payout_whose_block_was_reorged(market, node):
    job, release = released(market, node)
    node.add(make_receipt(block=101, tx_hash=release['txHash'], block_hash=block_hash_of(101, fork='old')), frm=ESCROW)
    node.latest = 110
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert stored(market, release['txHash'])['status'] == 'pending'


def test_the_sweep_sends_again_what_the_node_does_not_know(market, node):
    job, release = released(market, node)
    raw = node.sent[0]
    # just sent: give the node time
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert node.sent == [raw]
    mp.CLOCK.advance(seconds=31)
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 1, 'repriced': 0, 'renumbered': 0}
    assert node.sent == [raw, raw]                                           # the same signed transaction
    assert '0x' + keccak(HexBytes(node.sent[1])).hex() == release['txHash']   # so the same hash
    assert stored(market, release['txHash'])['status'] == 'pending'
    assert db_of(market).value('SELECT count(*) FROM payments WHERE type = :t', {'t': 'release'}) == 1


def test_a_reverted_payout_is_marked_failed(market, node):
    job, release = released(market, node)
    mine(node, release['txHash'], status=0, block=101)
    node.latest = 102
    assert sweep(market) == {'confirmed': 0, 'failed': 1, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert by_type(market.get_job(job)['payments'], 'release')['status'] == 'failed'
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert mp.ledger_problems(db_of(market)) == []


def test_the_sweep_with_the_node_down_changes_nothing(market, node):
    job, release = released(market, node)
    node.fail = requests.exceptions.ReadTimeout('slow')
    assert sweep(market) == {'confirmed': 0, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    assert stored(market, release['txHash'])['status'] == 'pending'


def test_the_sweep_confirms_release_and_refund_in_nonce_order(market, node):
    job = funded_job(market, node, 30_000_000)
    result = approve(market, job)
    release, refund = by_type(result['payments'], 'release'), by_type(result['payments'], 'refund')
    mine(node, release['txHash'], block=101)
    mine(node, refund['txHash'], block=102)
    node.latest = 103
    assert sweep(market) == {'confirmed': 2, 'failed': 0, 'resent': 0, 'repriced': 0, 'renumbered': 0}
    statuses = {p['type']: p['status'] for p in market.get_job(job)['payments']}
    assert statuses == {'escrow': 'confirmed', 'release': 'confirmed', 'refund': 'confirmed'}
    assert mp.ledger_problems(db_of(market)) == []


def test_the_expiry_sweep_refunds_on_chain_and_sends_the_refund(market, node, real_clock):
    job = funded_job(market, node)
    real_clock.advance(hours=49)                        # past the deadline (48 h)
    result = mp.run_sweeps(db_of(market), market.client.app.service.settings)
    assert result['expire']['jobIds'] == [job['id']]
    refund = by_type(market.get_job(job)['payments'], 'refund')
    assert (refund['amount'], refund['status'], refund['recipient']) == ('25.00', 'pending', PAYER)
    row = stored(market, refund['txHash'])
    assert (row['nonce'], row['broadcast_at'] is not None) == (NODE_NONCE, True)
    assert node.sent and set(node.sent) == {row['raw_tx']}        # sent by this very sweep (only this one)
    assert_pays(row['raw_tx'], PAYER, 25_000_000, NODE_NONCE)
    assert market.get_job(job)['job']['status'] == 'expired'
    assert mp.ledger_problems(db_of(market)) == []


def test_an_agent_in_onchain_mode_is_paid_at_its_wallet(market, node):
    agent, _ = make_agent(market.client, market.worker_key, name='second', walletAddress=SOMEONE)
    job = funded_job(market, node)
    claim = market.deliver(job, market.claim(job, agent=agent))
    answer = market.verify(job, claim, True)
    assert answer.status == 200, answer
    assert by_type(answer.json['payments'], 'release')['recipient'] == SOMEONE
    assert_pays(node.sent[0], SOMEONE, 25_000_000, NODE_NONCE)


def test_a_job_created_in_simulated_mode_never_pays_real_usdc(tmp_path, started, node):
    """A job that locked no USDC (made before --rpc-url was set, e.g. the demo) settles in the ledger only."""
    simulated = wiring.make_app(mp.Settings(db=str(tmp_path / 'onchain.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                        public_url='http://market.test', allow_private_webhooks=True))
    market = Market(Client(simulated))
    job, claim = market.delivered_job(paymentAmount='25.00')
    assert job['paymentRail'] == 'base' and job['escrowTxHash'] is None
    simulated.service.close()
    onchain = Client(started())                          # the same database, now in onchain mode
    answer = onchain.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                          key=market.requester_key)
    assert answer.status == 200, answer
    release = by_type(answer.json['payments'], 'release')
    assert (release['status'], release['txHash']) == ('simulated', None)
    assert node.count('eth_sendRawTransaction') == 0


def test_a_job_funded_on_chain_is_not_settled_without_the_chain(tmp_path, started, node, real_clock):
    """Without --rpc-url the service could only pretend to pay: it refuses (503) and the sweep leaves the job."""
    onchain = started()
    market = Market(Client(onchain))
    job = funded_job(market, node)
    claim = market.deliver(job, market.claim(job))
    other = funded_job(market, node, deadline=mp.iso(mp.now() + timedelta(hours=1)))
    simulated = wiring.make_app(mp.Settings(db=str(tmp_path / 'onchain.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                        public_url='http://market.test', allow_private_webhooks=True))
    try:
        client = Client(simulated)
        answer = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                             key=market.requester_key)
        assert (answer.status, answer.json['code']) == (503, 'chain_unavailable')
        assert answer.headers['Retry-After'] == '60'
        assert client.get(f'/api/jobs/{job["id"]}').json['job']['status'] == 'delivered'
        real_clock.advance(hours=2)
        assert mp.expire_overdue_jobs(simulated.service.db, simulated.service.settings)['expired'] == 0
        assert client.get(f'/api/jobs/{other["id"]}').json['job']['status'] == 'open'
        assert mp.ledger_problems(simulated.service.db) == []
    finally:
        simulated.service.close()


# A person funds a USDC job from the "Post a job" page ---------------------------------

def test_a_person_funds_a_usdc_job_on_the_page_by_pasting_the_hash_and_its_signature(app, node):
    """Issue 23, onchain mode: the page shows the escrow address, the amount and what to sign; the hash and the
    signature pasted into the form open the job through POST /api/jobs's own checks (no wallet in the page: the
    paste path, which is what works without JavaScript)."""
    import json
    from test_pages import Page
    from test_pages_actions import Browser, sign_up
    browser = Browser(app)
    sign_up(browser, 'Grace')
    db = app.service.db
    account_id = db.value("SELECT id FROM accounts WHERE name = 'Grace'")
    form_page = Page(browser.get('/jobs/new'))
    assert form_page.find('span', id='pay-to').text() == ESCROW
    typed = json.loads(form_page.find('pre', id='funding-typed-data').text())
    assert typed == funding_typed_data(account_id, None, ESCROW)
    job = {'title': 'Count the lighthouses', 'description': 'Every one on the coast.', 'category': 'data',
           'paymentAmount': '25.00', 'paymentCurrency': 'USDC', 'deadline': in_hours(48)}
    tx_hash = node.pay(25_000_000)

    refused = browser.submit('/jobs/new', '/jobs/new', **job, escrowTxHash=tx_hash)     # no signature yet
    assert refused.status == 402, refused
    page = Page(refused)
    words = page.find('main').text()
    assert 'escrowSignature' in words, words      # the API's own words (payment_signature_invalid)
    assert page.find('input', name='escrowTxHash').attrs['value'] == tx_hash     # kept as typed
    assert db.value('SELECT count(*) FROM jobs') == 0

    signature = sign_funding(PAYER_KEY, account_id, tx_hash, ESCROW)
    opened = browser.submit('/jobs/new', '/jobs/new', **job, escrowTxHash=tx_hash, escrowSignature=signature)
    assert opened.status == 303, opened
    job_id = db.value('SELECT id FROM jobs')
    assert opened.headers['Location'].endswith(f'/jobs/{job_id}')
    row = db.row('SELECT requester_id, status, escrow_status, escrow_tx_hash FROM jobs WHERE id = :id', {'id': job_id})
    assert row == {'requester_id': account_id, 'status': 'open', 'escrow_status': 'locked', 'escrow_tx_hash': tx_hash}
