"""A local chain to rehearse contract mode on (`make chain-demo`, CONTRACT.md 23): anvil from node_modules on a
free port of 127.0.0.1, tied to the process that started it, with TestUSDC (fixtures/TestUSDC.sol, a stand-in for
USD Coin that anyone may mint: NOT real USDC), the JobEscrow deployed by the same code as `escrow deploy`, and demo
wallets holding test USDC.

The chain id is anvil's own, 31337, not Base's: no wallet takes the chain for Base, and nothing signed on it (an
authorization, a Release) is valid on Base. Every key here is one of anvil's dev keys (the mnemonic "test test
test test test test test test test test test junk"): test keys, published everywhere, never to hold real money.
"""

import ctypes
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

_recursion_limit = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
from web3 import Web3  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.chain import Chain  # noqa: E402
from verifier.escrow import deploy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ANVIL = ROOT / 'node_modules' / '.bin' / 'anvil'
TOKEN_ARTIFACT = ROOT / 'fixtures' / 'TestUSDC.json'
CHAIN_ID = 31337            # anvil's default; not Base (8453) nor Base Sepolia (84532)
BLOCK_TIME = 1              # seconds: a block every second, so deposits get --confirmations deep on their own
ARBITER_DELAY = 3600        # the least the contract takes: a payout without the payer's signature waits an hour
MAX_FEE_BPS = 500           # the contract's fee cap, 5 % (raised to --fee-percent when that is higher)
WALLET_USDC = 1_000 * 10 ** 6       # test USDC minted to each demo wallet (6 decimals)
TOKEN_GAS = 3_000_000
MINT_GAS = 100_000

# anvil's first seven dev accounts (each starts with 10000 ETH), in anvil's order.
DEV_KEYS = [
    '0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80',
    '0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d',
    '0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a',
    '0x7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6',
    '0x47e179ec197488593b187f80a00eb0da91f1b9d0b13f8733639f19c30a34926a',
    '0x8b3a350cf5c34c9194ca85829a2df0ec3153be0318b5e2d3348e872092edffba',
    '0x92db14e403b83dfe3df233f83dfa3a0d7096f21ca9b0d6d6b8d88b2b4ec1564e',
]
DEPLOYER_KEY, ARBITER_KEY, GUARDIAN_KEY, FEE_RECIPIENT_KEY = DEV_KEYS[:4]
WALLET_KEYS = DEV_KEYS[4:6]     # the demo wallets: one per demo account that posts jobs

try:
    _LIBC = ctypes.CDLL('libc.so.6', use_errno=True) if sys.platform == 'linux' else None
except OSError:
    _LIBC = None


def anvil_binary():
    """The native anvil of node_modules when its platform's package is there (no node wrapper in between, so
    stopping it stops the node), else node_modules/.bin/anvil; None when neither is (run `npm install`)."""
    native = sorted((ROOT / 'node_modules' / '@foundry-rs').glob('anvil-*/bin/anvil'))
    if native and os.access(native[0], os.X_OK):
        return native[0]
    return ANVIL if ANVIL.exists() else None


def address_of(key):
    return Account.from_key(key).address


def _die_with(parent):
    """The child's first act, before exec, on Linux: SIGTERM when the thread that started it ends (even by SIGKILL,
    or by the exec of another program in its place, which keeps the same process: then when that one ends)."""
    def arrange():
        if _LIBC is not None:
            _LIBC.prctl(1, signal.SIGTERM)      # PR_SET_PDEATHSIG
            if os.getppid() != parent:          # it died before the line above: nobody would stop this one
                os._exit(1)
    return arrange


