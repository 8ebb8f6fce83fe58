"""Payouts signed locally with the escrow key (eth-account): USDC transfers as EIP-1559 transactions."""

import sys

_recursion_limit = sys.getrecursionlimit()
from eth_account import Account  # noqa: E402
sys.setrecursionlimit(_recursion_limit)     # importing eth_account raises it to 100000: deep input could then crash us

from verifier.checks import checksummed  # noqa: E402

TRANSFER = '0xa9059cbb'        # transfer(address,uint256)
TRANSFER_GAS = 100_000


def escrow_address(private_key):
    """The address of the escrow wallet that a private key controls."""
    return Account.from_key(private_key).address


def sign_usdc_transfer(private_key, *, token, to, amount, nonce, chain_id, max_fee_per_gas,
                       max_priority_fee_per_gas, gas=TRANSFER_GAS):
    """A signed USDC transfer: (raw transaction hex, transaction hash hex). Nothing is sent."""
    data = TRANSFER + checksummed(to, 'payee')[2:].lower().rjust(64, '0') + format(int(amount), '064x')
    signed = Account.sign_transaction({
        'type': 2, 'chainId': int(chain_id), 'nonce': int(nonce), 'to': checksummed(token, 'token address'),
        'value': 0, 'data': data, 'gas': int(gas), 'maxFeePerGas': int(max_fee_per_gas),
        'maxPriorityFeePerGas': int(max_priority_fee_per_gas)}, private_key)
    return signed.raw_transaction.to_0x_hex(), signed.hash.to_0x_hex()
