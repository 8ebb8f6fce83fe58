"""Checks of payments on chain (USDC on Base) and the signing of payouts.

`verifier.addresses` is pure and cheap to import; the modules that talk to a JSON-RPC node are the
only code in the project that imports web3.
"""
