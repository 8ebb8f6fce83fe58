"""x402 pay-per-call in the service (CONTRACT.md 7, docs/x402.md "Pay per call: x402"), in-process against anvil.

Settings (--x402-price, --x402-pay-to, MARKETPLACE_X402_PRICE, what refuses to start); the 402 of a priced call;
who pays (every key but admin keys and exempt accounts; an unknown key 401); aliases priced alike; form-1 proofs
of real USDC transfers on anvil, signed by their sender for their call: a good one pays for one call and is
recorded, every refusal has its code and its `checks` entry (on the call and POST /api/x402), pending until deep
enough, a failed call spends nothing and binds its proof to itself, a deposit to escrow never pays a call, and a
transaction hash pays for one thing only (x402 call or job funding).
GET/POST /api/x402, the OpenAPI document and the service card with x402 on.
Form-2 authorizations and their settlement: test_x402_settle.py and test_x402_live.py.
"""

import argparse
import base64
import copy
import json
import time

import pytest
from a2a.client.card_resolver import parse_agent_card
from a2a.utils.proto_utils import validate_proto_required_fields

# web3 and eth_account come through chain.py, which keeps the recursion limit as it was (see there).
from chain import DEV_ADDRESSES, DEV_KEYS, OTHER_TOKEN, USDC, proof_typed_data, sign_funding, sign_proof

import marketplace as mp
import openapi_spec
import pay_per_call
import wiring
from conftest import ADMIN_KEY, Client, assert_error, job_body, make_account
from test_cards import header
from test_openapi import Checker
from test_x402_verifier import header_of, x_payment
from verifier.x402 import PROOF_CHECKS

ESCROW_KEY, ESCROW = DEV_KEYS[1], DEV_ADDRESSES[1]     # the escrow wallet: deposits, and the relayer of settlements
PAY_TO = '0x9965507D1a55bcC2695C58ba16FB37d819B0A4dc'   # --x402-pay-to, x402's payTo (anvil's sixth dev account)
PAYER_KEY, PAYER = DEV_KEYS[2], DEV_ADDRESSES[2]
OTHER_KEY, OTHER = DEV_KEYS[3], DEV_ADDRESSES[3]
SOMEONE = DEV_ADDRESSES[4]
BASE = 'http://market.test'
MATCH = '/api/jobs/match'
PRICE = 10_000                  # 0.01 USDC
MATCH_SUMMARY = openapi_spec.API_OPERATIONS[('GET', '/api/jobs/match')]['summary']
REQUIREMENTS = {'scheme': 'exact', 'network': 'base', 'maxAmountRequired': '10000',
                'resource': BASE + MATCH, 'description': f'GET /api/jobs/match: {MATCH_SUMMARY}',
                'mimeType': 'application/json', 'payTo': PAY_TO, 'maxTimeoutSeconds': 60, 'asset': USDC,
                'extra': {'name': 'USD Coin', 'version': '2'}}
# x402 version 2's PaymentRequirements of the same price (the PAYMENT-REQUIRED header's `accepts`)
REQUIREMENTS_V2 = {'scheme': 'exact', 'network': 'eip155:8453', 'amount': '10000', 'asset': USDC, 'payTo': PAY_TO,
                   'maxTimeoutSeconds': 60, 'extra': {'name': 'USD Coin', 'version': '2'}}
ALL_PASS = {name: True for name in PROOF_CHECKS}
X402_EXTENSION_URI = 'https://github.com/google-a2a/a2a-x402/v0.1'


# Helpers ---------------------------------------------------------------------

@pytest.fixture
def started(tmp_path, usdc, anvil):
    """Builds in-process apps on anvil with x402 on (settings overridable); closes their databases after."""
    apps = []

    def start(**overrides):
        values = dict(db=str(tmp_path / f'x{len(apps)}.db'), rate_limits='off', admin_key=ADMIN_KEY,
                      public_url=BASE, rpc_url=anvil.url, escrow_key=ESCROW_KEY, confirmations=1,
                      x402_price=mp.parse_prices('GET /api/jobs/match=0.01'), x402_pay_to=PAY_TO)
        values.update(overrides)
        apps.append(wiring.make_app(mp.Settings(**values)))
        return Client(apps[-1])
    yield start
    for app in apps:
        app.service.close()


@pytest.fixture
def client(started):
    return started()


def db_of(client):
    return client.app.service.db


def pay(anvil, amount=PRICE, key=PAYER_KEY, to=PAY_TO, token=USDC):
    """Mint `amount` to the wallet of `key`, which sends it to `to`: the transfer's hash (mined)."""
    anvil.mint(DEV_ADDRESSES[DEV_KEYS.index(key)], amount, token=token)
    return anvil.transfer(key, to, amount, token=token)


def proof(tx_hash, network='base', key=PAYER_KEY, call=('GET', MATCH), **claims):
    """X-PAYMENT of a form-1 proof naming `tx_hash` (claims: PAYER pays 0.01 USDC to PAY_TO on Base), signed by
    `key` for `call` (method, path) unless the claims give `signature` (None: left out)."""
    payload = {'txHash': tx_hash, 'from': PAYER, 'amount': '0.01', 'to': PAY_TO, 'chainId': 8453,
               'tokenAddress': USDC, 'timestamp': int(time.time()),
               'signature': sign_proof(key, tx_hash, *call, ESCROW)}
    payload.update(claims)
    if payload['signature'] is None:
        del payload['signature']
    return header_of(x_payment(payload, network))


def paid(client, payment, path=MATCH, key=None):
    return client.get(path, key=key, headers={'X-PAYMENT': payment})


def checked(client, payment, endpoint=None):
    """POST /api/x402 (optionally ?endpoint=): its answer."""
    query = '?endpoint=' + endpoint.replace(' ', '%20') if endpoint else ''
    return client.post('/api/x402' + query, headers={'X-PAYMENT': payment} if payment is not None else None)


def payment_response(answer):
    return json.loads(base64.b64decode(header(answer, 'X-PAYMENT-RESPONSE')))


def count(client, table):
    return db_of(client).value(f'SELECT count(*) FROM {table}')


def assert_nothing_taken(client):
    assert (count(client, 'x402_payments'), count(client, 'used_payments'), count(client, 'wallet_accounts')) == \
        (0, 0, 0)


