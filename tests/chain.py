"""A local EVM for the tests: anvil (from node_modules, installed by `make test`) on 127.0.0.1 with
chain id 8453, and TestUSDC (fixtures/TestUSDC.sol) placed at the real Base USDC address.

    with Anvil() as chain:                      # or the `anvil` / `usdc` fixtures of conftest.py
        chain.install_token()                   # TestUSDC's runtime code at USDC (and OTHER_TOKEN)
        payer = Account.create()
        chain.set_eth(payer.address, 10**18)    # gas money
        chain.mint(payer.address, 25_000_000)   # 25 USDC (6 decimals)
        tx_hash = chain.transfer(payer.key, escrow_address, 25_000_000)   # '0x...' (mined)
        chain.balance(escrow_address)           # 25_000_000
        sign_funding(payer.key, account_id, tx_hash, escrow_address)     # POST /api/jobs's escrowSignature
        sign_proof(payer.key, tx_hash, 'GET', '/api/jobs/match', escrow_address)     # a form-1 x402 proof's signature
        signed = sign_authorization(payer.key, escrow_address, 10_000, *chain.window())   # valid on every clock

Transactions are signed here with eth-account and sent raw (eth_sendRawTransaction), as the service
does; the node auto-mines one block per transaction unless `automine(False)` or `block_time` is set.
A call that would revert raises web3's ContractLogicError at gas estimation; pass `gas=` to skip the
estimate and get a mined transaction with status 0 instead.
"""

import ctypes
import json
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

# Importing eth_account (web3 imports it) imports py_ecc, which raises the process's recursion limit to
# 100000; a deeply nested JSON body then overflows the C stack (a segfault) instead of raising
# RecursionError, and the test run dies (test_errors' deep-JSON test). Put the limit back: nothing here
# needs it. It works only if this module is the first to import them, so test modules take these
# names from here rather than importing web3 or eth_account themselves.
_RECURSION_LIMIT = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
from web3 import Web3  # noqa: E402
from web3.exceptions import ContractLogicError, TransactionNotFound  # noqa: E402,F401 (for tests)
from web3.logs import DISCARD  # noqa: E402,F401 (for tests)
sys.setrecursionlimit(_RECURSION_LIMIT)

ROOT = Path(__file__).resolve().parent.parent
ANVIL = ROOT / 'node_modules' / '.bin' / 'anvil'
ARTIFACT = ROOT / 'fixtures' / 'TestUSDC.json'

CHAIN_ID = 8453
USDC = '0x833589fCD6eDb6E08f4c7C32D4f71b54bdA02913'  # USD Coin on Base mainnet
# Base Sepolia's USDC address: on this chain it holds the same TestUSDC code, a "wrong token".
OTHER_TOKEN = '0x036CbD53842c5426634e7929541eC2318f3dCF7e'

# anvil's documented dev accounts (mnemonic "test test ... junk"), each funded with 10000 ETH; and where its binary is.
from verifier.rehearsal import DEV_KEYS, anvil_binary  # noqa: E402
DEV_ADDRESSES = [Account.from_key(key).address for key in DEV_KEYS]


@lru_cache(maxsize=None)
def token_artifact():
    """fixtures/TestUSDC.json: {abi, bytecode, deployedBytecode, ...}, built by `make contracts`."""
    return json.loads(ARTIFACT.read_text())


def _die_with_parent():
    """In the child before exec, on Linux: SIGTERM when the thread that started it ends, so a test
    run that crashes or is killed leaves no anvil behind. (Start Anvil from a long-lived thread.)"""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


try:
    _LIBC = ctypes.CDLL('libc.so.6', use_errno=True) if sys.platform == 'linux' else None
except OSError:
    _LIBC = None


class RPCError(RuntimeError):
    pass


