-- The marketplace's whole state. Idempotent: applied at every start, after the migrations in
-- marketplace.py have brought an older database up to the shape below.
-- Money is integer units of the currency (USD cents, USDC base units with 6 decimals).
-- Times are ISO 8601 UTC text with milliseconds and a Z ('2026-11-21T16:40:00.000Z'), which sorts.

CREATE TABLE IF NOT EXISTS accounts (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    role        TEXT NOT NULL CHECK (role IN ('admin', 'member')),
    created_at  TEXT NOT NULL,
    x402_exempt INTEGER NOT NULL DEFAULT 0         -- an admin let it call x402-priced operations without paying
);

CREATE TABLE IF NOT EXISTS api_keys (
    id          TEXT PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts(id),
    key_hash    TEXT NOT NULL UNIQUE,          -- SHA-256 hex of the key; the key itself is never stored
    prefix      TEXT NOT NULL,                 -- first characters, to tell keys apart in `keys list`
    created_at  TEXT NOT NULL,
    revoked_at  TEXT,
    from_env    INTEGER NOT NULL DEFAULT 0     -- made admin by MARKETPLACE_ADMIN_KEY: revoked when it names another
);

CREATE TABLE IF NOT EXISTS agents (
    id                TEXT PRIMARY KEY,
    account_id        TEXT NOT NULL REFERENCES accounts(id),
    name              TEXT NOT NULL,
    description       TEXT NOT NULL DEFAULT '',
    wallet_address    TEXT,
    webhook_url       TEXT,
    webhook_secret    TEXT NOT NULL,
    webhook_format    TEXT NOT NULL DEFAULT 'json' CHECK (webhook_format IN ('json', 'slack', 'discord', 'telegram')),
    webhook_disabled_at TEXT,                       -- set when the receiver answered 410 Gone
    webhook_failures  INTEGER NOT NULL DEFAULT 0,   -- failed attempts in a row (a success resets it)
    webhook_paused_at TEXT,                         -- set at the 10th failure in a row; PATCH webhookUrl or a test resumes
    capabilities      TEXT NOT NULL DEFAULT '{}',   -- JSON
    pricing           TEXT NOT NULL DEFAULT '{}',   -- JSON
    reputation        INTEGER NOT NULL DEFAULT 0 CHECK (reputation >= 0),  -- hundredths
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL,
    stripe_account_id TEXT,                         -- stripe rail: the Express connected account it is paid to
    stripe_payouts_enabled INTEGER NOT NULL DEFAULT 0,  -- stripe rail: account.updated says it can take transfers
    stripe_checked_at TEXT                          -- stripe rail: when a sweep last asked Stripe for the account
);
CREATE INDEX IF NOT EXISTS agents_account ON agents(account_id);
CREATE UNIQUE INDEX IF NOT EXISTS agents_stripe_account ON agents(stripe_account_id);
CREATE INDEX IF NOT EXISTS agents_reputation ON agents(reputation DESC, created_at);