# Settings --------------------------------------------------------------------

def test_parse_prices_reads_endpoints_path_forms_and_amounts():
    assert mp.parse_prices('GET /api/jobs/match=0.01') == (mp.Price('GET', '/api/jobs/match', 10_000),)
    for path in ('/api/jobs/:id', '/api/jobs/{id}', '/api/jobs/<job_id>',
                 '/api/jobs/3f2504e0-4f89-11d3-9a0c-0305e82c3301'):
        assert mp.parse_prices(f'GET {path}=1.5') == (mp.Price('GET', '/api/jobs/<job_id>', 1_500_000),), path
    two = (mp.Price('GET', '/api/jobs/match', 10_000), mp.Price('GET', '/api/agents/match', 20_000))
    assert mp.parse_prices('GET /api/jobs/match=0.01;GET /api/agents/match=0.02') == two
    assert mp.parse_prices(' GET /api/jobs/match = 0.01 ;\nGET /api/agents/match=0.02; ') == two
    assert mp.parse_prices(['GET /api/jobs/match=0.01', 'GET /api/agents/match=0.02']) == two
    assert mp.parse_prices('get /api/jobs/match=0.01') == two[:1]
    assert mp.parse_prices('POST /api/jobs/:id/claim=2') == (mp.Price('POST', '/api/jobs/<job_id>/claim', 2_000_000),)
    for text, units, usdc in [('0.000001', 1, '0.000001'), ('0.01', 10_000, '0.01'), ('12.5', 12_500_000, '12.5'),
                              ('100', 100_000_000, '100'), ('3.000000', 3_000_000, '3'),
                              ('999999.999999', 999_999_999_999, '999999.999999')]:
        [price] = mp.parse_prices(f'GET /api/jobs/match={text}')
        assert (price.amount, price.usdc) == (units, usdc), text
    assert mp.Price('GET', '/api/jobs/<job_id>', 1).endpoint == 'GET /api/jobs/{job_id}'


@pytest.mark.parametrize('entry, message', [
    ('GET /api/nothing=0.01', 'has no endpoint'),
    ('DELETE /api/jobs/match=0.01', 'has no endpoint'),
    ('GET /api/jobs/match=0', 'above 0'),
    ('GET /api/jobs/match=0.000000', 'above 0'),
    ('GET /api/jobs/match=0.0000001', 'at most 6 decimal places'),
    ('GET /api/jobs/match=-1', 'above 0'),
    ('GET /api/jobs/match=1e-2', 'above 0'),
    ('GET /api/jobs/match', 'METHOD PATH=PRICE'),
    ('GET /api/x402=0.01', 'cannot be priced'),
])
def test_parse_prices_refuses(entry, message):
    with pytest.raises(ValueError, match=message):
        mp.parse_prices(entry)
    with pytest.raises(ValueError, match=message):      # one bad entry among good ones
        mp.parse_prices(['GET /api/agents/match=0.02', entry])


def test_prices_from_the_environment_and_from_a_repeated_flag():
    two = (mp.Price('GET', '/api/jobs/match', 10_000), mp.Price('GET', '/api/agents/match', 20_000))
    environ = {'MARKETPLACE_X402_PRICE': 'GET /api/jobs/match=0.01;GET /api/agents/match=0.02'}
    assert mp.load_settings(environ=environ).x402_price == two
    assert mp.load_settings(environ={}).x402_price == ()
    parser = argparse.ArgumentParser()
    mp.add_setting_flags(parser)
    flags = vars(parser.parse_args(['--x402-price', 'GET /api/jobs/match=0.01',
                                    '--x402-price', 'GET /api/agents/match=0.02']))
    assert flags['x402_price'] == ['GET /api/jobs/match=0.01', 'GET /api/agents/match=0.02']
    assert mp.load_settings(flags, environ={}).x402_price == two
    # the flags win over the environment
    assert mp.load_settings(vars(parser.parse_args(['--x402-price', 'GET /api/agents/match=0.02'])),
                            environ=environ).x402_price == two[1:]
    with pytest.raises(ValueError, match='^MARKETPLACE_X402_PRICE: .*has no endpoint'):
        mp.load_settings(environ={'MARKETPLACE_X402_PRICE': 'GET /api/nothing=1'})
    with pytest.raises(ValueError, match='^--x402-price: .*above 0'):
        mp.load_settings(vars(parser.parse_args(['--x402-price', 'GET /api/jobs/match=0'])), environ={})


def test_x402_without_rpc_url_refuses_to_start(tmp_path):
    settings = mp.Settings(db=str(tmp_path / 'x.db'), x402_price=mp.parse_prices('GET /api/jobs/match=0.01'))
    with pytest.raises(ValueError, match='--x402-price needs --rpc-url'):
        wiring.make_app(settings)


def test_x402_works_on_base_and_base_sepolia_only():
    settings = mp.Settings(chain_id=31337, x402_price=mp.parse_prices('GET /api/jobs/match=0.01'))
    settings.onchain = object()         # X402 reads nothing of it before the chain id
    with pytest.raises(ValueError, match=r'Base \(8453\) and Base Sepolia \(84532\), not on chain 31337'):
        pay_per_call.X402(settings)


def x402_settings(tmp_path, **overrides):
    values = dict(db=str(tmp_path / 'x.db'), rpc_url='http://127.0.0.1:9', escrow_key=ESCROW_KEY,
                  x402_price=mp.parse_prices('GET /api/jobs/match=0.01'), x402_pay_to=PAY_TO)
    return mp.Settings(**dict(values, **overrides))


@pytest.mark.parametrize('pay_to, message', [
    ('', '^--x402-price needs --x402-pay-to: the address x402 payments go to'),
    ('0x1234', "^--x402-pay-to '0x1234' must be 0x followed by 40 hexadecimal digits$"),
    (PAY_TO.replace('a', 'A', 1), 'has an invalid EIP-55 checksum'),
    ('0x' + '0' * 40, '^--x402-pay-to is the zero address'),
    (ESCROW, f'^--x402-pay-to is the escrow address {ESCROW}: x402 payments must go elsewhere'),
    (ESCROW.lower(), f'^--x402-pay-to is the escrow address {ESCROW}'),
])
def test_x402_pay_to_is_required_an_address_and_never_the_escrow_address(tmp_path, pay_to, message):
    with pytest.raises(ValueError, match=message):
        wiring.make_app(x402_settings(tmp_path, x402_pay_to=pay_to))