class LocalChain:
    """One anvil on 127.0.0.1 (a port anvil chose), its output in `log_path`. It runs in a session of its own, so a
    Ctrl-C at the terminal reaches the server first; it ends when the process that started it ends."""

    def __init__(self, log_path, fee_percent=0):
        self.log_path = Path(log_path)
        self.max_fee_bps = max(MAX_FEE_BPS, math.ceil(fee_percent * 100))   # the cap takes --fee-percent
        self.process = None
        self.url = None
        self.chain = None

    def start(self, timeout=30):
        binary = anvil_binary()
        if binary is None:
            raise FileNotFoundError(f'{ANVIL} is missing: `make chain-demo` installs it (npm install)')
        with open(self.log_path, 'wb') as log:
            self.process = subprocess.Popen(
                [str(binary), '--host', '127.0.0.1', '--port', '0', '--chain-id', str(CHAIN_ID),
                 '--block-time', str(BLOCK_TIME)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                cwd=ROOT, preexec_fn=_die_with(os.getpid()), start_new_session=_LIBC is not None)
        deadline = time.monotonic() + timeout
        try:
            while self.url is None:         # anvil prints "Listening on 127.0.0.1:<port>" once bound
                self._check_alive(deadline)
                found = re.search(r'Listening on 127\.0\.0\.1:(\d+)', self.log_path.read_text(errors='replace'))
                if found:
                    self.url = f'http://127.0.0.1:{found.group(1)}'
                else:
                    time.sleep(0.05)
            self.chain = Chain(self.url, timeout=10)
            while True:
                self._check_alive(deadline)
                try:
                    if self.chain.chain_id() == CHAIN_ID:
                        break
                except Exception:
                    time.sleep(0.05)
            accounts = [Web3.to_checksum_address(a) for a in self.chain.w3.eth.accounts[:len(DEV_KEYS)]]
            if accounts != [address_of(key) for key in DEV_KEYS]:
                raise RuntimeError(f'anvil\'s dev accounts are not the known test keys\' addresses: {accounts}')
        except BaseException:
            self.stop()
            raise
        return self

    def _check_alive(self, deadline):
        if self.process.poll() is not None:
            raise RuntimeError(f'anvil exited with {self.process.returncode}:\n'
                               f'{self.log_path.read_text(errors="replace")[-2000:]}')
        if time.monotonic() > deadline:
            raise RuntimeError(f'anvil did not answer in time:\n{self.log_path.read_text(errors="replace")[-2000:]}')

    def stop(self):
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def _send(self, key, nonce, *, data, to=None, gas):
        """Sign with `key` and send (not waiting): the transaction's hash."""
        max_fee, tip = self.chain.fee_caps()
        fields = {'type': 2, 'chainId': CHAIN_ID, 'nonce': nonce, 'value': 0, 'data': data, 'gas': gas,
                  'maxFeePerGas': max_fee, 'maxPriorityFeePerGas': tip}
        if to is not None:
            fields['to'] = to
        signed = Account.sign_transaction(fields, key)
        self.chain.send_raw(signed.raw_transaction.to_0x_hex())
        return signed.hash.to_0x_hex()

    def _mined(self, tx_hash, what):
        receipt = self.chain.wait_for_receipt(tx_hash, 30, poll=0.1)
        if receipt['status'] != 1:
            raise RuntimeError(f'{what} ({tx_hash}) reverted')
        return receipt

    def deploy(self):
        """TestUSDC, then the JobEscrow (by verifier.escrow.deploy, as `escrow deploy` does), then test USDC for
        each demo wallet: {usdc, escrow, arbiter, guardian, feeRecipient, maxFeeBps, arbiterDelay, wallets:
        [{address, key, usdc}]}."""
        artifact = json.loads(TOKEN_ARTIFACT.read_text())
        deployer = address_of(DEPLOYER_KEY)
        token_tx = self._send(DEPLOYER_KEY, self.chain.nonce(deployer), data=artifact['bytecode'], gas=TOKEN_GAS)
        self._mined(token_tx, 'the TestUSDC deployment')
        usdc = self.chain._ask('eth_getTransactionReceipt',
                               lambda: self.chain.w3.eth.get_transaction_receipt(token_tx))['contractAddress']
        escrow = deploy(self.chain, DEPLOYER_KEY, token=usdc, arbiter=address_of(ARBITER_KEY),
                        guardian=address_of(GUARDIAN_KEY), fee_recipient=address_of(FEE_RECIPIENT_KEY),
                        max_fee_bps=self.max_fee_bps, arbiter_delay=ARBITER_DELAY, chain_id=CHAIN_ID,
                        wait_seconds=30)
        token = Web3().eth.contract(abi=artifact['abi'])
        nonce, minted = self.chain.nonce(deployer), []
        for key in WALLET_KEYS:
            data = token.encode_abi('mint', args=[address_of(key), WALLET_USDC])
            minted.append(self._send(DEPLOYER_KEY, nonce, to=usdc, data=data, gas=MINT_GAS))
            nonce += 1
        for tx_hash in minted:
            self._mined(tx_hash, 'a mint of test USDC')
        return {'usdc': usdc, 'escrow': escrow, 'arbiter': address_of(ARBITER_KEY),
                'guardian': address_of(GUARDIAN_KEY), 'guardianKey': GUARDIAN_KEY,
                'feeRecipient': address_of(FEE_RECIPIENT_KEY), 'maxFeeBps': self.max_fee_bps,
                'arbiterDelay': ARBITER_DELAY,
                'wallets': [{'address': address_of(key), 'key': key,
                             'usdc': self.chain.token_balance(usdc, address_of(key))} for key in WALLET_KEYS]}
