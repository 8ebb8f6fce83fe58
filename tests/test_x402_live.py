"""x402 pay-per-call end to end (CONTRACT.md 7, docs/x402.md "Pay per call: x402"): the real server as a process in
onchain mode on anvil (tests/chain.py), paid by the official x402 client (x402[evm,requests]), by docs/x402.md's
own python and sh blocks, and by form-1 proofs of real transfers; concurrent payers racing one payment; the
settings through the environment and the command line; and a crash between storing a settlement and sending it
(the JSON-RPC proxy of test_onchain.py holding eth_sendRawTransaction).

The escrow wallet (the relayer of settlements, paying their gas) is DEV_ADDRESSES[1]; the USDC goes to the x402
address (--x402-pay-to, test_x402.PAY_TO); payers are DEV_KEYS[2..]. Every
test uses the `usdc` fixture, so the chain is put back as it was after it. Only 127.0.0.1.
"""

import base64
import json
import os
import re
import sqlite3
import subprocess
import sys
import threading
import time

import requests

from chain import DEV_ADDRESSES, DEV_KEYS, USDC, Account, sign_authorization, sign_proof  # web3/eth-account only through chain.py
from conftest import ADMIN_KEY, ROOT, LiveServer
from test_onchain import RPCProxy, nonce_of, running
from test_x402 import PAY_TO     # --x402-pay-to: where the USDC goes
from test_x402_verifier import header_of, x_payment

_RECURSION_LIMIT = sys.getrecursionlimit()     # importing x402 may raise it (see chain.py): put it back
from x402 import x402ClientSync  # noqa: E402
from x402.http.clients import x402_requests  # noqa: E402
from x402.http.utils import decode_payment_required_header, decode_payment_response_header  # noqa: E402
from x402.mechanisms.evm.exact.register import register_exact_evm_client  # noqa: E402
sys.setrecursionlimit(_RECURSION_LIMIT)

TIMEOUT = 20                # seconds for any one HTTP call: only to avoid hanging, never asserted
ESCROW_KEY, ESCROW = DEV_KEYS[1], DEV_ADDRESSES[1]     # relays the settlements and pays their gas
PRICE = 10_000              # 0.01 USDC in base units
MATCH = '/api/jobs/match?categories=code'
X402_DOC = (ROOT / 'docs' / 'x402.md').read_text()
PYTHON = str(ROOT / '.venv' / 'bin' / 'python')
MATCH_PRICE = ('--x402-price', 'GET /api/jobs/match=0.01')


# Helpers ---------------------------------------------------------------------

def x402_args(rpc_url, *extra, price=MATCH_PRICE):
    # --allow-simulated-rails: open_code_job posts a USD job (simulated) beside real USDC
    return ['--rpc-url', rpc_url, '--chain-id', '8453', '--confirmations', '1', '--rate-limits', 'off',
            '--allow-simulated-rails', '--x402-pay-to', PAY_TO, *price, *extra]


def serving(db, rpc_url, *extra, price=MATCH_PRICE, env=None):
    """The server in onchain mode with GET /api/jobs/match priced at 0.01 USDC; killed afterwards."""
    return running(LiveServer(db, x402_args(rpc_url, *extra, price=price),
                              env=dict({'MARKETPLACE_ESCROW_KEY': ESCROW_KEY}, **(env or {}))))


def funded(anvil, index, amount=1_000_000):
    """Dev account `index` with `amount` USDC base units minted: (key, address)."""
    anvil.mint(DEV_ADDRESSES[index], amount)
    return DEV_KEYS[index], DEV_ADDRESSES[index]


def balances(anvil, *addresses):
    return tuple(anvil.balance(address) for address in addresses)


def open_code_job(server):
    """A USD job in category code (no chain needed) and the match answer the admin gets, free."""
    account = requests.post(server.url + '/api/accounts', json={'name': 'requester'}, timeout=TIMEOUT)
    assert account.status_code == 201, account.text
    key = account.json()['apiKey']
    job = requests.post(server.url + '/api/jobs', headers={'Authorization': f'Bearer {key}'}, timeout=TIMEOUT,
                        json={'title': 'Fix the flaky test', 'description': 'It fails one run in ten.',
                              'category': 'code', 'paymentAmount': '25.00', 'paymentCurrency': 'USD',
                              'deadline': '2099-01-01T00:00:00Z'})
    assert job.status_code == 201, job.text
    free = requests.get(server.url + MATCH, headers={'Authorization': f'Bearer {ADMIN_KEY}'}, timeout=TIMEOUT)
    assert free.status_code == 200, free.text
    assert 'X-PAYMENT-RESPONSE' not in free.headers
    assert free.json()['total'] == 1 and free.json()['matches'][0]['id'] == job.json()['job']['id'], free.text
    return free.json()