class Anvil:
    """One anvil process on 127.0.0.1 (a free port chosen by anvil itself)."""

    def __init__(self, chain_id=CHAIN_ID, block_time=None, args=()):
        self.chain_id = chain_id
        self.block_time = block_time
        self.args = list(args)
        self.process = None
        self.port = None
        self.url = None
        self.w3 = None
        self._log = None

    # ----- process -----

    def start(self, timeout=30):
        binary = anvil_binary()
        if binary is None:
            raise FileNotFoundError(f'{ANVIL} is missing: run `make test` (it runs npm install)')
        command = [str(binary), '--host', '127.0.0.1', '--port', '0', '--chain-id', str(self.chain_id),
                   *(['--block-time', str(self.block_time)] if self.block_time else []), *self.args]
        self._log = tempfile.NamedTemporaryFile(prefix='anvil-', suffix='.log')
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT, cwd=ROOT, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        try:
            while self.port is None:  # anvil prints "Listening on 127.0.0.1:<port>" once bound
                self._check_alive(deadline)
                found = re.search(r'Listening on 127\.0\.0\.1:(\d+)', self.output())
                if found:
                    self.port = int(found.group(1))
                else:
                    time.sleep(0.02)
            self.url = f'http://127.0.0.1:{self.port}'
            self.w3 = Web3(Web3.HTTPProvider(self.url, request_kwargs={'timeout': 10}))
            while True:
                self._check_alive(deadline)
                try:
                    if int(self.rpc('eth_chainId'), 16) == self.chain_id:
                        return self
                except OSError:
                    pass
                time.sleep(0.02)
        except BaseException:
            self.stop()
            raise

    def _check_alive(self, deadline):
        if self.process.poll() is not None:
            raise RuntimeError(f'anvil exited with {self.process.returncode}:\n{self.output()[-2000:]}')
        if time.monotonic() > deadline:
            raise RuntimeError(f'anvil did not answer in time:\n{self.output()[-2000:]}')

    def output(self):
        """What anvil has printed so far (its banner, then one line per RPC method called)."""
        return Path(self._log.name).read_text(errors='replace') if self._log else ''

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self.start() if self.process is None else self

    def __exit__(self, *exc):
        self.stop()

    def rpc(self, method, *params):
        """One JSON-RPC call; its result, or RPCError."""
        answer = self.w3.provider.make_request(method, list(params))
        if 'error' in answer:
            raise RPCError(f'{method}: {answer["error"]}')
        return answer['result']

    # ----- the token -----

    def install_token(self, address=USDC):
        """Place TestUSDC's runtime code at `address` (its storage is left as it is); the contract."""
        self.rpc('anvil_setCode', Web3.to_checksum_address(address), token_artifact()['deployedBytecode'])
        return self.token(address)

    def token(self, address=USDC):
        """A web3 contract object for TestUSDC's ABI at `address`."""
        return self.w3.eth.contract(address=Web3.to_checksum_address(address), abi=token_artifact()['abi'])

    def balance(self, address, token=USDC):
        """The token balance of `address` in base units (1 USDC = 1_000_000)."""
        return self.token(token).functions.balanceOf(Web3.to_checksum_address(address)).call()

    def mint(self, to, amount, token=USDC, key=DEV_KEYS[0], **options):
        """Mint `amount` base units to `to`; the transaction hash."""
        return self.send(self.token(token).functions.mint(Web3.to_checksum_address(to), amount), key, **options)

    def transfer(self, key, to, amount, token=USDC, **options):
        """A token transfer signed with `key` (it needs ETH for gas: see set_eth); the transaction hash."""
        return self.send(self.token(token).functions.transfer(Web3.to_checksum_address(to), amount), key, **options)

    def transfer_with_authorization(self, signed, key=DEV_KEYS[0], token=USDC, **options):
        """Settle an EIP-3009 authorization from sign_authorization(), paying gas with `key`."""
        auth, signature = signed['authorization'], bytes.fromhex(signed['signature'][2:])
        call = self.token(token).get_function_by_signature(
            'transferWithAuthorization(address,address,uint256,uint256,uint256,bytes32,uint8,bytes32,bytes32)')(
            Web3.to_checksum_address(auth['from']), Web3.to_checksum_address(auth['to']), int(auth['value']),
            int(auth['validAfter']), int(auth['validBefore']), bytes.fromhex(auth['nonce'][2:]),
            signature[64], signature[:32], signature[32:64])
        return self.send(call, key, **options)

    def send(self, call, key, gas=None, wait=True):
        """Sign a contract call with `key`, send it raw; the transaction hash ('0x' + 64 hex digits).

        gas=None estimates (a call that would revert raises ContractLogicError, nothing is sent);
        a number skips the estimate, so a reverting call is mined with status 0. wait=False returns
        without waiting for the receipt (with automine off it stays pending until mine())."""
        account = Account.from_key(key)
        fields = {'from': account.address, 'chainId': self.chain_id,
                  'nonce': self.w3.eth.get_transaction_count(account.address, 'pending')}
        if gas is not None:
            fields['gas'] = gas
        signed = account.sign_transaction(call.build_transaction(fields))
        tx_hash = self.w3.eth.send_raw_transaction(signed.raw_transaction)
        if wait:
            self.w3.eth.wait_for_transaction_receipt(tx_hash, timeout=10, poll_latency=0.02)
        return '0x' + bytes(tx_hash).hex()

    def receipt(self, tx_hash):
        return self.w3.eth.get_transaction_receipt(tx_hash)

    def set_eth(self, address, wei):
        """Set the ETH balance of `address` (gas money for a fresh account)."""
        self.rpc('anvil_setBalance', Web3.to_checksum_address(address), hex(wei))

    # ----- blocks and time -----

    def block_number(self):
        return self.w3.eth.block_number

    def timestamp(self):
        """The latest block's timestamp (unix seconds)."""
        return self.w3.eth.get_block('latest')['timestamp']

    def window(self, back=600, ahead=300):
        """(validAfter, validBefore) of an authorization valid now on every clock that judges it: the wall clock
        (the server's), the newest block's time (minutes old when nothing was mined for a while) and the next
        block's (the chain's when it settles: the later of the two): from `back` seconds before the earliest to
        `ahead` seconds after the latest. window(0, 0) is (earliest, latest), for windows that must miss them all."""
        clocks = (int(time.time()), self.timestamp())
        return min(clocks) - back, max(clocks) + ahead

    def mine(self, blocks=1, interval=None):
        """Mine `blocks` blocks now (`interval` seconds apart, else 1 s)."""
        self.rpc('anvil_mine', hex(blocks), *([hex(interval)] if interval is not None else []))

    def set_next_timestamp(self, timestamp):
        """The next block mined gets this timestamp (later blocks follow on from it)."""
        self.rpc('evm_setNextBlockTimestamp', hex(int(timestamp)))

    def automine(self, enabled):
        """Off: sent transactions stay pending until mine()."""
        self.rpc('evm_setAutomine', bool(enabled))

    def snapshot(self):
        """Save the whole chain state; an id for revert()."""
        return self.rpc('evm_snapshot')

    def revert(self, snapshot_id):
        """Go back to a snapshot (blocks, balances, code, nonces). A snapshot can be reverted once."""
        if not self.rpc('evm_revert', snapshot_id):
            raise RPCError(f'evm_revert({snapshot_id}) failed')

    def reorg(self, depth):
        """Replace the last `depth` blocks with as many empty ones: their transactions are gone
        and their block hashes change (a receipt fetched before no longer matches the chain)."""
        self.rpc('anvil_reorg', depth, [])