def test_the_command_line_refuses_a_missing_or_escrow_pay_to_in_one_line(tmp_path):
    from test_cli import cli
    for extra, message in (((), '--x402-price needs --x402-pay-to'),
                           (('--x402-pay-to', ESCROW), '--x402-pay-to is the escrow address')):
        done = cli(tmp_path / 'c.db', 'serve', '--rpc-url', 'http://127.0.0.1:9', '--x402-price',
                   'GET /api/jobs/match=0.01', *extra, env={'MARKETPLACE_ESCROW_KEY': ESCROW_KEY})
        assert done.returncode == 2, done.stderr
        [line] = [line for line in done.stderr.splitlines() if 'error:' in line]
        assert message in line and 'Traceback' not in done.stderr, done.stderr


# The 402, and who pays --------------------------------------------------------

def test_a_priced_call_without_key_or_payment_gets_the_x402_402(client):
    answer = client.get(MATCH + '?categories=code&limit=5')
    assert answer.status == 402, answer
    assert 'X-PAYMENT' in answer.json['error']
    assert answer.json == {'error': answer.json['error'], 'code': 'payment_required', 'status': 402,
                           'x402Version': 1, 'accepts': [REQUIREMENTS],
                           'proofTypedData': proof_typed_data(None, 'GET', MATCH, ESCROW)}
    assert header(answer, 'X-PAYMENT-RESPONSE') is None
    assert_nothing_taken(client)


def test_unpriced_endpoints_answer_as_before(client):
    assert client.get('/api/agents/match?category=code').json == {'matches': [], 'total': 0, 'limit': 50, 'offset': 0}
    assert client.get('/api/jobs/search?q=python').status == 200
    assert client.get('/api/jobs').json['total'] == 0
    assert_error(client.post('/api/jobs', job_body()), 401, 'unauthorized')
    assert client.get('/api/health').json['payments'] == 'onchain'


def test_a_member_key_pays_too_and_its_paid_call_acts_as_its_account(client, anvil):
    account, key = make_account(client, 'member')      # open registration: a key costs nothing
    unpaid = client.get(MATCH + '?categories=code', key=key)
    body = assert_error(unpaid, 402, 'payment_required')
    assert (body['x402Version'], body['accepts']) == (1, [REQUIREMENTS])
    assert 'exempt' in body['error'] and header(unpaid, 'X-PAYMENT-RESPONSE') is None
    assert_nothing_taken(client)

    tx_hash = pay(anvil)
    answer = paid(client, proof(tx_hash), MATCH + '?categories=code', key=key)
    assert (answer.status, answer.json) == (200, {'matches': [], 'total': 0}), answer
    assert payment_response(answer) == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': PAYER,
                                        'paymentSpent': True}
    [row] = db_of(client).rows('SELECT form, payer, tx_hash, account_id, endpoint FROM x402_payments')
    assert row == {'form': 'proof', 'payer': PAYER, 'tx_hash': tx_hash, 'account_id': account['id'],
                   'endpoint': 'GET /api/jobs/match'}
    assert count(client, 'wallet_accounts') == 0
    assert_error(paid(client, proof(tx_hash), key=key), 402, 'payment_replayed')


def test_a_proof_with_a_key_pays_a_call_that_acts_as_the_keys_account(started, anvil):
    """Without a key a proof cannot pay a call that needs an account (it shows no sender); with one, the key says
    who acts, and the proof only pays."""
    client = started(x402_price=mp.parse_prices('POST /api/agents=0.01'))
    account, key = make_account(client, 'member')
    body = {'name': 'paid agent', 'walletAddress': OTHER, 'capabilities': {'categories': ['code']}}
    assert_error(client.post('/api/agents', body, key=key), 402, 'payment_required')
    payment = proof(pay(anvil), call=('POST', '/api/agents'))
    answer = client.post('/api/agents', body, key=key, headers={'X-PAYMENT': payment})
    assert answer.status == 201, answer
    assert answer.json['agent']['accountId'] == account['id']
    assert db_of(client).value('SELECT account_id FROM x402_payments') == account['id']


def test_admin_keys_and_exempt_accounts_call_free_and_take_no_payment(client, anvil):
    payment = proof(pay(anvil))
    answer = paid(client, payment, key=ADMIN_KEY)
    assert (answer.status, answer.json, header(answer, 'X-PAYMENT-RESPONSE')) == \
        (200, {'matches': [], 'total': 0}, None), answer

    account, key = make_account(client, 'partner')
    assert_error(client.get(MATCH, key=key), 402, 'payment_required')
    marked = client.patch(f'/api/accounts/{account["id"]}', {'x402Exempt': True}, key=ADMIN_KEY)
    assert (marked.status, marked.json) == (200, {'account': {'id': account['id'], 'name': 'partner',
                                                              'role': 'member', 'x402Exempt': True}}), marked
    assert mp.account_for_key(db_of(client), key)['x402_exempt'] == 1
    for headers in (None, {'X-PAYMENT': payment}):
        answer = client.get(MATCH, key=key, headers=headers)
        assert (answer.status, header(answer, 'X-PAYMENT-RESPONSE')) == (200, None), answer
    assert_nothing_taken(client)
    assert checked(client, payment).json['valid'] is True      # the payment is still unused

    unmarked = client.patch(f'/api/accounts/{account["id"]}', {'x402Exempt': False}, key=ADMIN_KEY)
    assert unmarked.json['account']['x402Exempt'] is False
    assert_error(client.get(MATCH, key=key), 402, 'payment_required')