def x402_session(key):
    """A requests.Session that pays 402s with the official x402 client, signing with `key`."""
    return x402_requests(register_exact_evm_client(x402ClientSync(), Account.from_key(key)))


def paid_get(server, header):
    return requests.get(server.url + MATCH, headers={'X-PAYMENT': header}, timeout=TIMEOUT)


def payment_response(answer):
    """The decoded X-PAYMENT-RESPONSE header of a paid answer."""
    return json.loads(base64.b64decode(answer.headers['X-PAYMENT-RESPONSE'], validate=True))


def assert_settled_by_escrow(anvil, tx_hash):
    """A mined, successful call of the USDC contract sent by the escrow wallet (the relayer)."""
    transaction, receipt = anvil.w3.eth.get_transaction(tx_hash), anvil.receipt(tx_hash)
    assert (transaction['from'], transaction['to'], receipt['status']) == (ESCROW, USDC, 1), (transaction, receipt)


def assert_x402_refused(answer, code, status=402):
    """The 402 of a priced call (x402 body plus this service's code); the body."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert (body['status'], body['code'], body['x402Version']) == (status, code, 1), body
    assert isinstance(body['error'], str) and body['error'].strip(), body
    [accepts] = body['accepts']
    assert (accepts['payTo'], accepts['asset'], accepts['maxAmountRequired'], accepts['network']) == \
        (PAY_TO, USDC, str(PRICE), 'base'), accepts
    return body


def proof_header(anvil, tx_hash, payer, key):
    """A form-1 X-PAYMENT as docs/x402.md builds it (printf of the JSON | base64 -w0) for a transfer made, with the
    sender's PaymentProof signature for GET /api/jobs/match."""
    timestamp = anvil.w3.eth.get_block(anvil.receipt(tx_hash)['blockNumber'])['timestamp']
    text = ('{"x402Version":1,"scheme":"exact","network":"base","payload":{"txHash":"%s",\n"from":"%s",'
            '"amount":"0.01","to":"%s","chainId":8453,\n"tokenAddress":"%s","timestamp":%d,"signature":"%s"}}'
            % (tx_hash, payer, PAY_TO, USDC, timestamp, sign_proof(key, tx_hash, 'GET', '/api/jobs/match', ESCROW)))
    return base64.b64encode(text.encode()).decode()


def authorization_header(anvil, key, value=PRICE):
    """A form-2 X-PAYMENT: an EIP-3009 authorization of `value` to the x402 address, valid for an hour on the
    server's clock and the chain's alike (Anvil.window)."""
    return header_of(x_payment(sign_authorization(key, PAY_TO, value, *anvil.window(ahead=3600))))


def at_once(count, call):
    """`call()` from `count` threads released together; their answers (or exceptions)."""
    barrier, answers = threading.Barrier(count), [None] * count

    def run(index):
        barrier.wait()
        try:
            answers[index] = call()
        except Exception as exc:        # noqa: BLE001 (shown by the assertion that follows)
            answers[index] = exc
    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT + 10)
    return answers


def outcomes(answers):
    """(status, code) of each answer, sorted: 200s first."""
    assert all(isinstance(a, requests.Response) for a in answers), answers
    return sorted((a.status_code, a.json().get('code') if a.status_code != 200 else None) for a in answers)


def unanswered(server, header):
    """A paid call whose server is killed under it (its connection error is expected)."""
    try:
        paid_get(server, header)
    except requests.RequestException:
        pass


