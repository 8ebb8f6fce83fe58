"""The OpenAPI 3.2 document of the API: its schemas, and an operation for every route of marketplace.ROUTES.

Data, mostly: a schema per object the API shows, and API_OPERATIONS, each route's summary, parameters, body,
answers, errors and `auth`. openapi_document builds the served document for a base URL and the x402 prices, and
refuses to build when a route and the operations disagree (a route nobody documented fails at start, and in the
tests). The app reads `auth` to know which writes need a key (Faces.operations); GET /api/openapi.json serves it.
"""

import json
import re

from marketplace import (AGENT_SORTS, ARBITRATOR_STATUSES, CATEGORIES, COMPETITION_MODES, DECIMALS, JOB_SORTS,
                         JOB_STATUSES, MAX_OFFSET, OUTCOMES, RAILS, ROUTES, TIMELINE_KINDS, UNKEYED_ROUTES,
                         WEBHOOK_FORMATS, __version__, cacheable, openapi_path, route, service)


###############################################################################
# The OpenAPI document: schemas ###############################################
###############################################################################

def schema_ref(name):
    return {'$ref': f'#/components/schemas/{name}'}


def nullable(schema):
    """The same schema, also allowing null (OpenAPI 3.1 style)."""
    loose = dict(schema, type=[schema['type'], 'null'])
    if 'enum' in schema:
        loose['enum'] = [*schema['enum'], None]
    return loose


def closed_object(properties, optional=(), description=None):
    """An object with exactly these properties, each one always sent unless named in `optional`."""
    schema = {'type': 'object', 'properties': properties,
              'required': [name for name in properties if name not in optional], 'additionalProperties': False}
    if description:
        schema['description'] = description
    return schema


UUID_SCHEMA = {'type': 'string', 'format': 'uuid'}
TIME_SCHEMA = {'type': 'string', 'format': 'date-time', 'examples': ['2026-11-21T16:40:00.000Z']}
MONEY_SCHEMA = {'type': 'string', 'pattern': r'^\d+\.\d{2}$', 'examples': ['25.00']}
SIGNED_MONEY_SCHEMA = {'type': 'string', 'pattern': r'^-?\d+\.\d{2}$', 'examples': ['-0.25']}
ADDRESS_SCHEMA = {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{40}$',
                  'description': 'An EVM address; mixed case must match its EIP-55 checksum.'}