def test_only_an_admin_marks_an_account_exempt(client):
    account, key = make_account(client, 'member')
    _, stranger = make_account(client, 'stranger')
    path = f'/api/accounts/{account["id"]}'
    for caller in (key, stranger):          # not even the account itself
        assert_error(client.patch(path, {'x402Exempt': True}, key=caller), 403, 'forbidden')
    assert_error(client.patch(path, {'x402Exempt': True}), 401, 'unauthorized')
    assert_error(client.patch('/api/accounts/3f2504e0-4f89-11d3-9a0c-0305e82c3301', {'x402Exempt': True},
                              key=ADMIN_KEY), 404, 'not_found')
    assert_error(client.patch(path, {'x402Exempt': 'yes'}, key=ADMIN_KEY), 400, 'validation_failed',
                 fields=['x402Exempt'])
    assert_error(client.patch(path, {}, key=ADMIN_KEY), 400, 'validation_failed', fields=['x402Exempt'])
    assert db_of(client).value('SELECT x402_exempt FROM accounts WHERE id = :id', {'id': account['id']}) == 0
    assert_error(client.get(MATCH, key=key), 402, 'payment_required')


def test_every_alias_of_a_priced_operation_is_priced(started):
    """deliver and submit share a handler, as the two agent-card paths do: a price names the operation."""
    client = started(x402_price=mp.parse_prices('POST /api/jobs/:id/submit=0.5; GET /.well-known/agent-card.json=0.01'))
    _, key = make_account(client, 'worker')
    job = '/api/jobs/3f2504e0-4f89-11d3-9a0c-0305e82c3301'
    for method, path, price in (('POST', job + '/deliver', '500000'), ('POST', job + '/submit', '500000'),
                                ('GET', '/.well-known/agent.json', '10000'),
                                ('GET', '/.well-known/agent-card.json', '10000')):
        for caller in (None, key):
            body = assert_error(client.request(method, path, {}, key=caller), 402, 'payment_required')
            assert body['accepts'][0]['maxAmountRequired'] == price and \
                body['accepts'][0]['resource'] == BASE + path, (method, path)
    assert client.post(job + '/deliver', {}, key=ADMIN_KEY).status == 400       # the admin is let through
    listed = {(e['method'], e['path']): e['price'] for e in client.get('/api/x402').json['endpoints']}
    assert listed == {('POST', '/api/jobs/{job_id}/submit'): '0.5', ('POST', '/api/jobs/{job_id}/deliver'): '0.5',
                      ('GET', '/.well-known/agent-card.json'): '0.01', ('GET', '/.well-known/agent.json'): '0.01'}
    paths = client.get('/api/openapi.json').json['paths']
    for path, method in (('/api/jobs/{job_id}/deliver', 'post'), ('/api/jobs/{job_id}/submit', 'post'),
                         ('/.well-known/agent.json', 'get'), ('/.well-known/agent-card.json', 'get')):
        assert 'Priced for x402' in paths[path][method]['description'] and '402' in paths[path][method]['responses']
    assert mp.parse_prices('POST /api/jobs/:id/deliver=1; POST /api/jobs/:id/submit=2') == (
        mp.Price('POST', '/api/jobs/<job_id>/deliver', 2_000_000),
        mp.Price('POST', '/api/jobs/<job_id>/submit', 2_000_000))     # the later entry prices the operation


def test_an_unknown_key_is_401_with_or_without_a_payment(client, anvil):
    payment = proof(pay(anvil))
    assert_error(client.get(MATCH, key='not-a-key-' + 'b' * 32), 401, 'unauthorized')
    answer = paid(client, payment, key='not-a-key-' + 'b' * 32)
    assert_error(answer, 401, 'unauthorized')
    assert 'accepts' not in answer.json and header(answer, 'X-PAYMENT-RESPONSE') is None
    account, key = make_account(client, 'revoked')
    db_of(client).execute('UPDATE api_keys SET revoked_at = :now WHERE account_id = :id',
                          {'now': mp.now_iso(), 'id': account['id']})
    assert_error(paid(client, payment, key=key), 401, 'unauthorized')
    assert_nothing_taken(client)
    assert checked(client, payment).json['valid'] is True


def test_a_node_that_does_not_answer_is_503_for_a_payment_only(started, anvil):
    payment = proof(pay(anvil))
    down = started(rpc_url='http://127.0.0.1:9')        # nothing listens there: refused at once
    assert assert_error(down.get(MATCH), 402, 'payment_required')['accepts'] == [REQUIREMENTS]
    for answer in (paid(down, payment), checked(down, payment)):
        assert_error(answer, 503, 'chain_unavailable')
        assert header(answer, 'Retry-After') == '5'
    assert_nothing_taken(down)


def test_the_command_line_refuses_bad_prices_and_x402_without_a_node(tmp_path):
    from test_cli import cli
    done = cli(tmp_path / 'c.db', 'serve', '--x402-price', 'GET /api/jobs/match=0.01')
    assert done.returncode == 2 and '--x402-price needs --rpc-url' in done.stderr, done.stderr
    done = cli(tmp_path / 'c.db', 'serve', env={'MARKETPLACE_X402_PRICE': 'GET /api/jobs/match=0.01;GET /api/x=1'})
    assert done.returncode == 2, done.stderr
    assert "MARKETPLACE_X402_PRICE: 'GET /api/x=1': the service has no endpoint GET /api/x" in done.stderr


# Form 1: a proof of a transfer already made ------------------------------------

def test_a_good_proof_pays_for_one_call_once(client, anvil):
    tx_hash = pay(anvil)
    payment = proof(tx_hash)
    answer = checked(client, payment, 'GET /api/jobs/match')
    assert answer.status == 200, answer
    assert answer.json == {'valid': True, 'checks': ALL_PASS, 'endpoint': 'GET /api/jobs/match', 'form': 'proof'}
    assert_nothing_taken(client)            # checking takes nothing

    answer = paid(client, payment, MATCH + '?categories=code')
    assert (answer.status, answer.json) == (200, {'matches': [], 'total': 0}), answer
    assert payment_response(answer) == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': PAYER,
                                        'paymentSpent': True}
    [row] = db_of(client).rows('SELECT * FROM x402_payments')
    assert {k: row[k] for k in ('form', 'status', 'amount', 'endpoint', 'payer', 'tx_hash', 'chain_id', 'asset',
                                'account_id')} == {
        'form': 'proof', 'status': 'confirmed', 'amount': PRICE, 'endpoint': 'GET /api/jobs/match', 'payer': PAYER,
        'tx_hash': tx_hash, 'chain_id': 8453, 'asset': USDC, 'account_id': wallet_of(client, PAYER)}
    assert row['granted_at'] is not None                # without a key: the signed proof names its payer
    [used] = db_of(client).rows('SELECT * FROM used_payments')
    assert (used['chain_id'], used['tx_hash'], used['purpose'], used['account_id'], used['job_id']) == \
        (8453, tx_hash, 'x402', None, None)
    assert count(client, 'wallet_accounts') == 1

    again = paid(client, payment)
    body = assert_error(again, 402, 'payment_replayed')
    assert body['checks'] == dict(ALL_PASS, notReplayed=False) and body['paymentSpent'] is True
    assert body['accepts'] == [REQUIREMENTS] and body['x402Version'] == 1
    assert header(again, 'X-PAYMENT-RESPONSE') is None
    answer = checked(client, payment)
    assert answer.json == {'valid': False, 'checks': dict(ALL_PASS, notReplayed=False),
                           'endpoint': 'GET /api/jobs/match', 'form': 'proof',
                           'error': answer.json['error'], 'code': 'payment_replayed'}
    assert count(client, 'x402_payments') == 1