def refused_start(tmp_path, args, env=None):
    """`marketplace.py serve` that must refuse to start: (exit code, output, seconds)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith('MARKETPLACE_')}
    environ.update(MARKETPLACE_ESCROW_KEY=ESCROW_KEY, **(env or {}))
    started = time.monotonic()
    run = subprocess.run([sys.executable, str(ROOT / 'marketplace.py'), 'serve', '--db', str(tmp_path / 'm.db'),
                          '--port', '0', *args], capture_output=True, text=True, timeout=30, env=environ, cwd=ROOT)
    return run.returncode, run.stdout + run.stderr, time.monotonic() - started


def x402_rows(db):
    """The rows of x402_payments (the server may be running: a plain reader)."""
    connection = sqlite3.connect(str(db), timeout=5)
    connection.row_factory = sqlite3.Row
    try:
        return [dict(row) for row in connection.execute('SELECT * FROM x402_payments ORDER BY seq')]
    finally:
        connection.close()


def wait_until(done, seconds=10, message='condition'):
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f'{message}: not within {seconds} s'
        time.sleep(0.05)


def readme_x402_blocks(language):
    """The ```language blocks of docs/x402.md's section "## Pay per call: x402"."""
    section = X402_DOC.split('\n## Pay per call: x402\n')[1].split('\n## ')[0]
    return re.findall(rf'^```{language}\n(.*?)^```$', section, re.MULTILINE | re.DOTALL)


def readme_proof_checks():
    """The answer of POST /api/x402 to a good proof, as docs/x402.md's form-1 block shows it."""
    [block] = [b for b in readme_x402_blocks('sh') if '"txHash"' in b]
    shown = block.split('# → 200 ')[1].split('(checked, not taken)')[0]
    return json.loads(' '.join(line.lstrip('#').strip() for line in shown.splitlines()))


# 1. The official x402 client ------------------------------------------------------

def test_the_official_client_pays_in_version_2_and_a_replayed_header_is_refused(anvil, usdc, tmp_path):
    payer_key, payer = funded(anvil, 2)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        expected = open_code_job(server)
        refusal = requests.get(server.url + MATCH, timeout=TIMEOUT)
        unpaid = assert_x402_refused(refusal, 'payment_required')
        [accepts] = unpaid['accepts']       # what docs/x402.md shows a version 1 client is offered
        assert accepts == {'scheme': 'exact', 'network': 'base', 'maxAmountRequired': '10000',
                           'resource': server.url + '/api/jobs/match', 'description': accepts['description'],
                           'mimeType': 'application/json', 'payTo': PAY_TO, 'maxTimeoutSeconds': 60, 'asset': USDC,
                           'extra': {'name': 'USD Coin', 'version': '2'}}
        assert accepts['description'].startswith('GET /api/jobs/match: '), accepts
        offered = decode_payment_required_header(refusal.headers['PAYMENT-REQUIRED'])     # and a version 2 one
        assert (offered.x402_version, offered.error, offered.resource.url) == \
            (2, unpaid['error'], server.url + '/api/jobs/match')
        assert [a.model_dump(by_alias=True) for a in offered.accepts] == [
            {'scheme': 'exact', 'network': 'eip155:8453', 'amount': '10000', 'asset': USDC, 'payTo': PAY_TO,
             'maxTimeoutSeconds': 60, 'extra': {'name': 'USD Coin', 'version': '2'}}]
        session = x402_session(payer_key)
        before = balances(anvil, payer, PAY_TO)

        answer = session.get(server.url + MATCH, timeout=TIMEOUT)
        assert answer.status_code == 200, answer.text
        assert answer.json() == expected
        assert 'X-PAYMENT' not in answer.request.headers and 'X-PAYMENT-RESPONSE' not in answer.headers
        receipt = decode_payment_response_header(answer.headers['PAYMENT-RESPONSE'])      # the client's own reader
        settled = receipt.model_dump(by_alias=True, exclude_none=True)
        assert set(settled) == {'success', 'transaction', 'network', 'payer'}, settled
        assert (settled['success'], settled['network'], settled['payer']) == (True, 'eip155:8453', payer), settled
        assert_settled_by_escrow(anvil, settled['transaction'])
        assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)

        sent = answer.request.headers['PAYMENT-SIGNATURE']      # what the client paid with (the adapter's retry)
        signed = json.loads(base64.b64decode(sent))
        assert (signed['x402Version'], signed['accepted']['network']) == (2, 'eip155:8453')
        assert signed['payload']['authorization']['from'] == payer
        replay = requests.get(server.url + MATCH, headers={'PAYMENT-SIGNATURE': sent}, timeout=TIMEOUT)
        replayed = assert_x402_refused(replay, 'payment_replayed')
        assert (replayed['checks']['notReplayed'], replayed['checks']['accepted']) == (False, True), replayed
        assert 'PAYMENT-RESPONSE' not in replay.headers and 'PAYMENT-REQUIRED' in replay.headers
        assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)

        again = session.get(server.url + MATCH, timeout=TIMEOUT)
        assert again.status_code == 200, again.text
        assert again.json() == expected
        second = decode_payment_response_header(again.headers['PAYMENT-RESPONSE']).model_dump(exclude_none=True)
        assert (second['success'], second['payer']) == (True, payer), second
        assert second['transaction'] != settled['transaction']
        assert_settled_by_escrow(anvil, second['transaction'])
        assert balances(anvil, payer, PAY_TO) == (before[0] - 2 * PRICE, before[1] + 2 * PRICE)
        rows = x402_rows(server.db)
        assert [(r['form'], r['payer'], r['amount'], r['status'], r['tx_hash']) for r in rows] == \
            [('authorization', payer, PRICE, 'confirmed', settled['transaction']),
             ('authorization', payer, PRICE, 'confirmed', second['transaction'])]


# 2. The doc's blocks, as written --------------------------------------------------

def test_the_readme_python_block_pays_with_the_official_client(anvil, usdc, tmp_path):
    [script] = [b for b in readme_x402_blocks('python') if 'x402_requests' in b]
    payer_key, payer = funded(anvil, 3)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        expected = open_code_job(server)
        before = balances(anvil, payer, PAY_TO)
        run = subprocess.run([PYTHON, '-c', script], capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env=dict(os.environ, MARKET_URL=server.url, PAYER_KEY=payer_key))
        assert run.returncode == 0, run.stderr
        status_line, receipt = run.stdout.splitlines()
        assert status_line == f'200 {expected["total"]}' == '200 1'
        settled = json.loads(receipt)           # PAYMENT-RESPONSE, decoded by the SDK's own helper
        assert (settled['success'], settled['network'], settled['payer']) == (True, 'eip155:8453', payer), settled
        assert_settled_by_escrow(anvil, settled['transaction'])
        assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)


def test_the_readme_form2_sh_block_pays_with_curl(anvil, usdc, tmp_path):
    [script] = [b for b in readme_x402_blocks('sh') if "<<'PY'" in b and 'TransferWithAuthorization' in b]
    assert script.count('http://127.0.0.1:8080') == 1
    payer_key, payer = funded(anvil, 4)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        expected = open_code_job(server)
        before = balances(anvil, payer, PAY_TO)
        run = subprocess.run(['bash', '-euo', 'pipefail', '-c', script.replace('http://127.0.0.1:8080', server.url)],
                             capture_output=True, text=True, timeout=60, cwd=ROOT,
                             env=dict(os.environ, PAYER_KEY=payer_key, PAY_TO=PAY_TO))
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == expected
        assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)
        [row] = x402_rows(server.db)
        assert (row['form'], row['payer'], row['amount'], row['status']) == ('authorization', payer, PRICE, 'confirmed')
        assert_settled_by_escrow(anvil, row['tx_hash'])


def test_the_readme_form1_flow_a_proof_checks_pays_once(anvil, usdc, tmp_path):
    payer_key, payer = funded(anvil, 2)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        expected = open_code_job(server)
        tx_hash = anvil.transfer(payer_key, PAY_TO, PRICE)
        header = proof_header(anvil, tx_hash, payer, payer_key)
        after_transfer = balances(anvil, payer, PAY_TO)

        checked = requests.post(server.url + '/api/x402?endpoint=GET%20/api/jobs/match',
                                headers={'X-PAYMENT': header}, timeout=TIMEOUT)
        assert checked.status_code == 200, checked.text
        assert checked.json() == readme_proof_checks()
        assert checked.json()['valid'] is True and checked.json()['form'] == 'proof'     # docs/x402.md's dict is that
        assert x402_rows(server.db) == []                                                 # checked, not taken

        paid = paid_get(server, header)
        assert paid.status_code == 200, paid.text
        assert paid.json() == expected
        assert payment_response(paid) == {'success': True, 'transaction': tx_hash, 'network': 'base', 'payer': payer,
                                          'paymentSpent': True}

        replayed = assert_x402_refused(paid_get(server, header), 'payment_replayed')
        assert replayed['checks'] == dict(readme_proof_checks()['checks'], notReplayed=False), replayed
        assert balances(anvil, payer, PAY_TO) == after_transfer          # a proof moves nothing more
        [row] = x402_rows(server.db)
        assert (row['form'], row['payer'], row['amount'], row['tx_hash'], row['status'], row['raw_tx']) == \
            ('proof', payer, PRICE, tx_hash, 'confirmed', None)


# 3. Payers racing one payment ----------------------------------------------------------

def test_one_payment_sent_by_many_threads_at_once_pays_for_one_call(anvil, usdc, tmp_path):
    proof_key, proof_payer = funded(anvil, 2)
    auth_key, auth_payer = funded(anvil, 3)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        open_code_job(server)
        proof = proof_header(anvil, anvil.transfer(proof_key, PAY_TO, PRICE), proof_payer, proof_key)
        answers = at_once(8, lambda: paid_get(server, proof))
        assert outcomes(answers) == [(200, None)] + [(402, 'payment_replayed')] * 7
        for answer in answers:
            if answer.status_code == 402:
                assert_x402_refused(answer, 'payment_replayed')

        before, escrow_nonce = balances(anvil, auth_payer, PAY_TO), nonce_of(anvil, ESCROW)
        authorization = authorization_header(anvil, auth_key)
        answers = at_once(4, lambda: paid_get(server, authorization))
        assert outcomes(answers) == [(200, None)] + [(402, 'payment_replayed')] * 3
        assert balances(anvil, auth_payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)
        assert nonce_of(anvil, ESCROW) == escrow_nonce + 1       # one settlement sent, no gap, no second one
        rows = x402_rows(server.db)
        assert sorted((r['form'], r['payer'], r['status'], r['granted_at'] is not None) for r in rows) == \
            [('authorization', auth_payer, 'confirmed', True), ('proof', proof_payer, 'confirmed', True)]


def test_six_authorizations_of_a_payer_whose_balance_covers_one_settle_once(anvil, usdc, tmp_path):
    """Six different authorizations from one payer at once, each for the whole balance: the greenlets interleave at
    every call to the node, so all may read the same balance; the transaction that reserves each counts what the
    others reserved, and exactly one settlement is signed and sent."""
    payer_key, payer = funded(anvil, 2, PRICE)
    with serving(tmp_path / 'm.db', anvil.url) as server:
        open_code_job(server)
        headers = [authorization_header(anvil, payer_key) for _ in range(6)]
        before, escrow_nonce = balances(anvil, payer, PAY_TO), nonce_of(anvil, ESCROW)
        answers = at_once(6, lambda: paid_get(server, headers.pop()))
        assert outcomes(answers) == [(200, None)] + [(402, 'payment_insufficient')] * 5
        for answer in answers:
            if answer.status_code == 402:
                assert assert_x402_refused(answer, 'payment_insufficient')['checks']['balance'] is False
        assert nonce_of(anvil, ESCROW) == escrow_nonce + 1       # one settlement: no gas spent on a reverted one
        assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE) == (0, before[1] + PRICE)
        [row] = x402_rows(server.db)
        assert (row['payer'], row['status'], row['granted_at'] is not None) == (payer, 'confirmed', True), row


# 4. Settings: the environment and the command line -----------------------------------------

def test_prices_from_the_environment_are_listed(anvil, usdc, tmp_path):
    prices = 'GET /api/jobs/match=0.01;GET /api/agents/match=0.02'
    with serving(tmp_path / 'm.db', anvil.url, price=(), env={'MARKETPLACE_X402_PRICE': prices}) as server:
        listed = requests.get(server.url + '/api/x402', timeout=TIMEOUT)
        assert listed.status_code == 200, listed.text
        body = listed.json()
        assert (body['enabled'], body['network'], body['chainId'], body['asset'], body['payTo'], body['settlement']) \
            == (True, 'base', 8453, USDC, PAY_TO, 'relayer')
        assert [(e['method'], e['path'], e['price'], e['currency'], e['maxAmountRequired'])
                for e in body['endpoints']] == [('GET', '/api/jobs/match', '0.01', 'USDC', '10000'),
                                                ('GET', '/api/agents/match', '0.02', 'USDC', '20000')]
        unpaid = requests.get(server.url + '/api/agents/match?category=code', timeout=TIMEOUT)
        assert unpaid.status_code == 402 and unpaid.json()['accepts'][0]['maxAmountRequired'] == '20000', unpaid.text


def test_a_bad_price_refuses_to_start_with_a_message(anvil, tmp_path):
    onchain = ['--rpc-url', anvil.url, '--chain-id', '8453']
    cases = [
        (onchain + ['--x402-price', 'GET /api/nope=1'], None,
         "--x402-price: 'GET /api/nope=1': the service has no endpoint GET /api/nope"),
        (onchain, {'MARKETPLACE_X402_PRICE': 'GET /api/jobs/match=0.01;GET /api/nope=1'},
         "MARKETPLACE_X402_PRICE: 'GET /api/nope=1': the service has no endpoint GET /api/nope"),
        (onchain + ['--x402-price', 'GET /api/jobs/match=0'], None, "--x402-price: 'GET /api/jobs/match=0': expected"),
        (['--x402-price', 'GET /api/jobs/match=0.01'], None, '--x402-price needs --rpc-url'),
        (onchain + ['--x402-price', 'GET /api/jobs/match=0.01'], None, '--x402-price needs --x402-pay-to'),
        (onchain + ['--x402-price', 'GET /api/jobs/match=0.01', '--x402-pay-to', ESCROW], None,
         f'--x402-pay-to is the escrow address {ESCROW}'),
    ]
    for args, env, message in cases:
        code, output, seconds = refused_start(tmp_path, args, env)
        assert code not in (0, None), (args, output)
        assert message in output, (args, output)
        assert 'Traceback' not in output, (args, output)       # a traceback would be a defect
        assert seconds < 10, (args, seconds)


# 5. A crash between storing a settlement and sending it --------------------------------------

def test_a_crash_before_the_settlement_is_sent_pays_once_and_answers_the_call(anvil, usdc, tmp_path):
    payer_key, payer = funded(anvil, 2)
    db = tmp_path / 'm.db'
    header = authorization_header(anvil, payer_key)
    proxy = RPCProxy(anvil.url)
    try:
        with serving(db, proxy.url, '--sweep-interval', '600') as server:
            expected, first_url = open_code_job(server), server.url
            before, escrow_nonce = balances(anvil, payer, PAY_TO), nonce_of(anvil, ESCROW)
            proxy.holding = True
            call = threading.Thread(target=unanswered, args=(server, header), daemon=True)
            call.start()
            wait_until(lambda: any(r['raw_tx'] for r in x402_rows(db)), message='the settlement row')
            held = proxy.wait_for_held()                 # committed, and being sent
            [row] = x402_rows(db)
            assert (row['status'], row['payer'], row['amount'], row['granted_at'], row['broadcast_at']) == \
                ('pending', payer, PRICE, None, None), row
            server.kill()
        call.join(TIMEOUT)
        proxy.holding = False
        held['release'].set()                            # the held request ends without an answer
        assert balances(anvil, payer, PAY_TO) == before  # nothing reached the node
        assert proxy.sent == []

        with serving(db, proxy.url, '--sweep-interval', '0.5') as server:
            wait_until(lambda: x402_rows(db)[0]['status'] == 'confirmed', message='the sweeps settle it')
            assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)
            assert {raw for raw, _ in proxy.sent} == {held['raw']}     # the stored transaction, and only it
            assert proxy.sent[0][1].get('result') == row['tx_hash'], proxy.sent

            served = paid_get(server, header)           # the call that was never answered
            assert served.status_code == 200, served.text
            assert json.loads(served.text.replace(server.url, first_url)) == expected     # jobs' urls name the port
            assert payment_response(served) == {'success': True, 'transaction': row['tx_hash'], 'network': 'base',
                                                'payer': payer, 'paymentSpent': True}
            assert_x402_refused(paid_get(server, header), 'payment_replayed')

            time.sleep(1.1)                              # two sweeps more: nothing is sent again
            assert balances(anvil, payer, PAY_TO) == (before[0] - PRICE, before[1] + PRICE)
            assert nonce_of(anvil, ESCROW) == escrow_nonce + 1
            [row] = x402_rows(db)
            assert (row['status'], row['granted_at'] is not None) == ('confirmed', True), row
    finally:
        proxy.close()
