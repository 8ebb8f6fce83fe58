"""`make chain-demo` (CONTRACT.md 23): the real target, run by make on a free port with node_modules' anvil, does
what it prints. The addresses it prints hold code on its chain, a printed demo wallet holds the printed test USDC
and its printed key signs for it, health shows contract mode with the printed contract, a job posted with a demo
key is refused with escrowRequirements naming that contract, and a deposit by the printed wallet funds it. Stopped
by its process group, it leaves no anvil behind."""

import json
import os
import re
import secrets
import signal
import stat
import subprocess
import threading
import time

import pytest
import requests

from conftest import ROOT, free_port, job_body

HUNG_SECONDS = 600          # only a hung test waits this long: every wait below ends on what it waits for
PRICE = 25_000_000          # job_body's 25.00 USDC


def poll(what, check):
    """check()'s first truthy answer, asked every 0.1 s (a check fails at once when its process has ended)."""
    deadline = time.monotonic() + HUNG_SECONDS
    while True:
        answer = check()
        if answer:
            return answer
        if time.monotonic() > deadline:
            pytest.fail(f'{what}: hung')
        time.sleep(0.1)


def answers(url):
    """Does something answer HTTP at this URL?"""
    try:
        requests.post(url, json={'jsonrpc': '2.0', 'id': 1, 'method': 'eth_chainId', 'params': []}, timeout=1)
        return True
    except requests.ConnectionError:
        return False


def receipt_of(w3, tx_hash):
    """A transaction's receipt once it is mined, else None."""
    from chain import TransactionNotFound
    try:
        return w3.eth.get_transaction_receipt(tx_hash)
    except TransactionNotFound:
        return None