CREATE TABLE IF NOT EXISTS reputation_events (
    id           TEXT PRIMARY KEY,
    agent_id     TEXT NOT NULL REFERENCES agents(id),
    delta        INTEGER NOT NULL,              -- nominal change, hundredths
    reason       TEXT NOT NULL,
    job_id       TEXT REFERENCES jobs(id),
    claim_id     TEXT REFERENCES claims(id),
    score_after  INTEGER NOT NULL,
    created_at   TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS reputation_events_agent ON reputation_events(agent_id, created_at);

-- seq is the rowid (an INTEGER PRIMARY KEY never changes, not even in VACUUM): the order in which jobs
-- were posted, the full-text index's key and the stream's resume point.
CREATE TABLE IF NOT EXISTS jobs (
    seq                       INTEGER PRIMARY KEY,
    id                        TEXT NOT NULL UNIQUE,
    status                    TEXT NOT NULL CHECK (status IN
        ('pending_payment', 'open', 'claimed', 'delivered', 'disputed', 'completed', 'rejected', 'refunded',
         'expired', 'cancelled')),
    title                     TEXT NOT NULL,
    description               TEXT NOT NULL,
    category                  TEXT NOT NULL,
    amount_cents              INTEGER NOT NULL CHECK (amount_cents > 0),   -- the price, in cents of the currency
    currency                  TEXT NOT NULL CHECK (currency IN ('USDC', 'USD')),
    rail                      TEXT NOT NULL CHECK (rail IN ('base', 'stripe')),
    requester_id              TEXT NOT NULL REFERENCES accounts(id),
    requirements              TEXT NOT NULL DEFAULT '{}',   -- JSON object
    acceptance_criteria       TEXT NOT NULL DEFAULT '[]',   -- JSON array
    max_workers               INTEGER NOT NULL DEFAULT 1,
    competition_mode          TEXT NOT NULL DEFAULT 'first-wins',
    deadline                  TEXT NOT NULL,
    verification_window_hours INTEGER NOT NULL DEFAULT 24,
    min_reputation            INTEGER NOT NULL DEFAULT 0,   -- hundredths
    escrow_status             TEXT NOT NULL CHECK (escrow_status IN
        ('pending', 'locked', 'released', 'refunded', 'held', 'charged_back')),
    escrow_tx_hash            TEXT,                         -- on chain: the funding transfer
    refund_address            TEXT,                         -- on chain: who funded it, and gets refunds
    created_at                TEXT NOT NULL,
    updated_at                TEXT NOT NULL,
    claim_timeout_hours       INTEGER NOT NULL DEFAULT 24,  -- a claim not delivered this long after it was made expires
    stripe_session_id         TEXT,                         -- stripe rail: the Checkout Session that funds it
    checkout_url              TEXT,                         -- stripe rail: where the requester pays, while pending
    checkout_expires_at       TEXT,                         -- stripe rail: when that session expires
    payment_intent            TEXT,                         -- stripe rail: the PaymentIntent that paid it (refunds)
    stripe_charge             TEXT,                         -- stripe rail: its Charge (transfers' source_transaction)
    escrow_unheld             TEXT,                         -- stripe rail: while escrow is held (a chargeback, a refund
                                                            -- from outside), the status it takes when the hold lifts
    escrow_deposit_id         TEXT,                         -- contract mode: the JobEscrow deposit that funds it (one job)
    needs_admin               TEXT                          -- contract mode: why the chain and the ledger disagree (a
                                                            -- call that reverted, a deposit holding less than owed)
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_deposit ON jobs(escrow_deposit_id) WHERE escrow_deposit_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_needs_admin ON jobs(needs_admin) WHERE needs_admin IS NOT NULL;
-- Lists filter by status and category and sort by seq (newest, oldest), pay or deadline: each index below
-- serves one filter with its sorts in index order (an index ends in seq, the rowid), so a page of 50 stops
-- after 50 entries instead of sorting every open job (make bench).
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
CREATE INDEX IF NOT EXISTS jobs_status_amount ON jobs(status, amount_cents);
CREATE INDEX IF NOT EXISTS jobs_status_deadline ON jobs(status, deadline);
CREATE INDEX IF NOT EXISTS jobs_category ON jobs(category);
CREATE INDEX IF NOT EXISTS jobs_category_amount ON jobs(category, amount_cents);
CREATE INDEX IF NOT EXISTS jobs_category_status ON jobs(category, status);
CREATE INDEX IF NOT EXISTS jobs_category_status_amount ON jobs(category, status, amount_cents);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs(created_at);
CREATE INDEX IF NOT EXISTS jobs_amount ON jobs(amount_cents);
CREATE INDEX IF NOT EXISTS jobs_requester ON jobs(requester_id);
CREATE INDEX IF NOT EXISTS jobs_deadline ON jobs(deadline);

-- Full-text search over titles and descriptions, kept in step with jobs by the triggers below.
CREATE VIRTUAL TABLE IF NOT EXISTS jobs_fts USING fts5(
    title, description, content = 'jobs', content_rowid = 'seq', tokenize = 'unicode61 remove_diacritics 2');
CREATE TRIGGER IF NOT EXISTS jobs_fts_insert AFTER INSERT ON jobs BEGIN
    INSERT INTO jobs_fts (rowid, title, description) VALUES (new.seq, new.title, new.description);
END;
CREATE TRIGGER IF NOT EXISTS jobs_fts_delete AFTER DELETE ON jobs BEGIN
    INSERT INTO jobs_fts (jobs_fts, rowid, title, description) VALUES ('delete', old.seq, old.title, old.description);
END;
CREATE TRIGGER IF NOT EXISTS jobs_fts_update AFTER UPDATE OF title, description ON jobs BEGIN
    INSERT INTO jobs_fts (jobs_fts, rowid, title, description) VALUES ('delete', old.seq, old.title, old.description);
    INSERT INTO jobs_fts (rowid, title, description) VALUES (new.seq, new.title, new.description);
END;

-- The number of jobs of each category in each status, kept exact by triggers in the transaction that changes
-- a job: a list's total filtered by category and status reads a few rows instead of counting every match.
CREATE TABLE IF NOT EXISTS job_counts (
    category TEXT NOT NULL,
    status   TEXT NOT NULL,
    jobs     INTEGER NOT NULL CHECK (jobs >= 0),
    PRIMARY KEY (category, status)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS job_counts_insert AFTER INSERT ON jobs BEGIN
    INSERT INTO job_counts (category, status, jobs) VALUES (new.category, new.status, 1)
        ON CONFLICT (category, status) DO UPDATE SET jobs = jobs + 1;
END;
CREATE TRIGGER IF NOT EXISTS job_counts_delete AFTER DELETE ON jobs BEGIN
    UPDATE job_counts SET jobs = jobs - 1 WHERE category = old.category AND status = old.status;
END;
CREATE TRIGGER IF NOT EXISTS job_counts_update AFTER UPDATE OF category, status ON jobs
    WHEN new.category != old.category OR new.status != old.status BEGIN
    UPDATE job_counts SET jobs = jobs - 1 WHERE category = old.category AND status = old.status;
    INSERT INTO job_counts (category, status, jobs) VALUES (new.category, new.status, 1)
        ON CONFLICT (category, status) DO UPDATE SET jobs = jobs + 1;
END;

CREATE TABLE IF NOT EXISTS claims (
    id             TEXT PRIMARY KEY,
    job_id         TEXT NOT NULL REFERENCES jobs(id),
    agent_id       TEXT NOT NULL REFERENCES agents(id),
    status         TEXT NOT NULL CHECK (status IN
        ('claimed', 'delivered', 'approved', 'rejected', 'disputed', 'expired', 'superseded')),
    deliverable    TEXT,                        -- JSON object once delivered
    delivered_at   TEXT,
    verified_at    TEXT,
    verification_reason TEXT,                   -- the requester's reason, when given
    auto_approved  INTEGER NOT NULL DEFAULT 0,
    created_at     TEXT NOT NULL,
    updated_at     TEXT NOT NULL,
    release_authorization TEXT                  -- contract mode: the co-signed Release of its share (JSON), once
                                                -- approved with the payer's signature: the worker may send it itself
);
CREATE INDEX IF NOT EXISTS claims_job ON claims(job_id, status);
CREATE INDEX IF NOT EXISTS claims_agent ON claims(agent_id, created_at);

-- A payment record is one movement of money; its two ledger entries are the double entry.
CREATE TABLE IF NOT EXISTS payments (
    seq         INTEGER PRIMARY KEY,            -- the order money moved in
    id          TEXT NOT NULL UNIQUE,
    job_id      TEXT NOT NULL REFERENCES jobs(id),
    claim_id    TEXT REFERENCES claims(id),
    type        TEXT NOT NULL CHECK (type IN ('escrow', 'release', 'refund', 'fee', 'reclaim')),
    amount      INTEGER NOT NULL CHECK (amount >= 0),
    currency    TEXT NOT NULL,
    rail        TEXT NOT NULL,
    status      TEXT NOT NULL,                  -- simulated | pending | confirmed | failed | cancelled (never sent:
                                                -- its card money went back; two more entries reverse its two)
                                                -- | scheduled (contract mode: proposed, paid by `execute` after
                                                -- the contract's delay; cancelled if the guardian cancels it)
    recipient   TEXT,
    tx_hash     TEXT,
    raw_tx      TEXT,                           -- on chain: the signed transfer, stored before it is sent
    nonce       INTEGER,                        -- on chain: its nonce (one per payout, never reused)
    broadcast_at TEXT,                          -- on chain: when the node took raw_tx (NULL again once re-priced)
    created_at  TEXT NOT NULL,
    reference   TEXT,                           -- stripe rail: the Stripe object (pi_, tr_, re_) once it exists
    call_id     TEXT,                           -- contract mode, scheduled: the escrow_calls `propose` that pays it
    executable_at TEXT,                         -- contract mode, scheduled: when the proposal may be executed
    failure     TEXT,                           -- failed: why (the chain call that reverted); its entries reversed
    origin      TEXT                            -- NULL: sent by this service; 'chain': a payment someone else made,
                                                -- recorded from the contract's events (CONTRACT 25)
);
CREATE INDEX IF NOT EXISTS payments_pending ON payments(status) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS payments_job ON payments(job_id, created_at);

-- Ledger accounts: 'funding:<account id>' (where a requester's money comes from and returns to),
-- 'escrow:<job id>', 'worker:<agent id>', 'fees'. Each payment writes one debit and one credit.
CREATE TABLE IF NOT EXISTS ledger_entries (
    id          INTEGER PRIMARY KEY,
    payment_id  TEXT NOT NULL REFERENCES payments(id),
    job_id      TEXT NOT NULL REFERENCES jobs(id),
    account     TEXT NOT NULL,
    amount      INTEGER NOT NULL,               -- positive credits the account, negative debits it
    currency    TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_entries_job ON ledger_entries(job_id);
CREATE INDEX IF NOT EXISTS ledger_entries_account ON ledger_entries(account);

CREATE TABLE IF NOT EXISTS disputes (
    id              TEXT PRIMARY KEY,
    job_id          TEXT NOT NULL REFERENCES jobs(id),
    claim_id        TEXT NOT NULL UNIQUE REFERENCES claims(id),   -- one dispute per claim, ever
    status          TEXT NOT NULL CHECK (status IN ('open', 'resolved')),
    reason          TEXT NOT NULL,
    outcome         TEXT CHECK (outcome IN ('requester', 'worker')),
    resolution      TEXT,
    resolved_by     TEXT,
    required_votes  INTEGER NOT NULL,
    created_at      TEXT NOT NULL,
    resolved_at     TEXT,
    needs_admin     INTEGER NOT NULL DEFAULT 0,    -- too few eligible arbitrators for a panel when it opened
    -- the parties as they were when it opened (its panel was drawn against them; they alone decide conflicts)
    requester_account TEXT,                        -- the job's requester
    worker_account  TEXT,                          -- the account of the claim's agent
    worker_wallet   TEXT,                          -- the claim's agent's wallet then
    payer_wallet    TEXT                           -- on chain: the job's funding payer
);
CREATE INDEX IF NOT EXISTS disputes_status ON disputes(status, created_at);
CREATE INDEX IF NOT EXISTS disputes_job ON disputes(job_id);

-- An arbitrator belongs to the account that may vote with it; agent arbitrators also name their agent.
CREATE TABLE IF NOT EXISTS arbitrators (
    id              TEXT PRIMARY KEY,
    account_id      TEXT NOT NULL REFERENCES accounts(id),
    agent_id        TEXT UNIQUE REFERENCES agents(id),
    name            TEXT NOT NULL,
    wallet_address  TEXT NOT NULL,
    status          TEXT NOT NULL CHECK (status IN ('pending', 'active', 'suspended')),
    created_at      TEXT NOT NULL,
    updated_at      TEXT NOT NULL,
    trusted         INTEGER NOT NULL DEFAULT 0     -- an admin let it decide disputes alone (PATCH /api/disputes/:id)
);

CREATE TABLE IF NOT EXISTS votes (
    id              TEXT PRIMARY KEY,
    dispute_id      TEXT NOT NULL REFERENCES disputes(id),
    arbitrator_id   TEXT NOT NULL REFERENCES arbitrators(id),
    vote            TEXT NOT NULL CHECK (vote IN ('requester', 'worker')),
    reasoning       TEXT NOT NULL DEFAULT '',
    created_at      TEXT NOT NULL,
    UNIQUE (dispute_id, arbitrator_id)
);
CREATE INDEX IF NOT EXISTS votes_arbitrator ON votes(arbitrator_id);

-- The arbitrators drawn at random for a dispute when it opened: only they vote on it (and see its delivery).
CREATE TABLE IF NOT EXISTS dispute_panels (
    dispute_id      TEXT NOT NULL REFERENCES disputes(id),
    arbitrator_id   TEXT NOT NULL REFERENCES arbitrators(id),
    PRIMARY KEY (dispute_id, arbitrator_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dispute_panels_arbitrator ON dispute_panels(arbitrator_id);

-- Every on-chain payment the service accepted: a transaction hash pays for one thing only, ever.
CREATE TABLE IF NOT EXISTS used_payments (
    chain_id    INTEGER NOT NULL,
    tx_hash     TEXT NOT NULL,                  -- lowercase
    purpose     TEXT NOT NULL CHECK (purpose IN ('escrow', 'x402')),
    account_id  TEXT REFERENCES accounts(id),
    job_id      TEXT REFERENCES jobs(id),
    created_at  TEXT NOT NULL,
    PRIMARY KEY (chain_id, tx_hash)
);

-- A wallet that pays x402 calls with a signed authorization acts as an account of its own, made on its first one.
CREATE TABLE IF NOT EXISTS wallet_accounts (
    address     TEXT PRIMARY KEY,               -- checksummed
    account_id  TEXT NOT NULL UNIQUE REFERENCES accounts(id),
    created_at  TEXT NOT NULL
);

-- Every x402 payment taken: form 'proof' (a USDC transfer already made) or 'authorization' (an EIP-3009
-- transferWithAuthorization the service settles: signed by the escrow wallet as relayer, stored, then sent, like a
-- payout; or settled by the facilitator). A payment is bound to the call it was accepted for (call_digest) and
-- spent once: granted_at is set in the transaction that answers that call below 400. x402 income is the
-- operator's, kept out of the jobs' escrow ledger.
CREATE TABLE IF NOT EXISTS x402_payments (
    seq                  INTEGER PRIMARY KEY,
    id                   TEXT NOT NULL UNIQUE,
    form                 TEXT NOT NULL CHECK (form IN ('proof', 'authorization')),
    endpoint             TEXT NOT NULL,         -- what it paid for: 'GET /api/jobs/match'
    chain_id             INTEGER NOT NULL,
    asset                TEXT NOT NULL,
    payer                TEXT NOT NULL,
    amount               INTEGER NOT NULL CHECK (amount >= 0),    -- USDC base units
    authorization_nonce  TEXT,                  -- form 2: the EIP-3009 nonce, lowercase
    tx_hash              TEXT,                  -- the proof's transfer, or the settlement
    status               TEXT NOT NULL CHECK (status IN ('pending', 'confirmed', 'failed')),
    raw_tx               TEXT,                  -- a settlement sent by the service: as for payouts
    nonce                INTEGER,
    broadcast_at         TEXT,
    account_id           TEXT REFERENCES accounts(id),    -- the account the call ran as (a key's, or the payer's)
    granted_at           TEXT,                  -- when it was spent: its call answered below 400
    created_at           TEXT NOT NULL,         -- when it was accepted: its call may send it again for an hour
    call_digest          TEXT,                  -- SHA-256 of the call it was accepted for (method, path and query,
                                                -- body's SHA-256, API key id); NULL (taken before v9): no call's
    UNIQUE (chain_id, asset, payer, authorization_nonce)
);
CREATE INDEX IF NOT EXISTS x402_payments_pending ON x402_payments(status) WHERE status = 'pending';
CREATE INDEX IF NOT EXISTS x402_payments_tx ON x402_payments(chain_id, tx_hash);

-- Stripe webhook events applied (each once, by its id), and what they recorded on a job (charge.refunded...).
CREATE TABLE IF NOT EXISTS stripe_events (
    id          TEXT PRIMARY KEY,               -- evt_...
    type        TEXT NOT NULL,
    job_id      TEXT REFERENCES jobs(id),
    summary     TEXT,                           -- for the job's timeline, when the event is about a job
    created_at  TEXT NOT NULL,
    reference   TEXT                            -- the Stripe object it is about (ch_, du_, cs_), for the timeline
);
CREATE INDEX IF NOT EXISTS stripe_events_job ON stripe_events(job_id) WHERE job_id IS NOT NULL;

-- Every transaction the escrow wallet signed for a payout or an x402 settlement, the first and each re-pricing
-- (the same nonce with a higher fee, when one sat unmined or was refused for its fee): whichever of a payment's
-- hashes is mined is its transaction. Kept by the triggers below whenever a payment's raw_tx is written.
CREATE TABLE IF NOT EXISTS signed_transactions (
    seq         INTEGER PRIMARY KEY,            -- the order they were signed in
    tx_hash     TEXT NOT NULL UNIQUE,
    source      TEXT NOT NULL CHECK (source IN ('payments', 'x402_payments', 'escrow_calls')),
    payment_id  TEXT NOT NULL,
    nonce       INTEGER NOT NULL,
    raw_tx      TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS signed_transactions_payment ON signed_transactions(payment_id);
CREATE TRIGGER IF NOT EXISTS payments_signed AFTER INSERT ON payments WHEN NEW.raw_tx IS NOT NULL BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'payments', NEW.id, NEW.nonce, NEW.raw_tx);
END;
CREATE TRIGGER IF NOT EXISTS payments_resigned AFTER UPDATE OF raw_tx ON payments WHEN NEW.raw_tx IS NOT NULL BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'payments', NEW.id, NEW.nonce, NEW.raw_tx);
END;
CREATE TRIGGER IF NOT EXISTS x402_payments_signed AFTER INSERT ON x402_payments WHEN NEW.raw_tx IS NOT NULL BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'x402_payments', NEW.id, NEW.nonce, NEW.raw_tx);
END;
CREATE TRIGGER IF NOT EXISTS x402_payments_resigned AFTER UPDATE OF raw_tx ON x402_payments
        WHEN NEW.raw_tx IS NOT NULL BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'x402_payments', NEW.id, NEW.nonce, NEW.raw_tx);
END;

-- Small counters: 'next_nonce' of the escrow wallet, allocated one payout or settlement at a time.
CREATE TABLE IF NOT EXISTS chain_state (
    name   TEXT PRIMARY KEY,
    value  INTEGER NOT NULL
);

-- The webhook outbox: each event is written in the transaction of the change that causes it, then a
-- background greenlet delivers it (at least once). The id is the X-Service-Delivery / webhook-id header.
CREATE TABLE IF NOT EXISTS webhook_deliveries (
    id                TEXT PRIMARY KEY,
    agent_id          TEXT NOT NULL REFERENCES agents(id),
    event             TEXT NOT NULL,
    payload           TEXT NOT NULL,            -- the JSON body of SPEC.md, as first written
    status            TEXT NOT NULL CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts          INTEGER NOT NULL DEFAULT 0,
    last_status_code  INTEGER,
    last_error        TEXT,
    next_attempt_at   TEXT,                     -- when pending: the earliest time of the next attempt
    created_at        TEXT NOT NULL,
    updated_at        TEXT NOT NULL,
    delivered_at      TEXT
);
CREATE INDEX IF NOT EXISTS webhook_deliveries_due ON webhook_deliveries(status, next_attempt_at);
CREATE INDEX IF NOT EXISTS webhook_deliveries_agent ON webhook_deliveries(agent_id, created_at);
-- The worker's round-robin: agents with due deliveries in id order, then each one's oldest due.
CREATE INDEX IF NOT EXISTS webhook_deliveries_pending ON webhook_deliveries(agent_id, next_attempt_at)
    WHERE status = 'pending';

-- Events fanned out into webhook_deliveries: the change's transaction writes one row, with its deliveries when
-- they are few (marketplace.FAN_OUT_INLINE); else a background greenlet expands it in short transactions, each
-- recording its progress with the rows it adds.
CREATE TABLE IF NOT EXISTS webhook_events (
    seq               INTEGER PRIMARY KEY,
    event             TEXT NOT NULL,
    job_id            TEXT NOT NULL REFERENCES jobs(id),
    payload           TEXT NOT NULL,            -- the body; data.agentId null where each recipient names itself
    recipients        TEXT,                     -- JSON list of agent ids; NULL: the agents the job suits (job.new)
    expanded_through  TEXT NOT NULL DEFAULT '', -- job.new: the agents with ids up to this one are done
    created_at        TEXT NOT NULL,            -- agents registered later do not receive it
    expanded_at       TEXT                      -- set when every recipient has its delivery
);
CREATE INDEX IF NOT EXISTS webhook_events_pending ON webhook_events(seq) WHERE expanded_at IS NULL;

-- The answers to requests sent with an Idempotency-Key (CONTRACT 14), each stored in the transaction of the change
-- it answers and kept 24 hours (the sweep deletes older ones). A row is named by the hash of the caller's scope
-- and the key, never by the key; the answer's headers and body are sealed (AES-GCM) with a key derived from the
-- Idempotency-Key, so the database alone never shows an answer's secrets (a new account's API key).
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key_hash          TEXT PRIMARY KEY,         -- hex sha256 of the scope and the key
    fingerprint       TEXT NOT NULL,            -- hex sha256 of the method, the path and the body
    status            INTEGER NOT NULL,
    sealed            BLOB NOT NULL,            -- nonce, ciphertext and tag of {headers, body}
    created_at        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS idempotency_keys_created ON idempotency_keys(created_at);

-- Browser sessions (README "Using it in the browser"): a random id in an HttpOnly cookie, of which only the hash is
-- stored, and the account it acts as (never an API key). Idle and absolute expiry; the sweep deletes expired rows.
-- A session lives only as long as the key that opened it (CONTRACT 20): revoking the key ends it.
CREATE TABLE IF NOT EXISTS sessions (
    id_hash           TEXT PRIMARY KEY,         -- hex sha256 of the cookie's value
    account_id        TEXT NOT NULL REFERENCES accounts(id),
    key_id            TEXT NOT NULL REFERENCES api_keys(id),   -- the key signed in with (or made at sign-up)
    created_at        TEXT NOT NULL,
    seen_at           TEXT NOT NULL,            -- the last request (kept to a few minutes' precision)
    expires_at        TEXT NOT NULL             -- created_at + the absolute lifetime
);
CREATE INDEX IF NOT EXISTS sessions_seen ON sessions(seen_at);
CREATE INDEX IF NOT EXISTS sessions_key ON sessions(key_id);

-- Contract mode (CONTRACT 21): the JobEscrow calls the server's key signs that are not one payment each: a payer's
-- deposit relayed (depositWithAuthorization, the service pays the gas), a proposal of a deposit's scheduled
-- payments, its execution. Signed with the next nonce in the transaction that decides them, stored, then sent,
-- re-priced and confirmed as payouts are (signed_transactions keeps every hash).
CREATE TABLE IF NOT EXISTS escrow_calls (
    seq           INTEGER PRIMARY KEY,
    id            TEXT NOT NULL UNIQUE,
    function      TEXT NOT NULL CHECK (function IN ('depositWithAuthorization', 'propose', 'execute')),
    deposit_id    TEXT NOT NULL,
    job_id        TEXT REFERENCES jobs(id),        -- propose and execute: the job the deposit funds
    account_id    TEXT REFERENCES accounts(id),    -- depositWithAuthorization: the account it was relayed for
    proposal_id   TEXT,                            -- execute: the propose call it runs
    status        TEXT NOT NULL CHECK (status IN ('pending', 'confirmed', 'failed')),
    tx_hash       TEXT NOT NULL,
    raw_tx        TEXT NOT NULL,
    nonce         INTEGER NOT NULL,
    broadcast_at  TEXT,
    executable_at TEXT,                            -- propose: when it may be executed
    created_at    TEXT NOT NULL,
    payer         TEXT                             -- depositWithAuthorization: its payer (one relay in flight each)
);
CREATE UNIQUE INDEX IF NOT EXISTS escrow_calls_relay ON escrow_calls(deposit_id)
    WHERE function = 'depositWithAuthorization' AND status != 'failed';
CREATE INDEX IF NOT EXISTS escrow_calls_pending ON escrow_calls(status) WHERE status = 'pending';
CREATE UNIQUE INDEX IF NOT EXISTS escrow_calls_relay_payer ON escrow_calls(payer)
    WHERE function = 'depositWithAuthorization' AND status = 'pending';
CREATE INDEX IF NOT EXISTS escrow_calls_deposit ON escrow_calls(deposit_id, function);
CREATE INDEX IF NOT EXISTS payments_scheduled ON payments(status) WHERE status = 'scheduled';
CREATE TRIGGER IF NOT EXISTS escrow_calls_signed AFTER INSERT ON escrow_calls BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'escrow_calls', NEW.id, NEW.nonce, NEW.raw_tx);
END;
CREATE TRIGGER IF NOT EXISTS escrow_calls_resigned AFTER UPDATE OF raw_tx ON escrow_calls BEGIN
    INSERT OR IGNORE INTO signed_transactions (tx_hash, source, payment_id, nonce, raw_tx)
        VALUES (NEW.tx_hash, 'escrow_calls', NEW.id, NEW.nonce, NEW.raw_tx);
END;

-- OAuth 2.1 (CONTRACT 22): MCP hosts registered by themselves (public clients: PKCE, no secret), the grants people
-- approved (each remembers the key whose session approved it: revoking that key ends it), one-use codes of 60 s,
-- and tokens (access: one hour; refresh: 30 days, rotated on use). Codes and tokens are kept only as hashes.
CREATE TABLE IF NOT EXISTS oauth_clients (
    client_id     TEXT PRIMARY KEY,
    name          TEXT NOT NULL,
    redirect_uris TEXT NOT NULL,                 -- JSON array, each matched exactly
    created_at    TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS oauth_grants (
    id            TEXT PRIMARY KEY,
    client_id     TEXT NOT NULL REFERENCES oauth_clients(client_id),
    account_id    TEXT NOT NULL REFERENCES accounts(id),
    key_id        TEXT NOT NULL REFERENCES api_keys(id),   -- the key of the session that approved it
    scope         TEXT NOT NULL DEFAULT '',
    created_at    TEXT NOT NULL,
    used_at       TEXT,                          -- the last token issued
    revoked_at    TEXT
);
CREATE INDEX IF NOT EXISTS oauth_grants_account ON oauth_grants(account_id, created_at);
-- registration deletes the clients never approved a day after they registered (oauth.forget_unapproved_clients):
-- found by their time, and each checked for grants (as the foreign key is on delete) by its client_id
CREATE INDEX IF NOT EXISTS oauth_clients_created ON oauth_clients(created_at);
CREATE INDEX IF NOT EXISTS oauth_grants_client ON oauth_grants(client_id);
CREATE TABLE IF NOT EXISTS oauth_codes (
    code_hash      TEXT PRIMARY KEY,
    grant_id       TEXT NOT NULL REFERENCES oauth_grants(id),
    redirect_uri   TEXT NOT NULL,
    code_challenge TEXT NOT NULL,                -- S256 only
    expires_at     TEXT NOT NULL,
    used_at        TEXT                          -- a code is used once; used again, its grant is revoked
);
CREATE TABLE IF NOT EXISTS oauth_tokens (
    token_hash    TEXT PRIMARY KEY,
    grant_id      TEXT NOT NULL REFERENCES oauth_grants(id),
    kind          TEXT NOT NULL CHECK (kind IN ('access', 'refresh')),
    expires_at    TEXT NOT NULL,
    revoked_at    TEXT,                          -- a refresh token: when it was rotated (used again: grant revoked)
    created_at    TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS oauth_tokens_grant ON oauth_tokens(grant_id);

-- A2A tasks (CONTRACT 22): what POST /message:send answered, kept 24 hours for the account that sent it.
CREATE TABLE IF NOT EXISTS a2a_tasks (
    id          TEXT PRIMARY KEY,
    account_id  TEXT NOT NULL REFERENCES accounts(id),
    task        TEXT NOT NULL,                  -- the Task, in A2A's JSON
    created_at  TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS a2a_tasks_created ON a2a_tasks(created_at);
-- An account keeps its 100 newest tasks (CONTRACT 25): each new task finds the account's others by this index.
CREATE INDEX IF NOT EXISTS a2a_tasks_account ON a2a_tasks(account_id, created_at);

-- The read cache's generation: one number that every write which could change a cached answer (a job, a claim, a
-- payment, an agent, a dispute...) advances in its own transaction, by the triggers marketplace.py makes for each
-- table but GENERATION_IGNORED. A cached answer is keyed by the generation read before it was computed.
CREATE TABLE IF NOT EXISTS generation (
    id  INTEGER PRIMARY KEY CHECK (id = 1),
    n   INTEGER NOT NULL
);
INSERT OR IGNORE INTO generation (id, n) VALUES (1, 0);

-- Contract mode (CONTRACT 25): every event of the JobEscrow about a deposit the database knows, the ones other
-- people sent included, read --confirmations deep from where the last sweep stopped (chain_state
-- 'escrow_events_from'); the sweep reconciles the ledger with them.
CREATE TABLE IF NOT EXISTS escrow_events (
    tx_hash       TEXT NOT NULL,
    log_index     INTEGER NOT NULL,
    block_number  INTEGER NOT NULL,
    deposit_id    TEXT NOT NULL,
    name          TEXT NOT NULL,                   -- Released, Refunded, Proposed, Cancelled, Reclaimed
    payee         TEXT,                            -- Released: the payee; Refunded, Reclaimed: the payer
    amount        INTEGER,
    fee           INTEGER,
    by_signature  INTEGER,                         -- Released: 1 by a co-signed release, 0 by an executed proposal
    ours          INTEGER NOT NULL,                -- sent by this service's key from a transaction it signed
    PRIMARY KEY (tx_hash, log_index)
);
CREATE INDEX IF NOT EXISTS escrow_events_deposit ON escrow_events(deposit_id, name);

PRAGMA user_version = 12;