def sign_authorization(key, to, value, valid_after=0, valid_before=None, nonce=None, token=USDC,
                       chain_id=CHAIN_ID, name='USD Coin', version='2'):
    """An EIP-3009 TransferWithAuthorization signed with EIP-712 by `key`, in the x402 "exact" payload
    shape: {'signature': '0x..', 'authorization': {from, to, value, validAfter, validBefore, nonce}}
    (numbers as decimal strings, nonce as 0x + 64 hex digits; a random nonce unless given).
    valid_before defaults to an hour from now (wall clock)."""
    account = Account.from_key(key)
    nonce = nonce if nonce is not None else '0x' + secrets.token_hex(32)
    valid_before = valid_before if valid_before is not None else int(time.time()) + 3600
    message = {'from': account.address, 'to': Web3.to_checksum_address(to), 'value': int(value),
               'validAfter': int(valid_after), 'validBefore': int(valid_before), 'nonce': bytes.fromhex(nonce[2:])}
    signed = Account.sign_typed_data(
        account.key,
        domain_data={'name': name, 'version': version, 'chainId': chain_id,
                     'verifyingContract': Web3.to_checksum_address(token)},
        message_types={'TransferWithAuthorization': [
            {'name': 'from', 'type': 'address'}, {'name': 'to', 'type': 'address'},
            {'name': 'value', 'type': 'uint256'}, {'name': 'validAfter', 'type': 'uint256'},
            {'name': 'validBefore', 'type': 'uint256'}, {'name': 'nonce', 'type': 'bytes32'}]},
        message_data=message)
    return {'signature': '0x' + bytes(signed.signature).hex(),
            'authorization': {'from': account.address, 'to': message['to'], 'value': str(message['value']),
                              'validAfter': str(message['validAfter']), 'validBefore': str(message['validBefore']),
                              'nonce': nonce}}