def test_a_signed_proof_without_a_key_acts_as_its_payer_for_the_call_it_signs(started, anvil):
    """A transfer can be copied from the chain, its PaymentProof cannot: signed by the sender for POST /api/agents, a
    proof pays that call as the payer's wallet account; one signed for another call (or by anyone else) pays
    nothing and is still the payer's to use."""
    client = started(x402_price=mp.parse_prices('GET /api/jobs/match=0.01;POST /api/agents=0.01'))
    tx_hash = pay(anvil)
    body = {'name': 'paid agent', 'walletAddress': OTHER, 'capabilities': {'categories': ['code']}}
    for wrong in (proof(tx_hash), proof(tx_hash, key=OTHER_KEY, call=('POST', '/api/agents')),
                  proof(tx_hash, signature=None)):
        answer = client.post('/api/agents', body, headers={'X-PAYMENT': wrong})
        assert answer.status == 402 and answer.json['code'] == 'payment_signature_invalid', answer
        assert answer.json['checks'] == dict(ALL_PASS, signature=False)
        assert count(client, 'agents') == 0
        assert_nothing_taken(client)
    answer = client.post('/api/agents', body, headers={'X-PAYMENT': proof(tx_hash, call=('POST', '/api/agents'))})
    assert answer.status == 201, answer
    assert answer.json['agent']['accountId'] == wallet_of(client, PAYER)
    [row] = db_of(client).rows('SELECT account_id, endpoint FROM x402_payments')
    assert row == {'account_id': wallet_of(client, PAYER), 'endpoint': 'POST /api/agents'}


def wallet_of(client, address):
    return db_of(client).value('SELECT account_id FROM wallet_accounts WHERE address = :a', {'a': address})


# Each case: a function of anvil giving the X-PAYMENT, the code, and the check that fails.
REFUSALS = {
    'transfer short, claimed short': (lambda a: proof(pay(a, 5_000), amount='0.005'), 'payment_insufficient',
                                      'amount'),
    'transfer short, claimed the price': (lambda a: proof(pay(a, 5_000)), 'payment_insufficient', 'amount'),
    'transfer to someone else': (lambda a: proof(pay(a, to=SOMEONE)), 'payment_wrong_recipient', 'recipient'),
    'claims someone else as recipient': (lambda a: proof(pay(a), to=SOMEONE), 'payment_wrong_recipient',
                                         'recipient'),
    'transfer of another token': (lambda a: proof(pay(a, token=OTHER_TOKEN)), 'payment_wrong_token', 'token'),
    'claims another token': (lambda a: proof(pay(a), tokenAddress=OTHER_TOKEN), 'payment_wrong_token', 'token'),
    'claims chain 84532': (lambda a: proof(pay(a), chainId=84532), 'payment_wrong_chain', 'chainId'),
    'network base-sepolia': (lambda a: proof(pay(a), network='base-sepolia'), 'payment_wrong_chain', 'network'),
    'unknown hash': (lambda a: proof('0x' + 'ab' * 32), 'payment_not_found', 'found'),
    'claims another payer': (lambda a: proof(pay(a), **{'from': OTHER}), 'payment_wrong_payer', 'payer'),
    'another wallet paid': (lambda a: proof(pay(a, key=OTHER_KEY)), 'payment_wrong_payer', 'payer'),
}


@pytest.mark.parametrize('case', sorted(REFUSALS))
def test_each_refused_proof_has_its_code_and_check(client, anvil, case):
    make, code, check = REFUSALS[case]
    payment = make(anvil)
    answer = paid(client, payment)
    body = assert_error(answer, 402, code)
    assert body['checks'][check] is False, body['checks']
    assert list(body['checks']) == list(PROOF_CHECKS)
    assert (body['x402Version'], body['accepts']) == (1, [REQUIREMENTS])
    assert header(answer, 'X-PAYMENT-RESPONSE') is None
    verdict = checked(client, payment)
    assert verdict.status == 200, verdict
    assert (verdict.json['valid'], verdict.json['code'], verdict.json['form']) == (False, code, 'proof')
    assert verdict.json['checks'] == body['checks']
    assert_nothing_taken(client)


def test_a_reverted_transfer_is_payment_reverted(client, anvil):
    tx_hash = anvil.transfer(PAYER_KEY, PAY_TO, PRICE, gas=100_000)     # the payer holds no USDC: status 0
    assert anvil.receipt(tx_hash)['status'] == 0
    body = assert_error(paid(client, proof(tx_hash)), 402, 'payment_reverted')
    assert body['checks']['succeeded'] is False and body['checks']['found'] is True
    assert_nothing_taken(client)


def test_a_transfer_older_than_payment_max_age_is_payment_expired(client, anvil, real_clock):
    payment = proof(pay(anvil))
    real_clock.advance(days=2)                  # --payment-max-age is a day
    body = assert_error(paid(client, payment), 402, 'payment_expired')
    assert body['checks'] == dict(ALL_PASS, fresh=False)
    assert_nothing_taken(client)


def test_claims_are_compared_checksummed_and_the_hash_in_any_case(client, anvil):
    tx_hash = pay(anvil)
    payment = proof(tx_hash, **{'from': PAYER.lower(), 'to': PAY_TO.lower(), 'tokenAddress': USDC.lower()})
    answer = paid(client, payment)
    assert answer.status == 200, answer
    assert payment_response(answer) == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': PAYER,
                                        'paymentSpent': True}
    assert_error(paid(client, proof('0x' + tx_hash[2:].upper())), 402, 'payment_replayed')
    assert count(client, 'x402_payments') == 1