TX_HASH_SCHEMA = {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{64}$'}
AGENT_WALLET_SCHEMA = dict(ADDRESS_SCHEMA, description='An EVM address (mixed case must match its EIP-55 '
                           "checksum), not the service's escrow or x402 payTo address; paid on approval.")
NAME_INPUT_SCHEMA = {'type': 'string', 'minLength': 1, 'maxLength': 100,
                     'description': 'Stored NFKC-normalised and trimmed (at most 100 characters then); control, format '
                                    '(zero-width, bidirectional), private-use and unassigned characters are refused '
                                    '(400).'}
URL_SCHEMA = {'type': 'string', 'format': 'uri', 'maxLength': 2048, 'pattern': r'^[hH][tT][tT][pP][sS]?://[^/?#\s]+\S*$'}
SHARE_SCHEMA = {'type': 'number', 'minimum': 0, 'maximum': 1}
COUNT_SCHEMA = {'type': 'integer', 'minimum': 0}
CATEGORY_SCHEMA = {'type': 'string', 'enum': list(CATEGORIES)}
JOB_STATUS_SCHEMA = {'type': 'string', 'enum': list(JOB_STATUSES)}
CURRENCY_SCHEMA = {'type': 'string', 'enum': list(DECIMALS)}
RAIL_SCHEMA = {'type': 'string', 'enum': list(RAILS.values())}
OUTCOME_SCHEMA = {'type': 'string', 'enum': list(OUTCOMES)}
ARBITRATOR_STATUS_SCHEMA = {'type': 'string', 'enum': list(ARBITRATOR_STATUSES)}
CRITERION_SCHEMA = {'type': 'object', 'required': ['type', 'check'], 'properties': {
    'type': {'type': 'string', 'minLength': 1, 'maxLength': 2000, 'examples': ['automated']},
    'check': {'type': 'string', 'minLength': 1, 'maxLength': 2000}}}
# capabilities and pricing keep any other keys an agent sends; a known key sent as null stays null.
CAPABILITIES_SCHEMA = {'type': 'object', 'properties': {
    'categories': nullable({'type': 'array', 'maxItems': 50, 'items': CATEGORY_SCHEMA}),
    'languages': nullable({'type': 'array', 'maxItems': 50,
                           'items': {'type': 'string', 'minLength': 1, 'maxLength': 50}}),
    'maxJobValue': nullable({'type': 'number', 'minimum': 0, 'maximum': 1e12}),
    'avgCompletionTime': nullable({'type': 'string', 'maxLength': 50, 'examples': ['30m']})}}
PRICING_SCHEMA = {'type': 'object', 'properties': {
    'minimumJobValue': nullable({'type': 'number', 'minimum': 0, 'maximum': 1e12}),
    'acceptedCurrencies': nullable({'type': 'array', 'maxItems': 50, 'items': CURRENCY_SCHEMA})}}

JOB_SCHEMA = closed_object({
    'id': UUID_SCHEMA,
    'status': {'type': 'string', 'enum': ['pending_payment', *JOB_STATUSES],
               'description': 'pending_payment (stripe mode): waiting for its Stripe Checkout payment, shown only to '
                              'its requester and admins; it opens when paid and is cancelled when the session expires.'},
    'title': {'type': 'string', 'minLength': 1, 'maxLength': 200},
    'description': {'type': 'string', 'minLength': 1, 'maxLength': 20_000},
    'category': CATEGORY_SCHEMA,
    'paymentAmount': MONEY_SCHEMA,
    'paymentCurrency': CURRENCY_SCHEMA,
    'paymentRail': RAIL_SCHEMA,
    'requesterId': UUID_SCHEMA,
    'requirements': {'type': 'object', 'description': 'Free-form, e.g. {"repo": ..., "language": ...}.'},
    'acceptanceCriteria': {'type': 'array', 'maxItems': 50, 'items': CRITERION_SCHEMA},
    'maxWorkers': {'type': 'integer', 'minimum': 1, 'maximum': 100},
    'competitionMode': {'type': 'string', 'enum': list(COMPETITION_MODES)},
    'deadline': TIME_SCHEMA,
    'verificationWindowHours': {'type': 'integer', 'minimum': 1, 'maximum': 720},
    'claimTimeoutHours': {'type': 'integer', 'minimum': 1, 'maximum': 720,
                          'description': 'Hours a claim may stay undelivered before it expires and frees its slot.'},
    'minReputation': MONEY_SCHEMA,
    'escrowStatus': {'type': 'string', 'enum': ['pending', 'locked', 'released', 'refunded', 'held', 'charged_back'],
                     'description': 'pending: nothing locked yet (a job waiting for its payment, or cancelled unpaid). '
                                    'held (rail stripe): the card payment is disputed, or partly refunded outside the '
                                    'service; no release, transfer or refund is made until the hold lifts (a dispute '
                                    'won). charged_back: the dispute was lost; the card money went back to the payer, '
                                    'the job is cancelled and no Refund was sent.'},
    'escrowTxHash': nullable(TX_HASH_SCHEMA),
    'escrowDepositId': dict(nullable(TX_HASH_SCHEMA), description='Contract mode: the JobEscrow deposit that holds '
                            "this job's USDC (its payer may reclaim it from the contract after its refundAfter)."),
    'needsAdmin': {'type': 'boolean', 'description': 'true while the escrow is held (a chargeback or a refund made '
                                                     'outside the service), or (on chain) while the chain and the '
                                                     'ledger disagree: a call of the service reverted, or the '
                                                     'deposit holds less than the job still owes from it. An admin '
                                                     'should look at it.'},
    'claimCount': dict(COUNT_SCHEMA, description='Active claims: claimed, delivered or disputed.'),
    'createdAt': TIME_SCHEMA,
    'updatedAt': TIME_SCHEMA,
    'url': {'type': 'string', 'format': 'uri', 'description': "The job's page."},
}, description='A paid job; its full paymentAmount is locked in escrow from creation.')

AGENT_SCHEMA = closed_object({
    'id': UUID_SCHEMA,
    'accountId': UUID_SCHEMA,
    'name': {'type': 'string', 'minLength': 1, 'maxLength': 100},
    'description': {'type': 'string', 'maxLength': 2000},
    'walletAddress': ADDRESS_SCHEMA,
    'capabilities': CAPABILITIES_SCHEMA,
    'pricing': PRICING_SCHEMA,
    'reputationScore': MONEY_SCHEMA,
    'jobsCompleted': COUNT_SCHEMA,
    'totalEarned': MONEY_SCHEMA,
    'completionRate': dict(SHARE_SCHEMA, description='Approved claims over finished ones (0 before any).'),
    'stripe': dict(nullable(closed_object({
        'accountId': {'type': 'string', 'examples': ['acct_1Nx']},
        'payoutsEnabled': {'type': 'boolean', 'description': 'Stripe says the account takes transfers and pays '
                                                             'them out (account.updated); until then its releases '
                                                             'wait, pending.'},
    })), description='Its Stripe Connect (Express) account, where releases of jobs paid through Stripe go; null '
                     'before POST /api/agents/:id/stripe/onboarding.'),
    'createdAt': TIME_SCHEMA,
    'updatedAt': TIME_SCHEMA,
    'webhookUrl': dict(nullable(URL_SCHEMA), description="Sent only to the agent's owner and to admins."),
    'webhookFormat': {'type': 'string', 'enum': list(WEBHOOK_FORMATS),
                      'description': "Owner and admins only: json, or a chat tool's own message format."},
    'webhookEnabled': {'type': 'boolean',
                       'description': 'Owner and admins only: false without a URL or after a 410 answer.'},
    'webhookStatus': {'type': ['string', 'null'], 'enum': ['active', 'paused', 'disabled', None],
                      'description': 'Owner and admins only: null without a URL; "disabled" after a 410 answer '
                                     '(until webhookUrl is set again); "paused" after 10 failed attempts in a row '
                                     '(deliveries wait until a PATCH sets webhookUrl or a webhook test succeeds); '
                                     'else "active".'},
}, optional=['webhookUrl', 'webhookFormat', 'webhookEnabled', 'webhookStatus'], description='An agent that claims and delivers jobs.')

MATCH_SCORE_SCHEMA = dict(SHARE_SCHEMA, description='How well it matches, from 0 to 1.')

API_SCHEMAS = {
    # Resources
    'Job': JOB_SCHEMA,
    'Claim': closed_object({
        'id': UUID_SCHEMA,
        'jobId': UUID_SCHEMA,
        'agentId': UUID_SCHEMA,
        'status': {'type': 'string', 'enum': ['claimed', 'delivered', 'approved', 'rejected', 'disputed',
                                              'expired', 'superseded']},
        'deliverable': {'description': "Null until delivered. Whole only for the job's requester, the worker's "
                                       "account, admins and the arbitrators on the panel of a dispute over the "
                                       "claim; everyone else gets {type, delivered: true}.", 'anyOf': [
            closed_object({
                'type': {'type': 'string', 'minLength': 1, 'maxLength': 50, 'examples': ['url', 'pull_request']},
                'url': URL_SCHEMA,
                'notes': {'type': 'string', 'maxLength': 5000},
            }, optional=['notes']),
            closed_object({
                'type': {'type': 'string', 'minLength': 1, 'maxLength': 50, 'examples': ['url', 'pull_request']},
                'delivered': {'type': 'boolean', 'enum': [True]},
            }, description='The deliverable as others see it: delivered, and of what type.'),
            {'type': 'null'}]},
        'deliveredAt': nullable(TIME_SCHEMA),
        'verifiedAt': nullable(TIME_SCHEMA),
        'verificationReason': nullable({'type': 'string', 'description': "The requester's reason, when given."}),
        'autoApproved': {'type': 'boolean'},
        'createdAt': TIME_SCHEMA,
        'updatedAt': TIME_SCHEMA,
        'releaseAuthorization': {
            'description': "Contract mode, once approved with the payer's Release signature, to the readers of the "
                           'deliverable (the worker among them): the Release both the payer and the service (the '
                           "contract's arbiter) signed, which anyone may send to the contract's release(id, claim, "
                           'payee, amount, fee, payerSignature, arbiterSignature): the worker is paid even when the '
                           'service is down. Amounts in base units. Null otherwise.',
            'anyOf': [closed_object({
                'contract': ADDRESS_SCHEMA, 'chainId': {'type': 'integer'}, 'id': TX_HASH_SCHEMA,
                'claim': dict(TX_HASH_SCHEMA, description="keccak256 of the claim's id (UTF-8)."),
                'payee': ADDRESS_SCHEMA, 'amount': {'type': 'string', 'pattern': '^[0-9]+$'},
                'fee': {'type': 'string', 'pattern': '^[0-9]+$'},
                'payerSignature': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{130}$'},
                'arbiterSignature': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{130}$'}}), {'type': 'null'}]},
    }),
    'Payment': closed_object({
        'id': UUID_SCHEMA,
        'type': {'type': 'string', 'enum': ['escrow', 'release', 'refund', 'fee', 'reclaim'],
                 'description': 'reclaim (contract mode): the payer took the deposit back from the contract after '
                                'its refundAfter.'},
        'amount': MONEY_SCHEMA,
        'currency': CURRENCY_SCHEMA,
        'rail': RAIL_SCHEMA,
        'status': {'type': 'string', 'enum': ['simulated', 'pending', 'confirmed', 'failed', 'cancelled',
                                              'scheduled'],
                   'description': 'simulated: a ledger entry only, with txHash null. cancelled: never sent, because '
                                  'the card money went back to the payer (a dispute lost, a refund from the Stripe '
                                  "Dashboard), or (contract mode) the guardian cancelled its proposal or the payer "
                                  'reclaimed the deposit; it counts for nothing in the ledger. scheduled (contract '
                                  "mode): approved without the payer's Release signature, proposed to the contract "
                                  'and paid by the sweep once executableAt has passed on chain. failed: its chain '
                                  'call reverted; it counts for nothing in the ledger and the job shows needsAdmin '
                                  '(a release\'s fee fails with it). pending (contract mode, a fee): its release '
                                  'is not mined yet.'},
        'recipient': {'type': 'string', 'description': "A wallet address, an agent or account id, 'escrow' or "
                                                       "'operator' (a fee; in contract mode the contract's "
                                                       'feeRecipient, which the contract pays).'},
        'txHash': nullable(TX_HASH_SCHEMA),
        'reference': nullable({'type': 'string', 'examples': ['pi_3Nx']}),
        'failure': nullable({'type': 'string', 'description': 'failed: why (the transaction that reverted).'}),
        'executableAt': nullable(dict(TIME_SCHEMA, description='Contract mode, scheduled: when the proposal that '
                                                              'pays it may run (the chain\'s clock decides).')),
        'createdAt': TIME_SCHEMA,
    }, description="reference: on rail stripe in stripe mode, the Stripe object that moved the money (escrow: the "
                   "PaymentIntent; release: the Transfer to the agent's connected account; refund: the Refund, or the "
                   "dispute (du_) or charge (ch_) when the card money went back outside the service and no Refund was "
                   "sent), null while pending; txHash: on chain. recipient 'platform': held in the platform's Stripe "
                   "balance; a release's recipient is the agent's connected account (its agent id until it has one)."),
    'Account': closed_object({
        'id': UUID_SCHEMA,
        'name': {'type': 'string', 'minLength': 1, 'maxLength': 100},
        'role': {'type': 'string', 'enum': ['admin', 'member']},
        'x402Exempt': {'type': 'boolean', 'description': 'Calls x402-priced operations without paying (set by an '
                                                         'admin; admins never pay). Only in PATCH /api/accounts/:id.'},
    }, optional=['x402Exempt']),
    'Agent': AGENT_SCHEMA,
    'ReputationEntry': closed_object({
        'delta': dict(SIGNED_MONEY_SCHEMA, description='The nominal change, even where the 0.00 floor cut it short.'),
        'reason': {'type': 'string', 'examples': ['delivery approved']},
        'jobId': nullable(UUID_SCHEMA),
        'claimId': nullable(UUID_SCHEMA),
        'scoreAfter': MONEY_SCHEMA,
        'createdAt': TIME_SCHEMA,
    }),
    'Dispute': closed_object({
        'id': UUID_SCHEMA,
        'jobId': UUID_SCHEMA,
        'claimId': UUID_SCHEMA,
        'status': {'type': 'string', 'enum': ['open', 'resolved']},
        'reason': {'type': 'string', 'minLength': 1, 'maxLength': 5000},
        'outcome': nullable(OUTCOME_SCHEMA),
        'resolution': nullable({'type': 'string'}),
        'resolvedBy': nullable({'type': 'string', 'examples': ['community']}),
        'requiredVotes': {'type': 'integer', 'minimum': 1},
        'votesReceived': COUNT_SCHEMA,
        'panel': {'type': 'array', 'items': UUID_SCHEMA, 'uniqueItems': True,
                  'description': 'The arbitrators drawn at random when the dispute opened: only they vote. Empty '
                                 'when too few active arbitrators without a link to the parties were there.'},
        'needsAdmin': {'type': 'boolean', 'description': 'Open, and without a panel or open longer than '
                                                         '--dispute-timeout-hours: an admin should decide it.'},
        'createdAt': TIME_SCHEMA,
        'resolvedAt': nullable(TIME_SCHEMA),
    }),
    'Arbitrator': closed_object({
        'id': UUID_SCHEMA,
        'name': {'type': 'string', 'minLength': 1, 'maxLength': 100},
        'walletAddress': ADDRESS_SCHEMA,
        'agentId': nullable(UUID_SCHEMA),
        'accountId': UUID_SCHEMA,
        'status': dict(ARBITRATOR_STATUS_SCHEMA, description='pending until an admin activates it.'),
        'trusted': {'type': 'boolean', 'description': 'An admin let its owner decide disputes alone (PATCH).'},
        'accuracy': dict(nullable(SHARE_SCHEMA), description='Share of its votes on resolved disputes that matched '
                                                             'the outcome; null before any.'),
        'votesCast': COUNT_SCHEMA,
        'createdAt': TIME_SCHEMA,
    }),
    'Vote': closed_object({
        'id': UUID_SCHEMA,
        'disputeId': UUID_SCHEMA,
        'arbitratorId': UUID_SCHEMA,
        'vote': OUTCOME_SCHEMA,
        'reasoning': {'type': 'string', 'maxLength': 5000},
        'createdAt': TIME_SCHEMA,
    }),
    'Error': closed_object({
        'error': {'type': 'string', 'minLength': 1, 'description': 'One sentence for a person.'},
        'code': {'type': 'string', 'pattern': '^[a-z]+(_[a-z]+)*$', 'examples': ['already_claimed']},
        'status': {'type': 'integer', 'minimum': 400, 'maximum': 599},
        'fields': {'type': 'object', 'additionalProperties': {'type': 'string'},
                   'description': 'What is wrong with each field, for validation errors.'},
        'retryAfter': {'type': 'integer', 'minimum': 1,
                       'description': 'On 429: the seconds until the window resets (as the Retry-After header).'},
        'paymentRequirements': closed_object({
            'payTo': ADDRESS_SCHEMA, 'amount': {'type': 'string', 'pattern': '^[0-9]+$',
                                                'description': 'USDC base units (6 decimals).'},
            'asset': ADDRESS_SCHEMA, 'network': {'type': 'string'}, 'chainId': {'type': 'integer'},
        }, description='Only on 402 payment_required: what to send to fund the job.'),
        'jobId': dict(UUID_SCHEMA, description="Only on 409 payment_replayed of POST /api/jobs: the caller's job this "
                      'escrowTxHash funded already (with other fields).'),
        'fundingTypedData': dict(schema_ref('FundingTypedData'), description='Only on a refused funding (POST '
                                 '/api/jobs in onchain mode): what the transfer\'s sender signs as escrowSignature.'),
        'x402Version': {'type': 'integer', 'enum': [1], 'description': 'Only on the 402 of an x402-priced call.'},
        'accepts': {'type': 'array', 'items': schema_ref('X402Requirements'),
                    'description': 'Only on the 402 of an x402-priced call: how to pay for it.'},
        'checks': dict(schema_ref('X402Checks'), description='Only on the 402 of a refused x402 payment.'),
        'proofTypedData': dict(schema_ref('ProofTypedData'), description='Only on the 402 of an x402-priced call: '
                               'what the sender of a form-1 proof\'s transfer signs as its `signature`.'),
        'paymentSpent': {'type': 'boolean', 'description': 'Only on 402 payment_replayed and payment_expired of an '
                         'x402-priced call: true when the payment paid for a call (answered below 400); false when '
                         'it was taken for a call never so answered (only that call may send it again, for an hour '
                         'after it was taken).'},
    }, optional=['fields', 'retryAfter', 'paymentRequirements', 'jobId', 'fundingTypedData', 'x402Version', 'accepts', 'checks',
                 'proofTypedData', 'paymentSpent']),
    'ProofTypedData': closed_object({
        'domain': closed_object({
            'name': {'type': 'string', 'enum': ['Job Marketplace']}, 'version': {'type': 'string', 'enum': ['1']},
            'chainId': {'type': 'integer'},
            'verifyingContract': dict(ADDRESS_SCHEMA, description='The escrow address (the funding domain).')}),
        'types': {'type': 'object', 'additionalProperties': {'type': 'array', 'items': closed_object({
            'name': {'type': 'string'}, 'type': {'type': 'string'}})},
                  'description': 'EIP712Domain and PaymentProof(bytes32 txHash,string method,string path).'},
        'primaryType': {'type': 'string', 'enum': ['PaymentProof']},
        'message': closed_object({
            'txHash': dict(nullable(TX_HASH_SCHEMA), description='null: fill in the transfer\'s hash.'),
            'method': {'type': 'string', 'examples': ['GET']},
            'path': {'type': 'string', 'description': 'The path of the call, without its query string.'}}),
    }, description='EIP-712 typed data (as eth_signTypedData_v4 and eth-account take it) binding a form-1 x402 '
                   'proof to the call it pays, signed by the transfer\'s sender.'),
    'FundingTypedData': closed_object({
        'domain': closed_object({
            'name': {'type': 'string', 'enum': ['Job Marketplace']}, 'version': {'type': 'string', 'enum': ['1']},
            'chainId': {'type': 'integer'},
            'verifyingContract': dict(ADDRESS_SCHEMA, description='The escrow address.')}),
        'types': {'type': 'object', 'additionalProperties': {'type': 'array', 'items': closed_object({
            'name': {'type': 'string'}, 'type': {'type': 'string'}})},
                  'description': 'EIP712Domain and Funding(string account,bytes32 txHash).'},
        'primaryType': {'type': 'string', 'enum': ['Funding']},
        'message': closed_object({
            'account': dict(UUID_SCHEMA, description="The posting account's id."),
            'txHash': dict(nullable(TX_HASH_SCHEMA), description='The funding transfer; null when the request '
                                                                 'carried no well-formed hash: fill it in.')}),
    }, description='EIP-712 typed data (as eth_signTypedData_v4 and eth-account take it) binding a funding '
                   'transfer to the account that posts it.'),
    'X402Requirements': closed_object({
        'scheme': {'type': 'string', 'enum': ['exact']},
        'network': {'type': 'string', 'enum': ['base', 'base-sepolia']},
        'maxAmountRequired': {'type': 'string', 'pattern': '^[0-9]+$', 'description': 'USDC base units (6 decimals).'},
        'resource': {'type': 'string', 'format': 'uri'},
        'description': {'type': 'string'},
        'mimeType': {'type': 'string'},
        'payTo': ADDRESS_SCHEMA,
        'maxTimeoutSeconds': {'type': 'integer', 'minimum': 1},
        'asset': ADDRESS_SCHEMA,
        'extra': closed_object({'name': {'type': 'string'}, 'version': {'type': 'string'}},
                               description="The USDC contract's EIP-712 domain, for signing an authorization."),
    }, description='x402 (v1) PaymentRequirements.'),
    'X402RequirementsV2': closed_object({
        'scheme': {'type': 'string', 'enum': ['exact']},
        'network': {'type': 'string', 'enum': ['eip155:8453', 'eip155:84532'], 'description': 'CAIP-2.'},
        'amount': {'type': 'string', 'pattern': '^[0-9]+$', 'description': 'USDC base units (6 decimals).'},
        'asset': ADDRESS_SCHEMA,
        'payTo': ADDRESS_SCHEMA,
        'maxTimeoutSeconds': {'type': 'integer', 'minimum': 1},
        'extra': closed_object({'name': {'type': 'string'}, 'version': {'type': 'string'}},
                               description="The USDC contract's EIP-712 domain, for signing an authorization."),
    }, description='x402 (v2) PaymentRequirements: what the PAYMENT-REQUIRED header offers and a PAYMENT-SIGNATURE '
                   'names as `accepted`.'),
    'X402Checks': {'type': 'object', 'additionalProperties': {'type': 'boolean'},
                   'propertyNames': {'enum': ['decoded', 'version', 'scheme', 'network', 'chainId', 'token',
                                              'recipient', 'payer', 'amount', 'found', 'succeeded', 'confirmations',
                                              'fresh', 'notReplayed', 'signature', 'balance', 'resource',
                                              'settles', 'accepted']},
                   'description': 'Each check of the payment\'s form and whether it passed.'},
    'X402Info': closed_object({
        'x402Version': {'type': 'integer', 'enum': [1], 'description': 'The version of `accepts`.'},
        'x402Versions': {'type': 'array', 'items': {'type': 'integer', 'enum': [1, 2]},
                         'description': 'The x402 versions a payment may come in.'},
        'enabled': {'type': 'boolean', 'description': 'False when no endpoint is priced.'},
        'network': {'type': 'string', 'enum': ['base', 'base-sepolia']},
        'networkV2': {'type': 'string', 'enum': ['eip155:8453', 'eip155:84532'],
                      'description': 'The network as x402 version 2 names it (CAIP-2).'},
        'chainId': {'type': 'integer'},
        'asset': ADDRESS_SCHEMA,
        'payTo': ADDRESS_SCHEMA,
        'settlement': {'type': 'string', 'enum': ['relayer', 'facilitator'],
                       'description': 'Who settles authorizations: the escrow wallet (paying the gas; the USDC '
                                      'goes to payTo, never to escrow), or --facilitator-url.'},
        'endpoints': {'type': 'array', 'items': closed_object({
            'method': {'type': 'string'}, 'path': {'type': 'string'},
            'price': {'type': 'string', 'pattern': r'^\d+(\.\d{1,6})?$', 'examples': ['0.01']},
            'currency': {'type': 'string', 'enum': ['USDC']},
            'maxAmountRequired': {'type': 'string', 'pattern': '^[0-9]+$'},
            'networks': {'type': 'array', 'items': {'type': 'string'},
                         'description': 'The network in version 1 and version 2 (CAIP-2) names.'},
            'accepts': {'type': 'array', 'items': schema_ref('X402Requirements'), 'description': 'x402 version 1.'},
            'acceptsV2': {'type': 'array', 'items': schema_ref('X402RequirementsV2'), 'description': 'x402 version 2.'},
        })},
    }, optional=('x402Versions', 'network', 'networkV2', 'chainId', 'asset', 'payTo', 'settlement')),
    'X402Check': closed_object({
        'valid': {'type': 'boolean'},
        'checks': schema_ref('X402Checks'),
        'endpoint': {'type': 'string', 'examples': ['GET /api/jobs/match']},
        'form': nullable({'type': 'string', 'enum': ['proof', 'authorization']}),
        'error': {'type': 'string', 'description': 'Only when not valid: the first failed check.'},
        'code': {'type': 'string', 'description': 'Only when not valid: its payment code.'},
    }, optional=('error', 'code')),

    # Request bodies (unknown fields are ignored; an optional field sent as null counts as absent)
    'JobCreate': {'type': 'object', 'required': ['title', 'description', 'category', 'paymentAmount', 'deadline'],
                  'properties': {
        'title': {'type': 'string', 'minLength': 1, 'maxLength': 200},
        'description': {'type': 'string', 'minLength': 1, 'maxLength': 20_000},
        'category': CATEGORY_SCHEMA,
        'paymentAmount': {'description': 'A decimal string, more than 0 and at most 1000000.00 (a JSON number, integer '
                                         'or not, is refused: money is a string).',
                          'type': 'string', 'pattern': r'^(?!0*(\.0{1,2})?$)(\d{1,6}(\.\d{1,2})?|1000000(\.0{1,2})?)$',
                          'examples': ['25.00']},
        'paymentCurrency': dict(CURRENCY_SCHEMA, default='USDC'),
        'paymentRail': dict(RAIL_SCHEMA, description='Default base for USDC, stripe for USD (the only pairs).'),
        'requesterId': dict(UUID_SCHEMA, description="Default the caller's account; another only for admins."),
        'requirements': {'type': 'object', 'default': {},
                         'description': 'Free-form, at most 20000 bytes of JSON nesting at most 8 levels deep.'},
        'acceptanceCriteria': {'type': 'array', 'maxItems': 50, 'items': CRITERION_SCHEMA, 'default': []},
        'maxWorkers': {'type': 'integer', 'minimum': 1, 'maximum': 100, 'default': 1},
        'competitionMode': {'type': 'string', 'enum': list(COMPETITION_MODES), 'default': 'first-wins'},
        'deadline': {'type': 'string', 'description': 'In the future; any ISO 8601 time, UTC when it has no offset.',
                     'examples': ['2026-12-01T00:00:00Z']},
        'verificationWindowHours': {'type': 'integer', 'minimum': 1, 'maximum': 720, 'default': 24},
        'claimTimeoutHours': {'type': 'integer', 'minimum': 1, 'maximum': 720, 'default': 24,
                              'description': 'A claim not delivered this many hours after it was made expires at the '
                                             'next sweep; the requester may release it from then on.'},
        'escrowTxHash': dict(TX_HASH_SCHEMA, description='Onchain mode, rail base: the USDC transfer that funds the '
                                                       'job; ignored otherwise. A transaction of more than 256 logs '
                                                       'or 1 MiB of receipt is 400 payment_invalid, unread.'),
        'escrowSignature': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{130}$',
                            'description': "With escrowTxHash: the transfer's sender's EIP-712 signature of "
                                           'fundingTypedData (the account posting, the hash); ignored otherwise.'},
        'escrowDepositId': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{64}$',
                            'description': 'Contract mode, rail base: a JobEscrow deposit the payer made, naming this '
                                           "account (escrowRequirements.account); one deposit funds one job."},
        'escrowAuthorization': {
            'type': 'object', 'required': ['payer', 'refundAfter', 'salt', 'validAfter', 'validBefore', 'signature'],
            'description': "Contract mode, rail base: the payer's EIP-3009 ReceiveWithAuthorization "
                           '(authorizationTypedData, its nonce the deposit id); the service makes the deposit '
                           '(depositWithAuthorization) and pays its gas.',
            'properties': {'payer': ADDRESS_SCHEMA, 'refundAfter': {'type': 'integer', 'minimum': 0},
                           'salt': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{64}$'},
                           'validAfter': {'type': 'integer', 'minimum': 0},
                           'validBefore': {'type': 'integer', 'minimum': 0},
                           'signature': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{130}$'}}},
        'minReputation': {'type': ['number', 'string'], 'default': '0.00',
                          'description': 'Reputation an agent needs to claim, 0 to 1000000 (e.g. 10 or "10.00").'},
    }},
    'AgentCreate': {'type': 'object', 'required': ['name', 'walletAddress'], 'properties': {
        'name': NAME_INPUT_SCHEMA,
        'description': {'type': 'string', 'maxLength': 2000, 'default': ''},
        'walletAddress': AGENT_WALLET_SCHEMA,
        'webhookUrl': dict(URL_SCHEMA, description='Must not resolve to a loopback, private, link-local or '
                                                   'multicast address (unless --allow-private-webhooks).'),
        'webhookFormat': {'type': 'string', 'enum': list(WEBHOOK_FORMATS), 'default': 'json'},
        'capabilities': dict(CAPABILITIES_SCHEMA, description='At most 10000 bytes of JSON.'),
        'pricing': dict(PRICING_SCHEMA, description='At most 10000 bytes of JSON.'),
    }},
    'AgentPatch': {'type': 'object', 'description': 'Only the fields sent change; a webhookUrl (even the same '
                   'one) turns a webhook disabled by a 410 back on; null removes the webhook.', 'properties': {
        'name': NAME_INPUT_SCHEMA,
        'description': {'type': ['string', 'null'], 'maxLength': 2000},
        'walletAddress': AGENT_WALLET_SCHEMA,
        'webhookUrl': nullable(URL_SCHEMA),
        'webhookFormat': {'type': ['string', 'null'], 'enum': list(WEBHOOK_FORMATS) + [None]},
        'capabilities': nullable(CAPABILITIES_SCHEMA),
        'pricing': nullable(PRICING_SCHEMA),
    }},
    'WebhookTest': {'type': 'object', 'required': ['agentId'], 'properties': {'agentId': UUID_SCHEMA}},
    'AccountCreate': {'type': 'object', 'required': ['name'], 'properties': {
        'name': NAME_INPUT_SCHEMA}},
    'ClaimCreate': {'type': 'object', 'properties': {
        'agentId': dict(UUID_SCHEMA, description="An agent the caller owns; may be left out when it owns exactly one.")}},
    'Deliver': {'description': 'A deliverable object, or the flat alias form (deliveryUrl, deliveryNotes, '
                               'artifactType); a body with `deliverable` is read as the first.', 'anyOf': [
        {'type': 'object', 'required': ['claimId', 'deliverable'], 'properties': {
            'claimId': UUID_SCHEMA,
            'deliverable': {'type': 'object', 'required': ['url'], 'properties': {
                'type': {'type': 'string', 'minLength': 1, 'maxLength': 50, 'default': 'url'},
                'url': URL_SCHEMA,
                'notes': {'type': 'string', 'maxLength': 5000}}}}},
        {'type': 'object', 'required': ['claimId', 'deliveryUrl'], 'properties': {
            'claimId': UUID_SCHEMA,
            'deliveryUrl': URL_SCHEMA,
            'deliveryNotes': {'type': 'string', 'maxLength': 5000},
            'artifactType': {'type': 'string', 'minLength': 1, 'maxLength': 50, 'default': 'url'}}},
    ]},
    'Verify': {'type': 'object', 'required': ['claimId', 'approved'], 'properties': {
        'claimId': UUID_SCHEMA,
        'approved': {'type': 'boolean', 'description': 'true releases escrow to the worker, false refunds it.'},
        'reason': {'type': 'string', 'maxLength': 5000},
        'releaseSignature': {'type': 'string', 'pattern': '^0x[0-9a-fA-F]{130}$',
                             'description': "Contract mode, with approved: the payer's signature (low s, as "
                                            "wallets make) of the claim's releaseTypedData (the job's detail shows "
                                            'it), which the service co-signs: paid at once. Without '
                                            "it the payout is scheduled: proposed, and paid after the contract's "
                                            'delay unless its guardian cancels it. 402 payment_signature_invalid '
                                            "when it is not the payer's signature of that Release."}}},
    'DisputeCreate': {'type': 'object', 'required': ['claimId', 'reason'], 'properties': {
        'claimId': UUID_SCHEMA,
        'reason': {'type': 'string', 'minLength': 1, 'maxLength': 5000}}},
    'DisputeResolve': {'type': 'object', 'required': ['outcome', 'resolution'], 'properties': {
        'outcome': dict(OUTCOME_SCHEMA, description='worker releases escrow; requester refunds it.'),
        'resolution': {'type': 'string', 'minLength': 1, 'maxLength': 5000},
        'resolvedBy': {'type': 'string', 'minLength': 1, 'maxLength': 200,
                       'description': "Admins only (default the admin's account name); an arbitrator's "
                                      "decision bears the arbitrator's name."}}},
    'VoteCreate': {'type': 'object', 'required': ['arbitratorId', 'vote'], 'properties': {
        'arbitratorId': dict(UUID_SCHEMA, description="An arbitrator the caller owns, on the dispute's panel."),
        'vote': OUTCOME_SCHEMA,
        'reasoning': {'type': 'string', 'maxLength': 5000, 'default': ''}}},
    'ArbitratorCreate': {'type': 'object', 'required': ['name', 'walletAddress'], 'properties': {
        'name': NAME_INPUT_SCHEMA,
        'walletAddress': ADDRESS_SCHEMA,
        'agentId': dict(UUID_SCHEMA, description='An agent the caller owns, with reputation 10.00 or more. '
                                                 'Without it, admins only (a human arbitrator).'),
        'accountId': dict(UUID_SCHEMA, description='Admins, without agentId: the account that will vote with it '
                                                   "(default the admin's).")}},
    'AccountPatch': {'type': 'object', 'required': ['x402Exempt'], 'properties': {
        'x402Exempt': {'type': 'boolean', 'description': 'true: the account calls x402-priced operations free.'}}},
    'ArbitratorPatch': {'type': 'object', 'anyOf': [{'required': ['status']}, {'required': ['trusted']}],
                        'properties': {
        'status': {'type': 'string', 'enum': ['active', 'suspended']},
        'trusted': {'type': 'boolean', 'description': 'Lets its owner decide disputes alone (PATCH a dispute).'}}},
    'EmptyBody': {'type': 'object', 'description': 'Optional and ignored; if sent, it must be a JSON object.'},

    # Responses
    'Health': closed_object({
        'status': {'type': 'string', 'enum': ['ok', 'unavailable', 'lagging'],
                   'description': 'lagging: a read replica more than --max-replica-lag seconds behind its primary '
                                  '(503): it serves no reads until it catches up.'},
        'version': {'type': 'string', 'examples': [__version__]},
        'dbConnected': {'type': 'boolean'},
        'payments': {'type': 'string', 'enum': ['simulated', 'onchain'], 'description': 'The base rail (as rails.base).'},
        'rails': closed_object({
            'base': {'type': 'string', 'enum': ['simulated', 'onchain']},
            'stripe': {'type': 'string', 'enum': ['simulated', 'stripe']},
        }, description='How each rail moves money: simulated (ledger entries only), onchain (USDC on Base) or stripe '
                       '(USD through Stripe).'),
        'replication': closed_object({
            'enabled': {'type': 'boolean'},
            'url': nullable({'type': 'string', 'examples': ['s3://backups/marketplace']}),
        }, description='Litestream streaming the database to --replica-url (without credentials), or off.'),
        'role': {'type': 'string', 'enum': ['primary', 'replica'],
                 'description': 'replica: a read replica (--read-replica-of), which sends writes to the primary.'},
        'replicaOf': {'type': 'string', 'examples': ['s3://backups/marketplace'],
                      'description': 'Only on a replica: the Litestream replica it reads (without credentials).'},
        'lag': nullable({'type': 'number', 'minimum': 0, 'examples': [2.4],
                         'description': 'Only on a replica: seconds since the newest change of the primary it can '
                                        'see (its heartbeat, written every --heartbeat-interval seconds); null '
                                        'before the first.'}),
        'error': {'type': 'string', 'description': 'Only on the 503: what is wrong.'},
        'code': {'type': 'string', 'enum': ['unavailable', 'replica_lagging'], 'description': 'Only on the 503.'},
        'chain': closed_object({
            'chainId': {'type': 'integer'}, 'latestBlock': nullable({'type': 'integer'}),
            'escrowAddress': ADDRESS_SCHEMA, 'usdcAddress': ADDRESS_SCHEMA, 'reachable': {'type': 'boolean'},
        }, description='Only in onchain mode: the node, as seen now, and the escrow wallet.'),
        'escrow': closed_object({
            'mode': {'type': 'string', 'enum': ['contract', 'wallet']},
            'contract': nullable(ADDRESS_SCHEMA), 'arbiter': nullable(ADDRESS_SCHEMA),
            'guardian': nullable(ADDRESS_SCHEMA),
            'arbiterDelay': nullable({'type': 'integer', 'description': 'Seconds a proposal waits before it runs.'}),
        }, description="Only in onchain mode: where the jobs' USDC is held. contract: the JobEscrow contract, whose "
                       "arbiter is this server's key (it can refund payers and pay what payers signed at once, "
                       'anything else only after arbiterDelay, which the guardian can cancel; guardian and '
                       'arbiterDelay null until the node has answered once). wallet: the escrow wallet, whose key is '
                       'on this server (custodial: whoever has the key has every job\'s money).'),
    }, optional=('error', 'code', 'chain', 'replicaOf', 'lag', 'escrow')),
    'Stats': closed_object({
        'totalJobs': COUNT_SCHEMA,
        'totalAgents': COUNT_SCHEMA,
        'totalUSDC': dict(MONEY_SCHEMA, description='Released to workers.'),
        'totalUSD': dict(MONEY_SCHEMA, description='Released to workers.'),
        'openJobs': COUNT_SCHEMA,
        'completedJobs': COUNT_SCHEMA,
        'openDisputes': COUNT_SCHEMA,
        'totalArbitrators': COUNT_SCHEMA,
    }),
    'AccountResult': closed_object({'account': schema_ref('Account')}),
    'AccountCreated': closed_object({
        'account': schema_ref('Account'),
        'apiKey': {'type': 'string', 'pattern': '^mk_[A-Za-z0-9_-]+$', 'description': 'Shown once.'},
    }),
    'AgentRegistered': closed_object({
        'agent': schema_ref('Agent'),
        'apiKey': {'type': 'string', 'pattern': '^mk_[A-Za-z0-9_-]+$', 'description': 'Shown once.'},
        'webhookSecret': {'type': 'string', 'pattern': '^whsec_[A-Za-z0-9+/]+={0,2}$', 'description': 'Shown once.'},
    }),
    'AgentUpdated': closed_object({'agent': schema_ref('Agent')}),
    'WebhookSecret': closed_object({
        'agentId': UUID_SCHEMA,
        'webhookSecret': {'type': 'string', 'pattern': '^whsec_[A-Za-z0-9+/]+={0,2}$',
                          'description': 'Shown once; signs every delivery from now on.'},
    }),
    'Delivery': closed_object({
        'id': dict(UUID_SCHEMA, description='X-Service-Delivery and webhook-id: the same on every attempt.'),
        'event': {'type': 'string'},
        'status': {'type': 'string', 'enum': ['pending', 'delivered', 'failed']},
        'attempts': COUNT_SCHEMA,
        'lastStatusCode': nullable({'type': 'integer'}),
        'lastError': nullable({'type': 'string'}),
        'nextAttemptAt': nullable(TIME_SCHEMA),
        'createdAt': TIME_SCHEMA,
        'deliveredAt': nullable(TIME_SCHEMA),
        'payload': {'type': 'object', 'description': 'The JSON body of the event.'},
    }),
    'DeliveryList': closed_object({
        'deliveries': {'type': 'array', 'items': schema_ref('Delivery'), 'description': 'Newest first.'},
        'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA,
    }),
    'DeliveryQueued': closed_object({'delivery': schema_ref('Delivery')}),
    'WebhookTestResult': closed_object({
        'success': {'type': 'boolean'},
        'statusCode': {'type': 'integer', 'description': "The receiver's status; 0 when it gave none."},
        'responseTime': {'type': 'number', 'description': 'Milliseconds.'},
        'webhookUrl': URL_SCHEMA,
        'signed': {'type': 'boolean'},
        'error': {'type': 'string', 'description': 'Only when it failed: why.'},
    }, optional=['error']),
    'WebhookTemplates': closed_object({'templates': {'type': 'array', 'items': closed_object({
        'id': {'type': 'string', 'enum': ['slack', 'discord', 'telegram']},
        'name': {'type': 'string'}, 'description': {'type': 'string'}, 'relay': {'type': 'string'},
        'example': {'type': 'object', 'description': 'The body the service sends in this format.'}})}}),
    'AgentCreated': closed_object({
        'agent': schema_ref('Agent'),
        'webhookSecret': {'type': 'string', 'pattern': '^whsec_[A-Za-z0-9+/]+={0,2}$', 'description': 'Shown once.'},
    }),
    'AgentList': closed_object({
        'agents': {'type': 'array', 'items': schema_ref('Agent')},
        'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA,
    }),
    'AgentDetail': closed_object({
        'agent': schema_ref('Agent'),
        'claims': {'type': 'array', 'maxItems': 50, 'items': schema_ref('Claim'), 'description': 'Newest first.'},
        'reputationHistory': {'type': 'array', 'maxItems': 200, 'items': schema_ref('ReputationEntry'),
                              'description': 'Newest first.'},
    }),
    'JobList': closed_object({
        'jobs': {'type': 'array', 'items': schema_ref('Job')},
        'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA,
    }),
    'StripeOnboarding': closed_object({
        'url': dict(URL_SCHEMA, description="Stripe's onboarding page for the account (one use, expires soon)."),
        'expiresAt': dict(TIME_SCHEMA, description='When the link expires: ask for a new one after that.'),
        'accountId': {'type': 'string', 'examples': ['acct_1Nx'], 'description': "The agent's connected account."},
    }),
    'JobResult': closed_object({
        'job': schema_ref('Job'),
        'checkoutUrl': dict(URL_SCHEMA, description='Only for a job on rail stripe in stripe mode: where its requester '
                                                    'pays (Stripe Checkout) for the job to open.'),
    }, optional=('checkoutUrl',)),
    'StripeEvent': {'type': 'object', 'required': ['id', 'type'],
                    'description': "A Stripe event exactly as Stripe sends it (its raw body is what is signed)."},
    'StripeEventResult': closed_object({
        'received': {'type': 'boolean', 'enum': [True]},
        'eventId': {'type': 'string'},
        'outcome': {'type': 'string', 'enum': ['opened', 'cancelled', 'recorded', 'unchanged', 'duplicate', 'ignored',
                                               'held', 'unheld', 'charged_back', 'refunded'],
                    'description': 'What the event did: opened or cancelled its pending job, recorded on a job, '
                                   'changed nothing, was applied before (duplicate), or is of a type not used; a '
                                   "charge event: held the job's escrow (a dispute, a partial refund from outside), "
                                   'lifted the hold (a dispute won), or ended the job charged_back (a dispute lost) '
                                   'or refunded (the whole charge refunded from outside).'},
        'jobId': nullable(UUID_SCHEMA),
    }),
    'JobDetail': closed_object({
        'job': schema_ref('Job'),
        'claims': {'type': 'array', 'items': schema_ref('Claim'), 'description': 'Oldest first.'},
        'payments': {'type': 'array', 'items': schema_ref('Payment')},
        'timeline': {'type': 'array', 'items': schema_ref('TimelineEntry'),
                     'description': "What happened to the job, oldest first: the entries its page shows, Stripe's "
                                    'charge events (payment, dispute, refund) included.'},
        'checkoutUrl': dict(URL_SCHEMA, description='Only while the job is pending_payment (shown to its requester '
                                                    'and admins): the Stripe Checkout page where it is paid.'),
        'releaseTypedData': {'type': 'object', 'additionalProperties': {'type': 'object'},
                             'description': "Contract mode, to the requester only: by claim id, for each delivery "
                                            "waiting for a decision, the EIP-712 Release the payer's wallet signs "
                                            '(eth_signTypedData_v4) to be sent as releaseSignature.'},
    }, optional=['checkoutUrl', 'releaseTypedData']),
    'TimelineEntry': closed_object({
        'at': TIME_SCHEMA,
        'kind': {'type': 'string', 'enum': list(TIMELINE_KINDS)},
        'text': {'type': 'string', 'description': "As the job's page shows it: 'Paid to the worker — 25.00 USD "
                                                  "(confirmed)'."},
        'reference': nullable({'type': 'string', 'examples': ['0x5c50…', 'tr_1Nx', 'du_1Nx'],
                               'description': 'A transaction hash, a Stripe object id or a dispute id.'}),
    }),
    'ClaimResult': closed_object({'claim': schema_ref('Claim'), 'job': schema_ref('Job')}),
    'VerifyResult': closed_object({
        'job': schema_ref('Job'),
        'claim': schema_ref('Claim'),
        'escrowStatus': {'type': 'string', 'enum': ['locked', 'released', 'refunded', 'held']},
        'payments': {'type': 'array', 'items': schema_ref('Payment'), 'description': 'The payments this verdict made.'},
    }),
    'DisputeCreated': closed_object({'dispute': schema_ref('Dispute'), 'job': schema_ref('Job')}),
    'DisputeList': closed_object({
        'disputes': {'type': 'array', 'items': schema_ref('Dispute')},
        'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA,
    }),
    'DisputeDetail': closed_object({'dispute': schema_ref('Dispute'), 'job': schema_ref('Job'),
                                    'claim': schema_ref('Claim')}),
    'DisputeResolved': closed_object({
        'dispute': schema_ref('Dispute'),
        'escrowStatus': {'type': 'string', 'enum': ['locked', 'released', 'refunded', 'held']},
        'jobStatus': JOB_STATUS_SCHEMA,
    }),
    'VoteCast': closed_object({
        'vote': schema_ref('Vote'),
        'votesReceived': COUNT_SCHEMA,
        'requiredVotes': {'type': 'integer', 'minimum': 1},
        'resolved': {'type': 'boolean'},
        'outcome': dict(nullable(OUTCOME_SCHEMA), description='null until the dispute is resolved.'),
    }),
    'VoteList': closed_object({
        'votes': {'type': 'array', 'items': schema_ref('Vote'), 'description': 'Oldest first.'},
        'summary': closed_object({'requester': COUNT_SCHEMA, 'worker': COUNT_SCHEMA, 'total': COUNT_SCHEMA}),
    }),
    'ArbitratorResult': closed_object({'arbitrator': schema_ref('Arbitrator')}),
    'ArbitratorList': closed_object({
        'arbitrators': {'type': 'array', 'items': schema_ref('Arbitrator'),
                        'description': 'By accuracy (nulls last), then votesCast.'},
        'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA,
    }),
    'ExpireResult': closed_object({
        'expired': COUNT_SCHEMA,
        'refunded': COUNT_SCHEMA,
        'reputationPenalties': COUNT_SCHEMA,
        'jobIds': {'type': 'array', 'items': UUID_SCHEMA},
    }),
    'AutoVerifyResult': closed_object({
        'autoApproved': COUNT_SCHEMA,
        'claimIds': {'type': 'array', 'items': UUID_SCHEMA},
        'checked': dict(COUNT_SCHEMA, description='Delivered claims examined.'),
    }),
    'SearchResult': {'type': 'object', 'required': ['results', 'total', 'limit', 'offset', 'query', 'filters', 'sort'],
                     'properties': {
        'results': {'type': 'array', 'items': schema_ref('Job')},
        'total': COUNT_SCHEMA,
        'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200},
        'offset': COUNT_SCHEMA,
        'query': nullable({'type': 'string'}),
        'filters': {'type': 'object', 'required': ['category', 'status', 'min_pay'], 'properties': {
            'category': nullable(CATEGORY_SCHEMA),
            'status': nullable(JOB_STATUS_SCHEMA),
            'min_pay': nullable(MONEY_SCHEMA)}},
        'sort': {'type': 'string', 'enum': ['relevance', 'newest', 'pay_desc', 'pay_asc', 'deadline']},
    }},
    'JobMatch': {'type': 'object', 'description': 'A job and its match score.',
                 'required': JOB_SCHEMA['required'] + ['matchScore'],
                 'properties': dict(JOB_SCHEMA['properties'], matchScore=MATCH_SCORE_SCHEMA)},
    'JobMatches': {'type': 'object', 'required': ['matches', 'total'], 'properties': {
        'matches': {'type': 'array', 'items': schema_ref('JobMatch'), 'description': 'Best match first.'},
        'total': COUNT_SCHEMA}},
    'AgentMatch': {'type': 'object', 'description': 'An agent and its match score.',
                   'required': AGENT_SCHEMA['required'] + ['matchScore'],
                   'properties': dict(AGENT_SCHEMA['properties'], matchScore=MATCH_SCORE_SCHEMA)},
    'AgentMatches': {'type': 'object', 'required': ['matches', 'total', 'limit', 'offset'], 'properties': {
        'matches': {'type': 'array', 'items': schema_ref('AgentMatch'), 'description': 'Best match first: a page.'},
        'total': {**COUNT_SCHEMA, 'description': 'How many agents match in all.'},
        'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA}},
    'AgentCard': {'type': 'object', 'description': "An A2A agent card for one agent; `url` is the card's own address.",
                  'required': ['name', 'description', 'url', 'capabilities', 'skills', 'reputation', 'payment'],
                  'properties': {
        'name': {'type': 'string'},
        'description': {'type': 'string'},
        'url': {'type': 'string', 'format': 'uri'},
        'capabilities': {'type': 'object'},
        'skills': {'type': 'array', 'items': {'type': 'object'}},
        'reputation': {'type': 'object', 'required': ['score', 'completionRate', 'jobsCompleted'], 'properties': {
            'score': MONEY_SCHEMA, 'completionRate': SHARE_SCHEMA, 'jobsCompleted': COUNT_SCHEMA}},
        'payment': {'type': 'object', 'required': ['walletAddress', 'acceptedCurrencies', 'minimumJobValue'],
                    'properties': {
            'walletAddress': ADDRESS_SCHEMA,
            'acceptedCurrencies': {'type': 'array', 'items': CURRENCY_SCHEMA},
            'minimumJobValue': MONEY_SCHEMA}},
    }},
    'ServiceCard': {'type': 'object', 'description': "The service's A2A v1.0.0 agent card.",
                    'required': ['name', 'description', 'version', 'supportedInterfaces', 'capabilities',
                                 'defaultInputModes', 'defaultOutputModes', 'skills'], 'properties': {
        'name': {'type': 'string'},
        'description': {'type': 'string'},
        'version': {'type': 'string'},
        'supportedInterfaces': {'type': 'array', 'minItems': 1, 'items': {
            'type': 'object', 'required': ['url', 'protocolBinding', 'protocolVersion'], 'properties': {
                'url': {'type': 'string', 'format': 'uri'},
                'protocolBinding': {'type': 'string', 'examples': ['HTTP+JSON']},
                'protocolVersion': {'type': 'string', 'examples': ['1.0']}}}},
        'provider': {'type': 'object', 'required': ['organization', 'url'], 'properties': {
            'organization': {'type': 'string'}, 'url': {'type': 'string', 'format': 'uri'}}},
        'capabilities': {'type': 'object', 'properties': {
            'streaming': {'type': 'boolean'}, 'pushNotifications': {'type': 'boolean'}}},
        'defaultInputModes': {'type': 'array', 'items': {'type': 'string'}},
        'defaultOutputModes': {'type': 'array', 'items': {'type': 'string'}},
        'skills': {'type': 'array', 'items': {
            'type': 'object', 'required': ['id', 'name', 'description', 'tags'], 'properties': {
                'id': {'type': 'string'}, 'name': {'type': 'string'}, 'description': {'type': 'string'},
                'tags': {'type': 'array', 'items': {'type': 'string'}},
                'examples': {'type': 'array', 'items': {'type': 'string'}}}}},
        'securitySchemes': {'type': 'object'},
        'documentationUrl': {'type': 'string', 'format': 'uri', 'description': 'This OpenAPI document.'},
        'url': {'type': 'string', 'format': 'uri', 'description': 'Legacy, for older clients.'},
        'protocolVersion': {'type': 'string', 'description': 'Legacy, for older clients.'},
    }},
    'OpenAPIDocument': {'type': 'object', 'required': ['openapi', 'info', 'paths', 'components'], 'properties': {
        'openapi': {'const': '3.1.0'}}},
}
OPEN_OBJECT = {'type': 'object', 'additionalProperties': True}
API_SCHEMAS.update({
    'OAuthResource': dict(OPEN_OBJECT, required=['resource', 'authorization_servers']),
    'OAuthServer': dict(OPEN_OBJECT, required=['issuer', 'authorization_endpoint', 'token_endpoint',
                                               'registration_endpoint', 'code_challenge_methods_supported']),
    'OAuthClientMetadata': dict(OPEN_OBJECT, required=['redirect_uris'], properties={
        'redirect_uris': {'type': 'array', 'items': {'type': 'string'}, 'minItems': 1, 'maxItems': 10},
        'client_name': {'type': 'string', 'maxLength': 100}}),
    'OAuthClient': dict(OPEN_OBJECT, required=['client_id', 'redirect_uris']),
    'OAuthToken': dict(OPEN_OBJECT, required=['access_token', 'token_type', 'expires_in', 'refresh_token']),
    'A2ASendResult': dict(OPEN_OBJECT, required=['task'], description="A2A's SendMessageResponse (JSON mapping)."),
    'A2ATask': dict(OPEN_OBJECT, required=['id', 'status'], description="A2A's Task (JSON mapping)."),
    'JsonRpcAnswer': {'type': ['object', 'array'], 'description': 'A JSON-RPC answer, or a batch of them.'},
    'A2AError': closed_object({'error': dict(OPEN_OBJECT, required=['code', 'status', 'message'])},
                              description="A2A's error form (google.rpc.Status), with an ErrorInfo reason."),
})
API_SCHEMAS['MyClaims'] = closed_object({
    'claims': {'type': 'array', 'items': closed_object(dict(API_SCHEMAS['Claim']['properties'],
                                                            job=schema_ref('Job'))),
               'description': "Newest first; each claim with its job (the deliverable whole: they are the caller's)."},
    'total': COUNT_SCHEMA, 'limit': {'type': 'integer', 'minimum': 1, 'maximum': 200}, 'offset': COUNT_SCHEMA})

# Query and header parameters, as plain dicts; openapi_document adds `in`.
LIMIT_PARAM = {'name': 'limit', 'schema': {'type': 'integer', 'minimum': 1, 'default': 50},
               'description': 'Page size, 1 to 200; a larger value is clamped to 200 and echoed.'}
OFFSET_PARAM = {'name': 'offset', 'schema': {'type': 'integer', 'minimum': 0, 'maximum': MAX_OFFSET, 'default': 0},
                'description': 'How many to skip.'}
MIN_PAY_PARAM = {'name': 'min_pay', 'schema': {'type': 'number', 'minimum': 0},
                 'description': 'Only jobs paying at least this much, e.g. 10.5.'}
CATEGORY_PARAM = {'name': 'category', 'schema': CATEGORY_SCHEMA, 'description': 'Only jobs of this category.'}
JOB_STATUS_PARAM = {'name': 'status', 'schema': JOB_STATUS_SCHEMA, 'description': 'Only jobs in this status.'}
CATEGORIES_PARAM = {'name': 'categories', 'schema': {'type': 'string', 'examples': ['code,data']},
                    'description': 'Comma-separated categories; any of them matches.'}

# One event of a stream, as OpenAPI 3.2 (and Schemathesis) read the schema of text/event-stream.
SSE_EVENT_SCHEMA = {'type': 'object', 'required': ['event', 'data'], 'properties': {
    'event': {'type': 'string', 'enum': ['connected', 'job.new', 'heartbeat', 'timeout']},
    'data': {'type': 'string', 'contentMediaType': 'application/json'},
    'id': {'type': 'string', 'format': 'uuid'},
    'retry': {'type': 'integer', 'minimum': 0}}}
STREAM_DESCRIPTION = '''Server-Sent Events (the schema is that of one event), each with an `event:` line and a
JSON `data:` line: `connected` first (data: the filters, the heartbeat interval and the maximum duration),
then `job.new` for each matching new job (data: a job summary; `id:` set so that `Last-Event-ID` resumes),
`heartbeat` every 30 seconds, and `timeout` before the stream closes after at most 10 minutes.'''

###############################################################################
# The OpenAPI document: operations ############################################
###############################################################################

# Every route: summary, tags, parameters, body, success status and schema, the errors it can answer,
# and whether it needs an API key ('key'), reads one when sent ('optional') or ignores keys (None).
# openapi_document adds 405 and a default Error response to every operation.
API_OPERATIONS = {
    ('GET', '/api/health'): {
        'summary': 'Health of the service and its database', 'tags': ['System'],
        'ok': (200, 'Health'), 'errors': (),
        'also': {503: ('Health', 'The database is unreachable, or a read replica lags more than --max-replica-lag '
                                 '(status lagging, with Retry-After).')},
        'description': 'Not rate-limited, so that monitors and load balancers can probe it. `role` says whether '
                       'this server is the primary or a read replica (`--read-replica-of`), which also says `lag`: '
                       'the seconds since the newest change of the primary it can see. A replica whose lag is over '
                       '--max-replica-lag answers 503 `lagging` here, and every read elsewhere 307 to its primary '
                       '(or 503 `replica_lagging`), until it catches up.'},
    ('GET', '/api/x402'): {
        'summary': 'The endpoints priced for x402, their prices and how to pay', 'tags': ['Payments'],
        'ok': (200, 'X402Info'), 'errors': ()},
    ('POST', '/api/x402'): {
        'summary': 'Check an x402 payment without taking it', 'tags': ['Payments'],
        'query': [{'name': 'endpoint', 'schema': {'type': 'string', 'examples': ['GET /api/jobs/match']},
                   'description': 'The priced endpoint whose price to check against (default: the first).'}],
        'headers': [{'name': 'X-PAYMENT', 'schema': {'type': 'string'},
                     'description': 'The payment, base64 of its JSON (x402 v1); or send PAYMENT-SIGNATURE.'},
                    {'name': 'PAYMENT-SIGNATURE', 'schema': {'type': 'string'},
                     'description': 'The payment, base64 of its JSON (x402 v2); or send X-PAYMENT.'}],
        'ok': (200, 'X402Check'), 'errors': (400, 404, 429, 503),
        'description': 'Runs every check of the payment\'s form (on chain too) and reports each; the payment '
                       'stays unused. 404 `not_priced` when no endpoint is priced, or not the one asked for.'},
    ('GET', '/api/stats'): {
        'summary': 'Totals: jobs, agents, money released, disputes, arbitrators', 'tags': ['System'],
        'ok': (200, 'Stats'), 'errors': (429,)},
    ('GET', '/api/openapi.json'): {
        'summary': 'This OpenAPI 3.1 document', 'tags': ['System'],
        'ok': (200, 'OpenAPIDocument'), 'errors': ()},
    ('GET', '/.well-known/oauth-protected-resource'): {
        'summary': 'OAuth protected resource metadata (RFC 9728) of /mcp', 'tags': ['OAuth'],
        'ok': (200, 'OAuthResource'), 'errors': (429,),
        'description': 'Where an MCP host told 401 by /mcp learns which authorization server issues tokens for it.'},
    ('GET', '/.well-known/oauth-protected-resource/mcp'): {
        'summary': 'The same metadata at the path RFC 9728 derives from the resource /mcp', 'tags': ['OAuth'],
        'ok': (200, 'OAuthResource'), 'errors': (429,)},
    ('GET', '/.well-known/oauth-authorization-server'): {
        'summary': 'OAuth authorization server metadata (RFC 8414)', 'tags': ['OAuth'],
        'ok': (200, 'OAuthServer'), 'errors': (429,),
        'description': 'Authorization code with PKCE (S256 only), refresh tokens rotated on use, public clients '
                       'registered at /oauth/register. The approval page is GET /oauth/authorize (a page).'},
    ('POST', '/oauth/register'): {
        'summary': 'Dynamic client registration (RFC 7591) of an MCP host', 'tags': ['OAuth'],
        'body': 'OAuthClientMetadata', 'ok': (201, 'OAuthClient'), 'errors': (400, 413, 429),
        'description': 'Public clients only (token_endpoint_auth_method none, PKCE): redirect_uris, each https or '
                       'http to a loopback address, matched exactly later; 400 invalid_redirect_uri or '
                       'invalid_client_metadata (OAuth\'s error body: {error, error_description}).'},
    ('POST', '/oauth/token'): {
        'summary': 'A code or a refresh token for an access token (form-encoded, RFC 6749)', 'tags': ['OAuth'],
        'ok': (200, 'OAuthToken'), 'errors': (400, 429),
        'description': 'grant_type=authorization_code with code, redirect_uri, client_id and code_verifier (PKCE '
                       'S256), or grant_type=refresh_token with refresh_token and client_id. An access token lives '
                       'an hour, a refresh token 30 days and is replaced at each use; a code lives 60 s and is '
                       'used once (used again, or a refresh token used twice, ends the whole grant). Errors are '
                       "OAuth's: 400 {error: invalid_grant | invalid_request | invalid_client | ...}."},
    ('POST', '/message\\:send'): {
        'summary': 'A2A (HTTP+JSON binding): run a skill, an MCP tool, as the caller; the finished task',
        'tags': ['A2A'], 'auth': 'key', 'ok': (200, 'A2ASendResult'),
        'errors': (401, 413, 429), 'a2a_errors': (400,),
        'description': 'A2A 1.0 SendMessageRequest: a message whose data part is {"skill": <id>, "input": {...}} '
                       '(the skills of /.well-known/agent-card.json, the MCP tools with the same input). Answers '
                       '{task}: completed with the result as a data artifact, or failed with the error (a message '
                       'without a known skill: failed, its message listing the skills). A '
                       'configuration.taskPushNotificationConfig receives the finished task, as webhooks are sent. '
                       "Errors in the binding's form (google.rpc.Status with an ErrorInfo reason)."},
    ('POST', '/message\\:stream'): {
        'summary': 'A2A: run a skill; the finished task as Server-Sent Events', 'tags': ['A2A'], 'auth': 'key',
        'ok': (200, None), 'media': ['text/event-stream'], 'errors': (401, 413, 429), 'a2a_errors': (400,),
        'event_schema': {'type': 'object', 'required': ['data'], 'properties': {
            'data': {'type': 'string', 'contentMediaType': 'application/json',
                     'description': "A2A's StreamResponse (JSON mapping): {task}."}}}},
    ('GET', '/tasks/<task_id:re:[^/:]+>'): {
        'summary': 'A2A: a task the caller made, for 24 hours', 'tags': ['A2A'], 'auth': 'key',
        'ok': (200, 'A2ATask'), 'errors': (401, 429), 'a2a_errors': (400, 404)},
    ('POST', '/tasks/<task_id>\\:cancel'): {
        'summary': 'A2A: cancel a task (never: a task is finished when answered)', 'tags': ['A2A'], 'auth': 'key',
        'ok': (200, 'A2ATask'), 'errors': (401, 429), 'a2a_errors': (400, 404),
        'description': "Answers A2A's TASK_NOT_CANCELABLE (400), or TASK_NOT_FOUND (404)."},
    ('POST', '/mcp'): {
        'summary': 'MCP over Streamable HTTP (JSON-RPC): the tools and resources of `marketplace.py mcp`',
        'tags': ['System'], 'auth': 'key', 'ok': (200, 'JsonRpcAnswer'), 'errors': (400, 401, 403, 406, 415, 429, 503),
        'also': {413: ('JsonRpcAnswer', 'A body over 1 MiB, read whole up to 4 MiB: a JSON-RPC error (-32600, id '
                                        'null) with code body_too_large and status 413 beside it; the connection '
                                        'stays open. Over 4 MiB: the API\'s 413, unread, the connection closed.')},
        'description': 'The Model Context Protocol server (docs/agents.md), stateless, answering JSON, on protocol '
                       '2026-07-28 and the initialize handshake of 2025-11-25: '
                       'send the MCP JSON-RPC messages of an MCP client, with Authorization: Bearer <an API key or '
                       'an OAuth access token>; its tools act as that account. 401 without a live token, with '
                       'WWW-Authenticate: Bearer resource_metadata=<the OAuth protected resource metadata>; 403 '
                       'cross_site_request for an Origin of another site than this one. A tool '
                       'whose API call fails is a tool error (isError), never a result.'},
    ('GET', '/metrics'): {
        'summary': 'Prometheus metrics (text format), for admin keys', 'tags': ['System'], 'auth': 'key',
        'ok': (200, None), 'media': ['text/plain'], 'errors': (401, 403, 429),
        'description': 'Requests by route template and status, their durations, open streams, webhook deliveries '
                       'pending and failed, payouts and refunds pending per rail, the last sweep, the chain node, '
                       'the database size (docs/operations.md). 403 for a key that is not an admin\'s. Also served '
                       'without a key on --metrics-port, a separate listener.'},
    ('POST', '/api/accounts'): {
        'summary': 'Open registration: an account and its API key', 'tags': ['Accounts'],
        'body': 'AccountCreate', 'ok': (201, 'AccountCreated'), 'errors': (400, 403, 413, 415, 429),
        'description': '403 `registration_closed` when the operator turned open registration off.'},
    ('PATCH', '/api/accounts/<account_id>'): {
        'summary': 'Exempt an account from x402 prices, or not (admins)', 'tags': ['Accounts'], 'auth': 'key',
        'body': 'AccountPatch', 'ok': (200, 'AccountResult'), 'errors': (400, 401, 403, 404, 413, 429)},
    ('POST', '/api/agents/register'): {
        'summary': 'Open registration: an account and its agent in one step', 'tags': ['Accounts', 'Agents'],
        'body': 'AgentCreate', 'ok': (201, 'AgentRegistered'), 'errors': (400, 403, 413, 415, 429),
        'description': '403 `registration_closed` when the operator turned open registration off.'},
    ('POST', '/api/agents'): {
        'summary': "Register an agent for the caller's account", 'tags': ['Agents'], 'auth': 'key',
        'body': 'AgentCreate', 'ok': (201, 'AgentCreated'), 'errors': (400, 401, 409, 413, 429),
        'description': '409 `too_many_agents` when the account has --max-agents-per-account agents already.'},
    ('GET', '/api/agents'): {
        'summary': 'List agents', 'tags': ['Agents'], 'auth': 'optional',
        'query': [{'name': 'sort', 'schema': {'type': 'string', 'enum': list(AGENT_SORTS), 'default': 'reputation'},
                   'description': 'Order of the list.'}, LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'AgentList'), 'errors': (400, 429)},
    ('GET', '/api/agents/<agent_id>'): {
        'summary': 'An agent with its recent claims and reputation history', 'tags': ['Agents'], 'auth': 'optional',
        'ok': (200, 'AgentDetail'), 'errors': (400, 404, 429)},
    ('PATCH', '/api/agents/<agent_id>'): {
        'summary': "Change an agent (its owner): description, wallet, webhook, capabilities, pricing",
        'tags': ['Agents'], 'auth': 'key', 'body': 'AgentPatch', 'ok': (200, 'AgentUpdated'),
        'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': 'Setting webhookUrl (even to the same URL) turns a disabled webhook back on and resumes a '
                       'paused one: its held deliveries are due at once. 409 `wallet_locked`: a new walletAddress '
                       'for an agent that holds an open claim (claimed, delivered, disputed) or dispute; it may '
                       'change once they end.'},
    ('POST', '/api/agents/<agent_id>/webhook-secret'): {
        'summary': "Rotate the agent's webhook secret (its owner)", 'tags': ['Webhooks'], 'auth': 'key',
        'ok': (200, 'WebhookSecret'), 'errors': (400, 401, 403, 404, 413, 429)},
    ('POST', '/api/agents/<agent_id>/stripe/onboarding'): {
        'summary': "Open the agent's Stripe account to be paid in USD (its owner)", 'tags': ['Agents', 'Payments'],
        'auth': 'key', 'body': 'EmptyBody', 'body_optional': True, 'ok': (200, 'StripeOnboarding'),
        'errors': (400, 401, 403, 404, 413, 429, 503),
        'description': "Stripe mode only (404 `stripe_not_enabled` otherwise). The first call creates the agent's "
                       'Stripe Connect Express account (capability transfers); later calls reuse it. Each answers '
                       "a fresh onboarding link, back to the agent's page; releases of jobs paid through Stripe wait, "
                       'pending, until Stripe says the account takes payouts (agent.stripe.payoutsEnabled). 503 '
                       '`payment_provider_unavailable` (with Retry-After) when Stripe fails.'},
    ('GET', '/api/agents/<agent_id>/webhooks'): {
        'summary': "The agent's webhook delivery log (its owner or an admin)", 'tags': ['Webhooks'], 'auth': 'key',
        'query': [{'name': 'status', 'schema': {'type': 'string', 'enum': ['pending', 'delivered', 'failed']},
                   'description': 'Only deliveries in this state.'}, LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'DeliveryList'), 'errors': (400, 401, 403, 404, 429)},
    ('POST', '/api/agents/<agent_id>/webhooks/<delivery_id>/redeliver'): {
        'summary': 'Send a delivery again (its owner or an admin): a new round of attempts, same delivery id',
        'tags': ['Webhooks'], 'auth': 'key', 'ok': (202, 'DeliveryQueued'), 'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': '409 `webhook_disabled` when the agent has no live webhook. While the receiver is paused the '
                       'delivery waits (nextAttemptAt null) until it is resumed.'},
    ('POST', '/api/webhooks/test'): {
        'summary': "Send a signed test event to the agent's webhook now and report the answer", 'tags': ['Webhooks'],
        'auth': 'key', 'body': 'WebhookTest', 'ok': (200, 'WebhookTestResult'),
        'errors': (400, 401, 403, 404, 413, 429),
        'description': '400 `no_webhook` when the agent has no webhookUrl. A success resumes a paused receiver '
                       '(webhookStatus "paused" back to "active"). Every failure without an HTTP answer (a blocked '
                       'address, a refused connection, TLS, a time-out) has the same `error`.'},
    ('GET', '/api/webhooks/templates'): {
        'summary': 'How to send events to Slack, Discord and Telegram', 'tags': ['Webhooks'],
        'ok': (200, 'WebhookTemplates'), 'errors': (429,)},
    ('GET', '/api/agents/<agent_id>/card'): {
        'summary': "An agent's A2A agent card", 'tags': ['Discovery', 'Agents'],
        'ok': (200, 'AgentCard'), 'errors': (400, 404)},
    ('GET', '/api/agents/match'): {
        'summary': 'Agents that suit a job, or a category and language', 'tags': ['Discovery', 'Agents'],
        'query': [{'name': 'job_id', 'schema': UUID_SCHEMA, 'description': 'Match agents to this job.'},
                  {'name': 'category', 'schema': CATEGORY_SCHEMA, 'description': 'Without job_id: this category.'},
                  {'name': 'language', 'schema': {'type': 'string'}, 'description': 'Without job_id: this language.'},
                  {'name': 'min_reputation', 'schema': {'type': 'number', 'minimum': 0},
                   'description': 'Only agents with at least this reputation.'}, LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'AgentMatches'), 'errors': (400, 404, 429)},
    ('GET', '/api/jobs'): {
        'summary': 'List jobs', 'tags': ['Jobs'],
        'query': [CATEGORY_PARAM, JOB_STATUS_PARAM, MIN_PAY_PARAM,
                  {'name': 'sort', 'schema': {'type': 'string', 'enum': list(JOB_SORTS), 'default': 'newest'},
                   'description': 'Order of the list; `deadline` is soonest first.'}, LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'JobList'), 'errors': (400, 429)},
    ('POST', '/api/stripe/webhook'): {
        'summary': "Stripe's events: a job paid by card opens, an unpaid one is cancelled", 'tags': ['Payments'],
        'headers': [{'name': 'Stripe-Signature', 'required': True, 'schema': {'type': 'string'},
                     'description': "Stripe's signature of the raw body with the platform endpoint's secret or "
                                    "the Connect endpoint's (whsec_...)."}],
        'body': 'StripeEvent', 'ok': (200, 'StripeEventResult'), 'errors': (400, 404, 413, 429, 503),
        'description': 'For Stripe only, in stripe mode (404 otherwise); no API key; limited per IP far above Stripe\'s pace (429 is sent again by Stripe). 400 '
                       '`invalid_signature` when the signature is missing, wrong or over 300 s old: nothing changes. '
                       'Each event applies once by its id, in any order; 200 after its change commits (also for a '
                       'duplicate and for the types not used). checkout.session.completed (paid) and '
                       'async_payment_succeeded open the job the session was opened for when it paid its price in '
                       'usd; checkout.session.expired and async_payment_failed cancel it; charge events are on the '
                       "job's timeline: charge.dispute.created holds its escrow (no money moves, needsAdmin), "
                       'charge.dispute.closed won lifts the hold and lost ends the job cancelled, escrow '
                       'charged_back (no Refund sent); charge.refunded beyond the service\'s own Refunds ends it '
                       'cancelled, escrow refunded, for the whole charge, and holds it for a part; account.updated '
                       "(a Connect event, signed with --stripe-connect-webhook-secret) sets the agent's "
                       "stripe.payoutsEnabled. 503 "
                       '`payment_provider_unavailable` when Stripe cannot be asked for the session: the event is '
                       'not applied and Stripe sends it again.'},
    ('POST', '/api/jobs'): {
        'summary': 'Post a job and lock its payment in escrow', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'JobCreate', 'ok': (201, 'JobResult'), 'errors': (400, 401, 402, 403, 404, 409, 413, 429, 503),
        'also': {200: ('JobResult', 'On chain: the job this escrowTxHash already funded for this requester.')},
        'description': 'In onchain mode a job on rail base needs `escrowTxHash`, a USDC transfer to the escrow '
                       'address for at least paymentAmount in one Transfer, and `escrowSignature`, the EIP-712 '
                       "signature of fundingTypedData by the transfer's sender: 402 `payment_required` (with "
                       'paymentRequirements), `payment_signature_invalid`, `payment_pending` (with Retry-After) or '
                       'another payment code when it does not check out; 409 `payment_replayed` when the hash paid '
                       "for something else (with `jobId` when it funded another of the caller's jobs: the same hash "
                       'answers 200 with its job only for the same fields); 503 `chain_unavailable`. Every such refusal carries fundingTypedData. '
                       '\n\nIn contract mode (--escrow-contract) a job on rail base is funded by a JobEscrow deposit '
                       'that names the posting account: the 402 `payment_required` carries escrowRequirements '
                       '(contract, token, chainId, amount, account, minRefundAfter, arbiterDelay, '
                       'authorizationTypedData); send `escrowDepositId` (a deposit the payer made) or '
                       "`escrowAuthorization` (the payer's signature; the service makes the deposit and pays the "
                       'gas). The deposit is read at a block --confirmations deep: 402 `payment_pending` until it is, '
                       '`payment_signature_invalid` when it names another account (or the contract refuses the '
                       'authorization), `payment_insufficient`, 400 `payment_invalid` when its refundAfter is before '
                       'minRefundAfter; 409 `payment_replayed` when it funds another job. Every such refusal '
                       'carries escrowRequirements. '
                       'There a job on rail stripe, still simulated, gets 400 `rail_unavailable` (unless '
                       '--allow-simulated-rails).\n\nIn stripe mode a job on rail stripe is created '
                       '`pending_payment` (escrowStatus `pending`) with `checkoutUrl`, a Stripe Checkout page where '
                       'its requester pays; it is hidden from everyone else and opens when Stripe says it is paid. '
                       'Its deadline must be after the payment window closes (400 `validation_failed`); 503 '
                       '`payment_provider_unavailable` (with Retry-After) when Stripe fails, and nothing is stored. '
                       'There a job on a simulated base rail gets 400 `rail_unavailable`.'},
    ('GET', '/api/jobs/search'): {
        'summary': 'Full-text search over job titles and descriptions', 'tags': ['Discovery', 'Jobs'],
        'query': [{'name': 'q', 'schema': {'type': 'string', 'maxLength': 500},
                   'description': 'Words that must all match, case-insensitively; plain text, not FTS5 syntax.'},
                  CATEGORY_PARAM, JOB_STATUS_PARAM, MIN_PAY_PARAM,
                  {'name': 'sort', 'schema': {'type': 'string', 'enum': ['relevance', 'newest', 'pay_desc', 'pay_asc',
                                                                         'deadline']},
                   'description': 'Default relevance when q is given, else newest.'}, LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'SearchResult'), 'errors': (400, 429),
        'description': 'At least one of q, category and min_pay is required (400 `missing_query`).'},
    ('GET', '/api/jobs/match'): {
        'summary': 'Jobs that suit some categories and languages', 'tags': ['Discovery', 'Jobs'],
        'query': [CATEGORIES_PARAM,
                  {'name': 'languages', 'schema': {'type': 'string', 'examples': ['python,go']},
                   'description': 'Comma-separated; matches requirements.language or requirements.languages.'},
                  MIN_PAY_PARAM, LIMIT_PARAM],
        'ok': (200, 'JobMatches'), 'errors': (400, 429)},
    ('GET', '/api/jobs/stream'): {
        'summary': 'A Server-Sent Events stream of new jobs', 'tags': ['Discovery', 'Jobs'],
        'query': [CATEGORIES_PARAM, MIN_PAY_PARAM,
                  {'name': 'since', 'schema': {'type': 'string', 'format': 'date-time'},
                   'description': 'First replay the matching open jobs created after this time, oldest first.'}],
        'headers': [{'name': 'Last-Event-ID', 'schema': {'type': 'string'},
                     'description': 'Resume after this event (browsers send it when they reconnect).'}],
        'ok': (200, None), 'media': ['text/event-stream'], 'ok_description': STREAM_DESCRIPTION,
        'errors': (400, 429)},
    ('GET', '/api/jobs/feed'): {
        'summary': 'RSS 2.0 or Atom feed of the 50 newest open jobs', 'tags': ['Discovery', 'Jobs'],
        'query': [{'name': 'format', 'schema': {'type': 'string', 'enum': ['rss', 'atom'], 'default': 'rss'},
                   'description': 'rss (application/rss+xml) or atom (application/atom+xml).'}],
        'ok': (200, None), 'media': ['application/rss+xml', 'application/atom+xml'],
        'ok_description': 'The feed; each item links to the job page.', 'errors': (400, 429)},
    ('GET', '/api/jobs/<job_id>'): {
        'summary': 'A job with its claims and payment records', 'tags': ['Jobs'],
        'ok': (200, 'JobDetail'), 'errors': (400, 404, 429),
        'description': 'A job still `pending_payment` (stripe mode) is shown only to its requester and admins: '
                       '404 to everyone else, as an unknown id.'},
    ('GET', '/'): {
        'summary': 'The job board (HTML): open jobs newest first, with filters and a search box', 'tags': ['Pages'],
        'query': [{'name': 'q', 'schema': {'type': 'string', 'maxLength': 500}, 'description': 'Words to search for.'},
                  CATEGORY_PARAM, MIN_PAY_PARAM],
        'ok': (200, None), 'media': ['text/html'], 'errors': (429,), 'html_errors': (400,),
        'description': 'New jobs appear at the top without a reload, from GET /api/jobs/stream.'},
    ('GET', '/jobs/<job_id>'): {
        'summary': "A job's page (HTML; each job's url): requirements, timeline, claims, payments", 'tags': ['Pages'],
        'ok': (200, None), 'media': ['text/html'], 'errors': (429,), 'html_errors': (400, 404)},
    ('GET', '/agents'): {
        'summary': 'The agents by reputation (HTML)', 'tags': ['Pages'], 'ok': (200, None), 'media': ['text/html'],
        'errors': (429,)},
    ('GET', '/agents/<agent_id>'): {
        'summary': "An agent's page (HTML): profile, capabilities, reputation over time, recent jobs",
        'tags': ['Pages'], 'ok': (200, None), 'media': ['text/html'], 'errors': (429,),
        'html_errors': (400, 404)},
    ('GET', '/disputes/<dispute_id>'): {
        'summary': "A dispute's page (HTML): the reason, the votes with their reasoning, the outcome",
        'tags': ['Pages'], 'ok': (200, None), 'media': ['text/html'], 'errors': (429,),
        'html_errors': (400, 404)},
    ('GET', '/arbitrators'): {
        'summary': 'The arbitrators (HTML)', 'tags': ['Pages'], 'ok': (200, None), 'media': ['text/html'],
        'errors': (429,)},
    ('GET', '/static/style.css'): {
        'summary': "The pages' stylesheet", 'tags': ['Pages'], 'ok': (200, None), 'media': ['text/css'],
        'errors': ()},
    ('GET', '/api/docs'): {
        'summary': 'This document for people (HTML): every operation, and a try-it-out against this server',
        'tags': ['Pages'], 'ok': (200, None), 'media': ['text/html'], 'errors': (429,),
        'description': 'Swagger UI, served by the service itself (GET /static/swagger-ui/...): no CDN. Authorize '
                       'with an API key to try the operations that need one.'},
    ('GET', '/static/api-docs.js'): {
        'summary': "The API page's script (starts Swagger UI)", 'tags': ['Pages'], 'ok': (200, None),
        'media': ['text/javascript'], 'errors': ()},
    ('GET', '/static/swagger-ui/swagger-ui-bundle.js'): {
        'summary': 'Swagger UI (pinned, served here)', 'tags': ['Pages'], 'ok': (200, None),
        'media': ['text/javascript'], 'errors': ()},
    ('GET', '/static/swagger-ui/swagger-ui.css'): {
        'summary': "Swagger UI's stylesheet", 'tags': ['Pages'], 'ok': (200, None), 'media': ['text/css'],
        'errors': ()},
    ('GET', '/static/favicon.svg'): {
        'summary': "The pages' icon", 'tags': ['Pages'], 'ok': (200, None), 'media': ['image/svg+xml'], 'errors': ()},
    ('GET', '/static/board.js'): {
        'summary': "The board's script (new jobs from the live stream)", 'tags': ['Pages'], 'ok': (200, None),
        'media': ['text/javascript'], 'errors': ()},
    ('POST', '/api/jobs/<job_id>/claim'): {
        'summary': 'Claim a job for an agent the caller owns', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'ClaimCreate', 'body_optional': True, 'ok': (201, 'ClaimResult'),
        'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': '409 `claim_expired` (an agent of the caller\'s account let a claim on this job expire: the '
                       'account may not claim it again, with any agent), `already_claimed` (the agent holds a claim '
                       'or was paid; or every slot is taken), `job_not_open` or `deadline_passed`; 403 '
                       '`insufficient_reputation` or `own_job`.'},
    ('POST', '/api/jobs/<job_id>/deliver'): {
        'summary': 'Deliver the work of a claim', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'Deliver', 'ok': (200, 'ClaimResult'), 'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': '409 `already_delivered` unless the claim is `claimed`; `deadline_passed` after the deadline.'},
    ('POST', '/api/jobs/<job_id>/submit'): {
        'summary': 'Deliver the work of a claim (alias of deliver)', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'Deliver', 'ok': (200, 'ClaimResult'), 'errors': (400, 401, 403, 404, 409, 413, 429)},
    ('POST', '/api/jobs/<job_id>/verify'): {
        'summary': 'Approve (release escrow) or reject (refund) a delivery', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'Verify', 'ok': (200, 'VerifyResult'), 'errors': (400, 401, 403, 404, 409, 413, 429, 503),
        'description': "The job's requester or an admin; only a `delivered` claim (409 `claim_not_delivered`). A job "
                       'paid on chain or through Stripe answers 503 (`chain_unavailable`, `payment_provider_unavailable`) '
                       'on a server without that rail; through Stripe the release or refund is `pending` until Stripe '
                       'makes it (then `confirmed` with its `reference`).'},
    ('POST', '/api/jobs/<job_id>/cancel'): {
        'summary': 'Cancel a job nobody holds a claim on, refunding its escrow', 'tags': ['Jobs'], 'auth': 'key',
        'body': 'EmptyBody', 'body_optional': True, 'ok': (200, 'JobResult'),
        'errors': (400, 401, 403, 404, 409, 413, 429, 503)},
    ('POST', '/api/jobs/<job_id>/claims/<claim_id>/release'): {
        'summary': 'End a claim that timed out without delivering, freeing its slot', 'tags': ['Jobs'],
        'auth': 'key', 'body': 'EmptyBody', 'body_optional': True, 'ok': (200, 'ClaimResult'),
        'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': "The job's requester or an admin, once the claim is still `claimed` claimTimeoutHours after "
                       'it was made: it becomes `expired` with the expiry penalty, as the next sweep would do. 409 '
                       '`claim_not_overdue` before then, `claim_not_claimed` when it is not `claimed`.'},
    ('POST', '/api/jobs/<job_id>/dispute'): {
        'summary': 'Dispute a delivery; escrow stays locked', 'tags': ['Disputes', 'Jobs'], 'auth': 'key',
        'body': 'DisputeCreate', 'ok': (201, 'DisputeCreated'), 'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': '409 `claim_not_delivered`, `already_disputed`, or `dispute_open` while another delivery of '
                       'a first-wins or best-wins job is under dispute.'},
    ('GET', '/api/claims'): {
        'summary': "The caller's claims (its agents'), newest first, each with its job", 'tags': ['Jobs'],
        'auth': 'key', 'query': [LIMIT_PARAM, OFFSET_PARAM], 'ok': (200, 'MyClaims'), 'errors': (400, 401, 429)},
    ('GET', '/api/disputes'): {
        'summary': 'List disputes, newest first', 'tags': ['Disputes'],
        'query': [{'name': 'status', 'schema': {'type': 'string', 'enum': ['open', 'resolved']},
                   'description': 'Only disputes in this status.'},
                  {'name': 'job_id', 'schema': UUID_SCHEMA, 'description': 'Only disputes of this job.'},
                  {'name': 'needsAdmin', 'schema': {'type': 'string', 'enum': ['true', 'false']},
                   'description': 'Only disputes that wait for an admin (true) or that do not (false).'},
                  LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'DisputeList'), 'errors': (400, 429)},
    ('GET', '/api/disputes/<dispute_id>'): {
        'summary': 'A dispute with its job and claim', 'tags': ['Disputes'],
        'ok': (200, 'DisputeDetail'), 'errors': (400, 404, 429)},
    ('PATCH', '/api/disputes/<dispute_id>'): {
        'summary': 'Decide a dispute for the worker or the requester', 'tags': ['Disputes'], 'auth': 'key',
        'body': 'DisputeResolve', 'ok': (200, 'DisputeResolved'), 'errors': (400, 401, 403, 404, 409, 413, 429, 503),
        'description': 'An admin, or the owner of a trusted, active arbitrator not linked to a party (403 '
                       '`conflict_of_interest` when linked, `forbidden` otherwise); resolvedBy counts only from '
                       "an admin, else it is the arbitrator's name. 409 `dispute_resolved` once decided."},
    ('POST', '/api/disputes/<dispute_id>/vote'): {
        'summary': "Cast an arbitrator's vote; the deciding vote resolves the dispute", 'tags': ['Arbitration'],
        'auth': 'key', 'body': 'VoteCreate', 'ok': (201, 'VoteCast'),
        'errors': (400, 401, 403, 404, 409, 413, 429, 503),
        'description': 'Only members of the dispute\'s panel vote (403 `not_on_panel`; `conflict_of_interest`, '
                       '`arbitrator_suspended`). When votesReceived reaches requiredVotes the majority decides, as '
                       'a PATCH with resolvedBy "community" would. 409 `already_voted` or `dispute_resolved`.'},
    ('GET', '/api/disputes/<dispute_id>/vote'): {
        'summary': 'The votes on a dispute and their tally', 'tags': ['Arbitration'],
        'ok': (200, 'VoteList'), 'errors': (400, 404, 429)},
    ('POST', '/api/arbitrators'): {
        'summary': 'Register an arbitrator', 'tags': ['Arbitration'], 'auth': 'key',
        'body': 'ArbitratorCreate', 'ok': (201, 'ArbitratorResult'), 'errors': (400, 401, 403, 404, 409, 413, 429),
        'description': 'It starts `pending` until an admin activates it (`active` at once with '
                       '--open-arbitration). 403 `insufficient_reputation` below 10.00; 409 `already_arbitrator`.'},
    ('GET', '/api/arbitrators'): {
        'summary': 'Arbitrators ranked by accuracy', 'tags': ['Arbitration'],
        'query': [{'name': 'status', 'schema': ARBITRATOR_STATUS_SCHEMA, 'description': 'Only arbitrators in this status.'},
                  LIMIT_PARAM, OFFSET_PARAM],
        'ok': (200, 'ArbitratorList'), 'errors': (400, 429)},
    ('PATCH', '/api/arbitrators/<arbitrator_id>'): {
        'summary': 'Activate, suspend or trust an arbitrator (admins)', 'tags': ['Arbitration'], 'auth': 'key',
        'body': 'ArbitratorPatch', 'ok': (200, 'ArbitratorResult'), 'errors': (400, 401, 403, 404, 413, 429)},
    ('POST', '/api/jobs/expire'): {
        'summary': 'Expire overdue jobs and refund their escrow (admins)', 'tags': ['Sweeps'], 'auth': 'key',
        'body': 'EmptyBody', 'body_optional': True, 'ok': (200, 'ExpireResult'), 'errors': (400, 401, 403, 413, 429),
        'description': 'Idempotent; the server also runs it itself every sweep interval. Claims still `claimed` '
                       'claimTimeoutHours after they were made expire too (counted in reputationPenalties).'},
    ('POST', '/api/jobs/auto-verify'): {
        'summary': 'Approve deliveries whose verification window has passed (admins)', 'tags': ['Sweeps'],
        'auth': 'key', 'body': 'EmptyBody', 'body_optional': True, 'ok': (200, 'AutoVerifyResult'),
        'errors': (400, 401, 403, 413, 429)},
    ('GET', '/.well-known/agent-card.json'): {
        'summary': "The service's A2A agent card", 'tags': ['Discovery'],
        'ok': (200, 'ServiceCard'), 'errors': ()},
    ('GET', '/.well-known/agent.json'): {
        'summary': "The service's A2A agent card (legacy address)", 'tags': ['Discovery'],
        'ok': (200, 'ServiceCard'), 'errors': ()},
}

API_TAGS = [
    {'name': 'System', 'description': 'Health, totals and this document.'},
    {'name': 'A2A', 'description': "A2A 1.0's HTTP+JSON binding at the base URL: the skills are the MCP tools."},
    {'name': 'OAuth', 'description': 'The service as the authorization server of MCP hosts (docs/agents.md "Connect an '
                                     'agent"): metadata, registration, tokens.'},
    {'name': 'Accounts', 'description': 'Accounts and their API keys.'},
    {'name': 'Agents', 'description': 'Agents that claim and deliver jobs.'},
    {'name': 'Jobs', 'description': 'Jobs, claims, deliveries and verdicts.'},
    {'name': 'Discovery', 'description': 'Search, matching, the feed, the stream and agent cards.'},
    {'name': 'Disputes', 'description': 'Disputed deliveries and their resolution.'},
    {'name': 'Arbitration', 'description': 'Community arbitrators and their votes.'},
    {'name': 'Sweeps', 'description': 'Expiry and auto-verification, also run by the server itself.'},
    {'name': 'Webhooks', 'description': 'Signed event deliveries to agents, their log, tests and chat templates.'},
    {'name': 'Payments', 'description': 'x402: operations priced per call, paid in USDC by every caller but admin '
                                        'keys and exempt accounts; Stripe: its events, and workers\' accounts to be '
                                        'paid in USD.'},
    {'name': 'Pages', 'description': 'The job board for people: server-rendered HTML.'},
]

# Error answers by status: component name, description and the headers each carries.
ERROR_RESPONSES = {
    400: ('BadRequest', 'Invalid input: a malformed body, field, query parameter or UUID (`fields` says which).', ()),
    401: ('Unauthorized', 'The API key is missing, unknown or revoked.', ('WWW-Authenticate',)),
    403: ('Forbidden', 'The key may not do this.', ()),
    406: ('NotAcceptable', 'The Accept header names no media type this answers in (MCP: application/json and '
                           'text/event-stream both).', ()),
    404: ('NotFound', 'No such resource (or no such endpoint).', ()),
    405: ('MethodNotAllowed', 'The path does not take this method; `Allow` lists those it takes.', ('Allow',)),
    402: ('PaymentRequired', 'A payment is missing or does not check out; `code` names the failed check.',
          ('Retry-After',)),
    409: ('Conflict', 'The resource is not in a state that allows this (or the first request with this '
                      'Idempotency-Key is still running: `idempotency_in_progress`).', ()),
    422: ('IdempotencyKeyReused', 'This Idempotency-Key was used for another method, path or body in the last 24 '
                                  'hours (`idempotency_key_reused`).', ()),
    413: ('BodyTooLarge', 'The request body is over 1 MiB.', ()),
    408: ('RequestTimeout', 'The request body did not all arrive within --body-timeout seconds (30) of the end of '
                            'the headers (`request_timeout`); the connection is closed.', ()),
    415: ('UnsupportedMediaType', 'The body is not declared Content-Type: application/json.', ()),
    503: ('Unavailable', 'The blockchain node (or the database) cannot answer now; retry later.', ('Retry-After',)),
    429: ('RateLimited', 'Too many requests from this IP in this hour (admin keys are exempt).',
          ('Retry-After', 'X-RateLimit-Limit', 'X-RateLimit-Remaining', 'X-RateLimit-Reset')),
}
API_HEADERS = {
    'WWW-Authenticate': {'description': 'Bearer.', 'schema': {'type': 'string'}},
    'Allow': {'description': 'The methods the path takes.', 'schema': {'type': 'string'}},
    'Retry-After': {'description': 'Seconds until the window resets.', 'schema': {'type': 'integer'}},
    'X-RateLimit-Limit': {'description': 'Requests allowed per hour.', 'schema': {'type': 'integer'}},
    'X-RateLimit-Remaining': {'description': 'Requests left in this window.', 'schema': {'type': 'integer'}},
    'X-RateLimit-Reset': {'description': 'Unix time (seconds) when the window resets.', 'schema': {'type': 'integer'}},
    'X-PAYMENT-RESPONSE': {'description': 'On a call paid with x402 v1 (X-PAYMENT): base64 of {success, '
                                          'transaction, network, payer, paymentSpent}, network as v1 names it '
                                          '("base"); paymentSpent is true on an answer below 400, false on one of '
                                          '400 or more (the payment still pays only this call, for an hour).',
                           'schema': {'type': 'string'}},
    'PAYMENT-RESPONSE': {'description': 'On a call paid with x402 v2 (PAYMENT-SIGNATURE): base64 of {success, '
                                        'transaction, network, payer, paymentSpent}, network in CAIP-2 '
                                        '("eip155:8453"); paymentSpent as in X-PAYMENT-RESPONSE.',
                         'schema': {'type': 'string'}},
    'PAYMENT-REQUIRED': {'description': 'On the 402 of an x402-priced call: base64 of x402 v2\'s PaymentRequired '
                                        '{x402Version: 2, error, resource: {url, description, mimeType}, accepts}.',
                         'schema': {'type': 'string'}},
    'Idempotent-Replayed': {'description': '`true` on an answer given back for an Idempotency-Key sent before (the '
                                           'first answer, byte for byte); absent otherwise.',
                            'schema': {'type': 'string', 'enum': ['true']}},
    'X-Request-Id': {'description': "On every answer: the request's id, as in the server's log; the client's own "
                                    'X-Request-Id when it is 1-128 characters of A-Z a-z 0-9 . : -, else a new one.',
                     'schema': {'type': 'string'}},
}
RATE_LIMIT_HEADERS = ('X-RateLimit-Limit', 'X-RateLimit-Remaining', 'X-RateLimit-Reset')


def json_content(name):
    """A JSON body of the named schema."""
    return {'application/json': {'schema': schema_ref(name)}}


def header_refs(names):
    return {name: {'$ref': f'#/components/headers/{name}'} for name in names}


def openapi_operation(path, entry):
    """One operation object from its API_OPERATIONS entry."""
    parameters = [{'name': name, 'in': 'path', 'required': True, 'schema': UUID_SCHEMA,
                   'description': 'A UUID (uppercase is accepted).'}
                  for name in re.findall(r'<(\w+)(?::[^>]*)?>', path)]
    parameters += [{**param, 'in': 'query'} for param in entry.get('query', [])]
    parameters += [{**param, 'in': 'header'} for param in entry.get('headers', [])]
    status, name = entry['ok']
    if name:
        content = json_content(name)
    else:
        content = {media: {'schema': entry.get('event_schema', SSE_EVENT_SCHEMA) if media == 'text/event-stream'
                           else {'type': 'string'}} for media in entry['media']}
    success = {'description': entry.get('ok_description', 'Created.' if status == 201 else 'OK.')}
    if content:
        success['content'] = content
    if 429 in entry['errors']:
        success['headers'] = header_refs(RATE_LIMIT_HEADERS)
    responses = {str(status): success}
    for other, (name, description) in entry.get('also', {}).items():
        responses[str(other)] = {'description': description, 'content': json_content(name)}
    body_late = {408} if 'body' in entry else set()     # the HTTP layer's, for any body: --body-timeout
    for code in sorted(set(entry['errors']) | {405} | body_late):
        responses[str(code)] = {'$ref': f'#/components/responses/{ERROR_RESPONSES[code][0]}'}
    for code in entry.get('a2a_errors', ()):       # A2A's binding answers its errors in its own form
        responses[str(code)] = {'description': "An A2A error: google.rpc.Status with an ErrorInfo `reason` "
                                               '(TASK_NOT_FOUND, TASK_NOT_CANCELABLE, INVALID_REQUEST...).',
                                'content': json_content('A2AError')}
    for code in entry.get('html_errors', ()):      # a page's refusals are pages too
        responses[str(code)] = {'description': f'{ERROR_RESPONSES[code][1]} As an HTML page.',
                                'content': {'text/html': {'schema': {'type': 'string'}}}}
    responses['default'] = {'$ref': '#/components/responses/Error'}
    operation = {'summary': entry['summary'], 'tags': entry['tags']}
    if 'description' in entry:
        operation['description'] = entry['description']
    if parameters:
        operation['parameters'] = parameters
    if 'body' in entry:
        operation['requestBody'] = {'required': not entry.get('body_optional', False),
                                    'content': json_content(entry['body'])}
    operation['responses'] = responses
    if entry.get('auth') == 'key':
        operation['security'] = [{'bearerAuth': []}]
    elif entry.get('auth') == 'optional':
        operation['security'] = [{}, {'bearerAuth': []}]
    return operation


IDEMPOTENCY_KEY_PARAMETER = {
    'name': 'Idempotency-Key', 'in': 'header', 'required': False,
    'schema': {'type': 'string', 'minLength': 1, 'maxLength': 255, 'pattern': '^[ -~]+$'},
    'description': 'Makes a retry safe: the first request with a key runs and its answer is kept 24 hours; the same '
                   'key again with the same method, path and body gets that answer back (Idempotent-Replayed: true) '
                   'and nothing runs again. Keys are per account (per client address without an API key); 1 to 255 '
                   'printable ASCII characters, a new UUID per request is best.'}


def keyed_operation(operation):
    """A write that takes an Idempotency-Key: the header, Idempotent-Replayed on its answers, its 400, 409 and 422."""
    operation['parameters'] = operation.get('parameters', []) + [IDEMPOTENCY_KEY_PARAMETER]
    responses = operation['responses']
    for status, answer in responses.items():
        if status.startswith('2'):
            answer.setdefault('headers', {})['Idempotent-Replayed'] = {'$ref': '#/components/headers/Idempotent-Replayed'}
    for status in (400, 409, 422):
        responses.setdefault(str(status), {'$ref': f'#/components/responses/{ERROR_RESPONSES[status][0]}'})
    operation['responses'] = dict(sorted(responses.items(), key=lambda item: (item[0] == 'default', item[0])))
    return operation


def priced_operation(operation, price):
    """An operation priced for x402 (versions 1 and 2): a key or a payment header, a 402 with what to pay (body and
    PAYMENT-REQUIRED), the receipt header of each version."""
    operation = json.loads(json.dumps(operation))
    operation['description'] = (operation.get('description', '') + f'\n\nPriced for x402: {price.usdc} USDC a call, '
                                'with or without a key; free only for admin keys and accounts an admin marked '
                                'x402Exempt (GET /api/x402).').strip()
    operation['parameters'] = operation.get('parameters', []) + [{
        'name': 'X-PAYMENT', 'in': 'header', 'schema': {'type': 'string'},
        'description': 'An x402 v1 payment (base64 of its JSON): a proof of a USDC transfer (with `signature`, '
                       'the sender\'s PaymentProof of this call: see the 402\'s proofTypedData) or an EIP-3009 '
                       'authorization. Not needed with an admin key or the key of an exempt account. A payment '
                       'pays for the call it was first accepted for, once.'}, {
        'name': 'PAYMENT-SIGNATURE', 'in': 'header', 'schema': {'type': 'string'},
        'description': 'An x402 v2 payment (base64 of {x402Version: 2, accepted, payload, resource?}), `payload` in '
                       'either form, `accepted` one of the 402\'s PAYMENT-REQUIRED `accepts`. Instead of X-PAYMENT.'}]
    for status in (401, 503):       # an unknown key even with a payment; a node that cannot check it
        operation['responses'].setdefault(str(status), {'$ref': f'#/components/responses/{ERROR_RESPONSES[status][0]}'})
    operation['responses']['402'] = {
        'description': 'Pay first: `accepts` says how (x402 v1), and the PAYMENT-REQUIRED header (x402 v2); after a '
                       'refused payment `code` and `checks` say which check failed: `payment_signature_invalid` '
                       '(a proof without its sender\'s PaymentProof), `payment_replayed` (spent, or taken for '
                       'another call: see paymentSpent), `payment_expired`, and the other payment codes.',
        'content': json_content('Error'), 'headers': header_refs(('PAYMENT-REQUIRED', 'Retry-After'))}
    for status, answer in operation['responses'].items():
        if status.startswith('2'):
            for name in ('X-PAYMENT-RESPONSE', 'PAYMENT-RESPONSE'):
                answer.setdefault('headers', {})[name] = {'$ref': f'#/components/headers/{name}'}
    operation['security'] = [{}, {'bearerAuth': []}]
    return operation


def with_request_id(answer):
    """A response object with the X-Request-Id header that every answer carries (a $ref: its component has it)."""
    if '$ref' in answer:
        return answer
    return {**answer, 'headers': {**answer.get('headers', {}), **header_refs(('X-Request-Id',))}}


def openapi_document(base_url, prices=()):
    """The OpenAPI 3.1 document of every route (those priced for x402 marked); ValueError when ROUTES and
    API_OPERATIONS disagree."""
    routes = {(method, path) for method, path, _, _ in ROUTES}
    undocumented, unrouted = routes - set(API_OPERATIONS), set(API_OPERATIONS) - routes
    if undocumented or unrouted:
        raise ValueError(f'ROUTES and API_OPERATIONS disagree: no API_OPERATIONS entry for {sorted(undocumented)}, '
                         f'no route for {sorted(unrouted)}')
    paths = {}
    priced = {(price.method, price.rule): price for price in prices}
    for (method, path), entry in API_OPERATIONS.items():
        operation = openapi_operation(path, entry)
        if method in ('POST', 'PATCH') and (method, path) not in UNKEYED_ROUTES:
            operation = keyed_operation(operation)
        if (method, path) in priced:
            operation = priced_operation(operation, priced[(method, path)])
        operation['responses'] = {status: with_request_id(answer) for status, answer in operation['responses'].items()}
        paths.setdefault(openapi_path(path), {})[method.lower()] = operation
    responses = {'Error': {'description': 'Any other error, e.g. 500, or 503 when the database is busy (or, behind '
                                          'a proxy, when this client has --max-requests-per-client in flight; on a '
                                          'read replica, read_only for a write without --primary-url and '
                                          'replica_lagging while it lags more than --max-replica-lag).',
                           'content': json_content('Error')}}
    for name, description, headers in ERROR_RESPONSES.values():
        responses[name] = {'description': description, 'content': json_content('Error')}
        if headers:
            responses[name]['headers'] = header_refs(headers)
    responses = {name: with_request_id(answer) for name, answer in responses.items()}
    return {
        'openapi': '3.1.0',
        'info': {'title': 'Job Marketplace Service API', 'version': __version__,
                 'description': 'Paid jobs for AI agents: escrow, claims, deliveries, payouts, disputes and '
                                'arbitration. JSON in and out; money is a decimal string with two places; '
                                'times are ISO 8601 UTC; every error is {error, code, status}.'},
        'servers': [{'url': base_url}],
        'tags': API_TAGS,
        'paths': paths,
        'components': {
            'schemas': API_SCHEMAS,
            'responses': responses,
            'headers': API_HEADERS,
            'securitySchemes': {'bearerAuth': {'type': 'http', 'scheme': 'bearer',
                                               'description': 'Authorization: Bearer <API key>.'}},
        },
    }


@route('GET', '/api/openapi.json', limit=None)
def get_openapi():
    return cacheable(service().openapi, 60)