def funding_typed_data(account, tx_hash, escrow, chain_id=CHAIN_ID):
    """The EIP-712 typed data that binds a job's funding transfer to the account posting it (CONTRACT.md 18),
    written out here as a client would, independently of verifier/funding.py."""
    return {'domain': {'name': 'Job Marketplace', 'version': '1', 'chainId': chain_id,
                       'verifyingContract': Web3.to_checksum_address(escrow)},
            'types': {'EIP712Domain': [{'name': 'name', 'type': 'string'}, {'name': 'version', 'type': 'string'},
                                       {'name': 'chainId', 'type': 'uint256'},
                                       {'name': 'verifyingContract', 'type': 'address'}],
                      'Funding': [{'name': 'account', 'type': 'string'}, {'name': 'txHash', 'type': 'bytes32'}]},
            'primaryType': 'Funding',
            'message': {'account': account, 'txHash': tx_hash}}


def proof_typed_data(tx_hash, method, path, escrow, chain_id=CHAIN_ID):
    """The EIP-712 typed data that binds a form-1 x402 proof to the call it pays (CONTRACT.md 20), in the funding
    domain, written out here as a client would, independently of verifier/x402.py."""
    typed_data = funding_typed_data(None, tx_hash, escrow, chain_id)
    typed_data['types']['PaymentProof'] = [{'name': 'txHash', 'type': 'bytes32'}, {'name': 'method', 'type': 'string'},
                                           {'name': 'path', 'type': 'string'}]
    del typed_data['types']['Funding']
    return dict(typed_data, primaryType='PaymentProof', message={'txHash': tx_hash, 'method': method, 'path': path})


def sign_proof(key, tx_hash, method, path, escrow, chain_id=CHAIN_ID):
    """A form-1 proof's `signature`: the PaymentProof of the call `method` `path` (no query string) for the
    transfer `tx_hash`, signed by `key` (its sender) ('0x' + 130 hex)."""
    typed_data = proof_typed_data(tx_hash, method, path, escrow, chain_id)
    return Account.sign_typed_data(key, full_message=typed_data).signature.to_0x_hex()


def sign_funding(key, account, tx_hash, escrow, chain_id=CHAIN_ID):
    """escrowSignature: the funding's typed data for `account` and `tx_hash` signed by `key` ('0x' + 130 hex)."""
    typed_data = funding_typed_data(account, tx_hash, escrow, chain_id)
    return Account.sign_typed_data(key, full_message=typed_data).signature.to_0x_hex()