def test_a_named_resource_is_compared_by_path(client, anvil):
    payment = proof(pay(anvil), resource='https://elsewhere.example/api/jobs/match?categories=code')
    assert checked(client, payment).json['checks'] == dict(ALL_PASS, resource=True)
    other = proof(pay(anvil), resource=BASE + '/api/agents/match')
    body = assert_error(paid(client, other), 402, 'payment_invalid')
    assert body['checks'] == dict(ALL_PASS, resource=False)
    assert paid(client, payment).status == 200


def test_a_proof_not_deep_enough_is_pending_then_pays(started, anvil):
    client = started(confirmations=2)
    payment = proof(pay(anvil))
    answer = paid(client, payment)
    body = assert_error(answer, 402, 'payment_pending')
    assert header(answer, 'Retry-After') == '2'
    assert body['checks'] == dict(ALL_PASS, confirmations=False)
    assert checked(client, payment).json['code'] == 'payment_pending'
    assert_nothing_taken(client)
    anvil.mine()
    assert checked(client, payment).json['valid'] is True
    answer = paid(client, payment)
    assert answer.status == 200, answer
    assert payment_response(answer)['success'] is True


def test_a_call_that_fails_spends_nothing_and_binds_its_proof_to_itself(client, anvil):
    """A proof taken for a call that answers 400 is not spent; only that same call may send it again (within the
    hour), every other call is refused with payment_replayed and paymentSpent false."""
    payment = proof(pay(anvil))
    answer = paid(client, payment, MATCH + '?min_pay=abc')
    assert_error(answer, 400, 'invalid_parameter', fields=['min_pay'])
    receipt = payment_response(answer)
    assert (receipt['success'], receipt['paymentSpent'], receipt['payer']) == (True, False, PAYER), receipt
    [row] = db_of(client).rows('SELECT granted_at, call_digest FROM x402_payments')
    assert row['granted_at'] is None and len(row['call_digest']) == 64
    assert count(client, 'wallet_accounts') == 1       # the payer's account is kept
    other = paid(client, payment, MATCH + '?min_pay=1')
    body = assert_error(other, 402, 'payment_replayed')
    assert (body['paymentSpent'], body['checks']['notReplayed']) == (False, False), body
    assert header(other, 'X-PAYMENT-RESPONSE') is None
    assert_error(paid(client, payment, MATCH + '?min_pay=abc'), 400, 'invalid_parameter')   # its own call again
    assert db_of(client).value('SELECT granted_at FROM x402_payments') is None


def test_a_proof_taken_before_call_digests_existed_pays_no_call(client, anvil):
    """A payment taken before version 9 has no call digest: if its call never answered below 400, no call may
    spend it now, not even the same one."""
    payment = proof(pay(anvil))
    assert_error(paid(client, payment, MATCH + '?min_pay=abc'), 400, 'invalid_parameter')
    db_of(client).execute('UPDATE x402_payments SET call_digest = NULL')
    for path in (MATCH + '?min_pay=abc', MATCH):
        assert assert_error(paid(client, payment, path), 402, 'payment_replayed')['paymentSpent'] is False
    assert db_of(client).value('SELECT granted_at FROM x402_payments') is None


# A transaction hash pays for one thing only -------------------------------------

def test_a_deposit_to_escrow_never_pays_a_call_and_stays_unused(client, anvil):
    tx_hash = pay(anvil, to=ESCROW)         # a USDC transfer to the escrow wallet: how jobs are funded
    for claimed in (PAY_TO, ESCROW):        # whichever recipient it claims, the chain shows the escrow address
        payment = proof(tx_hash, to=claimed)
        answer = paid(client, payment)
        body = assert_error(answer, 402, 'payment_wrong_recipient')
        failed = [name for name, passed in body['checks'].items() if not passed]
        assert failed == ['recipient', 'payer', 'amount'], claimed     # what follows recipient is not checked
        assert body['accepts'][0]['payTo'] == PAY_TO and header(answer, 'X-PAYMENT-RESPONSE') is None
        assert checked(client, payment).json['code'] == 'payment_wrong_recipient'
    assert_nothing_taken(client)            # unused: it can still fund its owner's job


def test_a_hash_that_funded_a_job_cannot_pay_a_call(client, anvil):
    account, key = make_account(client, 'requester')
    tx_hash = pay(anvil, 25_000_000, to=ESCROW)
    signature = sign_funding(PAYER_KEY, account['id'], tx_hash, ESCROW)
    funded = client.post('/api/jobs', dict(job_body(), escrowTxHash=tx_hash, escrowSignature=signature), key=key)
    assert funded.status == 201, funded
    assert (funded.json['job']['paymentRail'], funded.json['job']['escrowTxHash']) == ('base', tx_hash)
    payment = proof(tx_hash, amount='25')
    body = assert_error(paid(client, payment), 402, 'payment_wrong_recipient')
    assert [name for name, passed in body['checks'].items() if not passed] == \
        ['recipient', 'payer', 'amount', 'notReplayed']
    assert checked(client, payment).json['code'] == 'payment_wrong_recipient'
    assert count(client, 'x402_payments') == 0
    assert db_of(client).value('SELECT purpose FROM used_payments') == 'escrow'


def test_an_x402_proof_cannot_fund_a_job(client, anvil):
    tx_hash = pay(anvil, 25_000_000)
    assert paid(client, proof(tx_hash, amount='25')).status == 200
    account, key = make_account(client, 'requester')
    signature = sign_funding(PAYER_KEY, account['id'], tx_hash, ESCROW)      # the payer's own: still refused
    assert_error(client.post('/api/jobs', dict(job_body(), escrowTxHash=tx_hash, escrowSignature=signature), key=key),
                 409, 'payment_replayed')
    assert count(client, 'jobs') == 0
    assert db_of(client).value('SELECT purpose FROM used_payments') == 'x402'


# GET and POST /api/x402 ---------------------------------------------------------