def anvils_under(pid):
    """The anvil processes among a process's descendants (Linux: /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            kids = [int(kid) for task in os.listdir(f'/proc/{parent}/task')
                    for kid in open(f'/proc/{parent}/task/{task}/children').read().split()]
        except OSError:
            continue
        todo.extend(kids)
        for kid in kids:
            try:
                if open(f'/proc/{kid}/comm').read().strip() == 'anvil':
                    found.append(kid)
            except OSError:
                pass
    return found


def found(pattern, text):
    match = re.search(pattern, text, re.M)
    assert match, f'{pattern!r} is not in what chain-demo printed:\n{text}'
    return match.groups() if len(match.groups()) > 1 else match.group(1)


def test_make_chain_demo_serves_contract_mode_on_a_chain_where_what_it_prints_is_true(tmp_path):
    import chain        # web3 loads only when the chain is wanted
    from chain import DEV_KEYS, Account, Web3
    if chain.anvil_binary() is None:
        pytest.skip(f'anvil is not installed ({chain.ANVIL} is missing): run `make test`, which installs it with npm '
                    'install from package-lock.json')
    port, db = free_port(), tmp_path / 'chain-demo.db'
    environment = {name: value for name, value in os.environ.items() if not name.startswith('MARKETPLACE_')}
    # -o: the installs' stamps count as done (make test made them); the target's own recipe runs as written.
    process = subprocess.Popen(['make', '--no-print-directory', '-o', '.venv/stamp', '-o', 'node_modules/.stamp',
                                'chain-demo', 'HOST=127.0.0.1', f'PORT={port}', f'CHAIN_DB={db}'],
                               cwd=ROOT, env=environment, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed = []
    reader = threading.Thread(target=lambda: printed.extend(iter(process.stdout.readline, '')), daemon=True)
    reader.start()
    api, rpc_url, anvils = f'http://127.0.0.1:{port}', None, []

    def health():
        assert process.poll() is None, 'chain-demo exited:\n' + ''.join(printed)
        try:
            answer = requests.get(api + '/api/health', timeout=2)
        except requests.ConnectionError:
            return None
        return answer.json() if answer.status_code == 200 else None

    try:
        status = poll('the server answering', health)
        text = ''.join(printed)
        rpc_url = found(r'RPC URL\s+(http://127\.0\.0\.1:\d+)', text)
        anvils = anvils_under(process.pid)
        assert len(anvils) == 1, anvils
        usdc = found(r'test USDC\s+(0x[0-9a-fA-F]{40})', text)
        escrow = found(r'JobEscrow\s+(0x[0-9a-fA-F]{40})', text)
        guardian = found(r'guardian\s+(0x[0-9a-fA-F]{40})', text)
        address, key = found(r'^  acme-research\s+(0x[0-9a-fA-F]{40})\s+test key (0x[0-9a-f]{64})', text)
        funded = int(found(r'and ([\d.]+) test USDC each', text).replace('.', '')) * 10_000
        api_key = found(r'^  KEY=(\S+)', text)
        assert found(r'chain id (\d+)', text) == '31337'
        assert DEV_KEYS[1] not in text          # the server's key (the contract's arbiter) is never shown
        keys_file = tmp_path / 'chain-demo-keys.txt'
        assert api_key in keys_file.read_text() and stat.S_IMODE(keys_file.stat().st_mode) == 0o600

        # What it printed is on its chain.
        w3 = Web3(Web3.HTTPProvider(rpc_url, request_kwargs={'timeout': 10}))
        assert w3.eth.chain_id == 31337
        assert len(w3.eth.get_code(escrow)) > 0 and len(w3.eth.get_code(usdc)) > 0
        token = w3.eth.contract(address=usdc, abi=chain.token_artifact()['abi'])
        contract = w3.eth.contract(address=escrow,
                                   abi=json.loads((ROOT / 'contracts' / 'JobEscrow.json').read_text())['abi'])
        assert (contract.functions.token().call(), contract.functions.guardian().call()) == (usdc, guardian)
        assert Account.from_key(key).address == address and funded == 1_000_000_000
        assert token.functions.balanceOf(address).call() == funded
        assert w3.eth.get_balance(address) > 10 ** 18

        # The server runs contract mode with that contract.
        assert (status['payments'], status['chain']['chainId'], status['chain']['usdcAddress']) == \
            ('onchain', 31337, usdc)
        assert (status['escrow']['mode'], status['escrow']['contract']) == ('contract', escrow)
        assert token.functions.balanceOf(status['escrow']['arbiter']).call() == 0

        # A job posted with a demo key: 402, and what to deposit into that contract.
        body = job_body()
        post = lambda **funding: requests.post(api + '/api/jobs', json=dict(body, **funding), timeout=15,  # noqa: E731
                                               headers={'Authorization': f'Bearer {api_key}'})
        refused = post()
        assert (refused.status_code, refused.json()['code']) == (402, 'payment_required'), refused.text
        wanted = refused.json()['escrowRequirements']
        assert (wanted['contract'], wanted['token'], wanted['chainId'], wanted['amount']) == \
            (escrow, usdc, 31337, str(PRICE))

        # The printed wallet deposits with its printed key (approve, deposit), and the deposit funds the job.
        salt, account, refund_after = secrets.token_bytes(32), bytes.fromhex(wanted['account'][2:]), \
            wanted['minRefundAfter']
        nonce = w3.eth.get_transaction_count(address, 'pending')
        for offset, call in enumerate((token.functions.approve(escrow, PRICE),
                                       contract.functions.deposit(account, PRICE, refund_after, salt))):
            transaction = call.build_transaction({'from': address, 'nonce': nonce + offset, 'chainId': 31337,
                                                  'gas': 200_000})
            sent = w3.eth.send_raw_transaction(Account.from_key(key).sign_transaction(transaction).raw_transaction)
        mined = poll('the deposit mined', lambda: receipt_of(w3, sent))
        assert mined['status'] == 1
        deposit = '0x' + contract.functions.depositId(address, account, refund_after, salt).call().hex()
        # The server takes a deposit 2 blocks deep (--confirmations, its own block counted); the chain mines a
        # block a second. Counted in blocks, not seconds: one post once the next block is there.
        poll('a block on the deposit', lambda: w3.eth.block_number >= mined['blockNumber'] + 1)
        answer = post(escrowDepositId=deposit)
        assert answer.status_code == 201, answer.text
        job = answer.json()['job']
        assert (job['status'], job['escrowStatus']) == ('open', 'locked')
        assert (token.functions.balanceOf(escrow).call(), token.functions.balanceOf(address).call()) == \
            (PRICE, funded - PRICE)

        # Stopped as a terminal's Ctrl-C or a SIGTERM to its group would: the server ends, and its chain with it.
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(HUNG_SECONDS)
        poll('anvil gone with the server', lambda: not answers(rpc_url))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        for pid in anvils if rpc_url and answers(rpc_url) else ():    # the test failed before the chain ended
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