def test_get_x402_lists_the_priced_endpoints(started):
    client = started(x402_price=mp.parse_prices('GET /api/jobs/match=0.01;GET /api/jobs/:id=1.5'))
    answer = client.get('/api/x402')
    assert answer.status == 200, answer
    job_requirements = dict(REQUIREMENTS, maxAmountRequired='1500000', resource=BASE + '/api/jobs/{job_id}',
                            description='GET /api/jobs/{job_id}: '
                                        + openapi_spec.API_OPERATIONS[('GET', '/api/jobs/<job_id>')]['summary'])
    assert answer.json == {
        'x402Version': 1, 'x402Versions': [1, 2], 'enabled': True, 'network': 'base', 'networkV2': 'eip155:8453',
        'chainId': 8453, 'asset': USDC, 'payTo': PAY_TO, 'settlement': 'relayer',
        'endpoints': [
            {'method': 'GET', 'path': '/api/jobs/match', 'price': '0.01', 'currency': 'USDC',
             'maxAmountRequired': '10000', 'networks': ['base', 'eip155:8453'], 'accepts': [REQUIREMENTS],
             'acceptsV2': [REQUIREMENTS_V2]},
            {'method': 'GET', 'path': '/api/jobs/{job_id}', 'price': '1.5', 'currency': 'USDC',
             'maxAmountRequired': '1500000', 'networks': ['base', 'eip155:8453'], 'accepts': [job_requirements],
             'acceptsV2': [dict(REQUIREMENTS_V2, amount='1500000')]}]}


def test_post_x402_endpoint_picks_the_price(started, anvil):
    client = started(x402_price=mp.parse_prices('GET /api/jobs/match=0.01;GET /api/agents/match=0.02'))
    payment = proof(pay(anvil))
    for endpoint in (None, 'GET /api/jobs/match', 'get /api/jobs/match'):
        answer = checked(client, payment, endpoint)
        assert answer.json == {'valid': True, 'checks': ALL_PASS, 'endpoint': 'GET /api/jobs/match',
                               'form': 'proof'}, endpoint
    answer = checked(client, payment, 'GET /api/agents/match')
    assert answer.status == 200, answer
    assert (answer.json['valid'], answer.json['code'], answer.json['endpoint']) == \
        (False, 'payment_insufficient', 'GET /api/agents/match')
    assert answer.json['checks'] == dict(ALL_PASS, amount=False, signature=False)    # signed for GET /api/jobs/match
    assert_error(paid(client, payment, '/api/agents/match?category=code'), 402, 'payment_insufficient')
    assert paid(client, payment).status == 200      # the cheaper endpoint
    assert count(client, 'x402_payments') == 1


def test_post_x402_with_a_template_endpoint(started, anvil):
    client = started(x402_price=mp.parse_prices('GET /api/jobs/:id=0.01'))
    job = '/api/jobs/3f2504e0-4f89-11d3-9a0c-0305e82c3301'
    payment = proof(pay(anvil), call=('GET', job))
    for endpoint in ('GET /api/jobs/{job_id}', 'GET /api/jobs/:id', 'GET ' + job):
        answer = checked(client, payment, endpoint)
        # a proof's signature names a concrete path: only that one checks it
        assert (answer.json['valid'], answer.json['endpoint'], answer.json['checks']['signature']) == \
            (endpoint.endswith(job), 'GET /api/jobs/{job_id}', endpoint.endswith(job)), endpoint


def test_post_x402_refusals(client):
    assert_error(checked(client, 'e30=', 'GET /api/agents/match'), 404, 'not_priced')
    assert_error(checked(client, 'e30=', 'GET /api/nothing'), 404, 'not_priced')
    assert_error(checked(client, None), 400, 'payment_invalid')
    assert_error(checked(client, None, 'GET /api/jobs/match'), 400, 'payment_invalid')
    for garbage in ('not base64!', 'e30=', base64.b64encode(b'[1, 2]').decode(), base64.b64encode(b'{"x":').decode()):
        answer = checked(client, garbage)
        assert answer.status == 200, answer
        assert answer.json == {'valid': False, 'checks': {'decoded': False}, 'endpoint': 'GET /api/jobs/match',
                               'form': None, 'error': answer.json['error'], 'code': 'payment_invalid'}, garbage
        body = assert_error(paid(client, garbage), 402, 'payment_invalid')
        assert body['checks'] == {'decoded': False}
    assert_nothing_taken(client)


def test_x402_off_lists_nothing(app):
    """(`app` is conftest's: simulated payments, nothing priced.)"""
    client = Client(app)
    assert client.get('/api/x402').json == {'x402Version': 1, 'enabled': False, 'endpoints': []}
    assert_error(checked(client, 'e30='), 404, 'not_priced')
    assert client.get(MATCH).json == {'matches': [], 'total': 0}


# The OpenAPI document and the service card ---------------------------------------

def test_the_openapi_document_marks_priced_operations_and_the_answers_match_it(client, anvil):
    document = client.get('/api/openapi.json').json
    operation = document['paths']['/api/jobs/match']['get']
    assert [(p['name'], p['in'], p['schema']) for p in operation['parameters'][-2:]] == \
        [('X-PAYMENT', 'header', {'type': 'string'}), ('PAYMENT-SIGNATURE', 'header', {'type': 'string'})]
    assert operation['responses']['402']['content'] == \
        {'application/json': {'schema': {'$ref': '#/components/schemas/Error'}}}
    assert operation['responses']['402']['headers']['PAYMENT-REQUIRED'] == \
        {'$ref': '#/components/headers/PAYMENT-REQUIRED'}
    for name in ('X-PAYMENT-RESPONSE', 'PAYMENT-RESPONSE'):
        assert operation['responses']['200']['headers'][name] == {'$ref': f'#/components/headers/{name}'}
    assert set(document['components']['headers']) >= {'X-PAYMENT-RESPONSE', 'PAYMENT-RESPONSE', 'PAYMENT-REQUIRED'}
    assert operation['security'] == [{}, {'bearerAuth': []}]
    assert 'Priced for x402: 0.01 USDC a call' in operation['description']
    unpriced = document['paths']['/api/agents/match']['get']
    assert not {'X-PAYMENT', 'PAYMENT-SIGNATURE'} & {p['name'] for p in unpriced['parameters']}
    assert '402' not in unpriced['responses']

    check = Checker(document)
    check(client.get(MATCH), 'GET', MATCH, 402)
    payment = proof(pay(anvil))
    check(checked(client, payment), 'POST', '/api/x402', 200)
    check(checked(client, 'garbage'), 'POST', '/api/x402', 200)
    check(checked(client, None), 'POST', '/api/x402', 400)
    check(checked(client, payment, 'GET /api/agents/match'), 'POST', '/api/x402', 404)
    check(client.get('/api/x402'), 'GET', '/api/x402', 200)
    check(paid(client, payment), 'GET', MATCH, 200)
    check(paid(client, payment), 'GET', MATCH, 402)       # replayed: with checks


def test_the_service_card_advertises_x402(client):
    answer = client.get('/.well-known/agent-card.json')
    assert answer.status == 200, answer
    card = answer.json
    [extension] = card['capabilities']['extensions']
    assert extension['uri'] == X402_EXTENSION_URI and extension['required'] is False
    assert 'x402' in extension['description']
    assert extension['params'] == {'x402Versions': [1, 2], 'scheme': 'exact', 'network': 'base',
                                   'networkV2': 'eip155:8453', 'chainId': 8453, 'asset': USDC, 'payTo': PAY_TO,
                                   'endpoints': ['GET /api/jobs/match'], 'pricing': BASE + '/api/x402'}
    parsed = parse_agent_card(copy.deepcopy(card))
    validate_proto_required_fields(parsed)
    [parsed_extension] = parsed.capabilities.extensions
    assert (parsed_extension.uri, parsed_extension.required) == (X402_EXTENSION_URI, False)
    assert client.get('/.well-known/agent.json').json == card


def test_the_service_card_without_x402_has_no_extensions(app):
    card = Client(app).get('/.well-known/agent-card.json').json
    assert card['capabilities'] == {'streaming': True, 'pushNotifications': True}
    assert 'x402' not in card['description']
    validate_proto_required_fields(parse_agent_card(copy.deepcopy(card)))


# Defects these tests found, now fixed ------------------------------------------------

def test_priced_operations_document_their_401_and_503(client, started, anvil):
    """A priced operation documents 401 (an unknown or revoked key, even with a payment) and 503
    (chain_unavailable when the node cannot check the payment), not only 402."""
    check = Checker(client.get('/api/openapi.json').json)
    payment = proof(pay(anvil))
    down = started(rpc_url='http://127.0.0.1:9')
    check(paid(client, payment, key='not-a-key-' + 'b' * 32), 'GET', MATCH, 401)
    check(paid(down, payment), 'GET', MATCH, 503)


def test_checks_of_a_payment_naming_its_resource_answer_as_documented(client, anvil):
    """The `resource` check (made when a payment names its resource) is one the document's X402Checks lists."""
    check = Checker(client.get('/api/openapi.json').json)
    check(checked(client, proof(pay(anvil), resource=BASE + MATCH)), 'POST', '/api/x402', 200)
    check(paid(client, proof(pay(anvil), resource=BASE + '/api/agents/match')), 'GET', MATCH, 402)


def test_a_head_of_a_priced_endpoint_is_not_free(client):
    """Bottle answers HEAD with the GET route: a HEAD of a priced endpoint is priced like its GET."""
    answer = client.request('HEAD', MATCH)
    assert answer.status == 402, answer


def test_a_paid_call_whose_commit_fails_is_503_and_its_retry_is_answered_once(client, anvil, monkeypatch):
    """The proof is taken (its own commit), then the COMMIT of the call that spends it fails: 503, nothing spent,
    and the same call sending it again is answered once; after that it is spent."""
    _, key = make_account(client, 'member')
    payment = proof(pay(anvil))
    commit, commits = mp.Database.durable_commit, []

    def failing_second(db):
        commits.append(1)
        return (RuntimeError('disk full'), None) if len(commits) == 2 else commit(db)
    monkeypatch.setattr(mp.Database, 'durable_commit', failing_second)
    answer = paid(client, payment, MATCH + '?categories=code', key=key)
    assert_error(answer, 503, 'commit_failed')
    assert payment_response(answer)['paymentSpent'] is False
    assert db_of(client).value('SELECT granted_at FROM x402_payments') is None
    answer = paid(client, payment, MATCH + '?categories=code', key=key)
    assert (answer.status, payment_response(answer)['paymentSpent']) == (200, True), answer
    again = paid(client, payment, MATCH + '?categories=code', key=key)
    assert assert_error(again, 402, 'payment_replayed')['paymentSpent'] is True
    assert len(commits) == 3        # the proof taken, the failed call, its retry: the refusal commits nothing


def test_a_paid_call_with_an_idempotency_key_whose_commit_fails_claims_no_spent_payment(started, anvil, monkeypatch):
    """With an Idempotency-Key the payment is spent in the COMMIT that stores the answer: when that COMMIT fails the
    503 carries no receipt saying it was spent, and the retry is answered (and stored) once."""
    client = started(x402_price=mp.parse_prices('POST /api/agents=0.01'))
    _, key = make_account(client, 'member')
    payment = proof(pay(anvil), call=('POST', '/api/agents'))
    body = {'name': 'paid agent', 'walletAddress': OTHER, 'capabilities': {'categories': ['code']}}
    commit, commits = mp.Database.durable_commit, []

    def failing_second(db):
        commits.append(1)
        return (RuntimeError('disk full'), None) if len(commits) == 2 else commit(db)
    monkeypatch.setattr(mp.Database, 'durable_commit', failing_second)
    headers = {'X-PAYMENT': payment, 'Idempotency-Key': 'paid-once'}
    answer = client.post('/api/agents', body, key=key, headers=headers)
    assert_error(answer, 503, 'commit_failed')
    assert header(answer, 'X-PAYMENT-RESPONSE') is None
    assert (count(client, 'agents'), db_of(client).value('SELECT granted_at FROM x402_payments')) == (0, None)
    answer = client.post('/api/agents', body, key=key, headers=headers)
    assert (answer.status, payment_response(answer)['paymentSpent']) == (201, True), answer
    again = client.post('/api/agents', body, key=key, headers=headers)
    assert (again.status, header(again, 'Idempotent-Replayed'), again.json) == (201, 'true', answer.json)
    assert count(client, 'agents') == 1
