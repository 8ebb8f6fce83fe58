"""Property-based tests of the ledger and the job state machine (hypothesis, stateful).

A RuleBasedStateMachine drives the real app in-process through its HTTP API: requesters post jobs (every
competition mode, 1-4 workers, odd amounts in USDC and USD), workers claim and deliver, requesters approve,
reject, dispute and cancel, the arbitrators of a dispute's panel vote, an admin or a trusted arbitrator's
owner resolves disputes, and the clock moves past
deadlines and verification windows before the admin runs the sweeps. After every step the invariants of
CONTRACT.md sections 3, 4, 5, 7 and 11 are checked against the database and the API:

- the ledger balances (mp.ledger_problems), no escrow, worker or fee account is negative, no requester
  gets back more than it put in;
- every status (job, claim, escrow, dispute) is an allowed value, and every change of one since the
  previous step is an allowed transition (the tables below);
- a final job's escrow is released (completed) or refunded (the other final statuses) and it holds
  no active claim; for every job the payments shown by GET /api/jobs/:id add up:
  escrow = released + fee + refunded + still held;
- every approved claim was paid its share exactly once (the whole price, or paymentAmount / maxWorkers
  rounded down to the cent in all-paid), less a fee; a job's fees together are the fee percentage of all it
  released, rounded down to the cent once (fees carried across shares, section 20);
- a live job's status follows its claims (disputed, delivered, claimed when every slot is taken, else
  open), and no job holds more claims than maxWorkers;
- every dispute has a panel of requiredVotes arbitrators none of whom is linked to a party (or no panel and
  needsAdmin), and only its panel's votes are counted;
- every settled claim moved its agent's reputation once, by the contract's amount, floored at 0.00;
- job_counts equals the real count of jobs by category and status.

Every refusal must be a 4xx with the JSON error shape {error, code, status}, never a 5xx, and a small
oracle says which operations must succeed (a delivered claim can be verified, an open dispute resolved...).

Profiles: HYPOTHESIS_PROFILE=ci (the default: derandomized, 20 runs of up to 40 steps per settings, no
example database) or fuzz (500 random runs of up to 60 steps per settings; failing examples kept under
$TMPDIR/marketplace-hypothesis, not in the repo, and replayed first by the next fuzz run):
    HYPOTHESIS_PROFILE=fuzz .venv/bin/python -m pytest -q tests/test_properties.py
Each run of the machine starts a fresh service on a new database file; the service's clock is fixed
(mp.CLOCK) and moves only when a rule moves it.
"""

import os
import random
import shutil
import tempfile
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import hypothesis.configuration
from hypothesis import given, HealthCheck, note, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import marketplace as mp
import wiring
from conftest import ADMIN_KEY, Client, job_body, make_account, make_agent, random_wallet
from fake_stripe import FakeStripe

PANEL_DRAW = mp.PANEL_DRAW     # the service's own (secrets.SystemRandom), put back after each run

# Profiles ----------------------------------------------------------------------------------------------

# Hypothesis keeps caches (and, in the fuzz profile, failing examples) in its home directory, by default
# .hypothesis in the working directory: keep it out of the repo unless HYPOTHESIS_STORAGE_DIRECTORY says where.
HYPOTHESIS_HOME = os.environ.get('HYPOTHESIS_STORAGE_DIRECTORY') or os.path.join(tempfile.gettempdir(),
                                                                                  'marketplace-hypothesis')
hypothesis.configuration.set_hypothesis_home_dir(HYPOTHESIS_HOME)

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
settings.register_profile('ci', max_examples=20, stateful_step_count=40, deadline=None, derandomize=True,
                          database=None, print_blob=False, suppress_health_check=_SLOW_OK)
settings.register_profile('fuzz', max_examples=500, stateful_step_count=60, deadline=None,
                          database=DirectoryBasedExampleDatabase(os.path.join(HYPOTHESIS_HOME, 'examples')),
                          print_blob=True, suppress_health_check=_SLOW_OK)
PROFILE = os.environ.get('HYPOTHESIS_PROFILE', 'ci')

# The contract's values and transitions ------------------------------------------------------------------

FINAL = {'completed', 'rejected', 'refunded', 'expired', 'cancelled'}
JOB_STATUSES = {'open', 'claimed', 'delivered', 'disputed'} | FINAL
CLAIM_STATUSES = {'claimed', 'delivered', 'approved', 'rejected', 'disputed', 'expired', 'superseded'}
ACTIVE = {'claimed', 'delivered', 'disputed'}
ESCROW_STATUSES = {'locked', 'released', 'refunded'}
DISPUTE_STATUSES = {'open', 'resolved'}

# Job status changes one API call may make (CONTRACT.md 3, 4, 5, 11). Final statuses change no more.
# maxWorkers = 1 (section 3's table; 11: a rejection ends the job):
SINGLE_WORKER_MOVES = {
    'open': {'claimed', 'cancelled', 'expired'},
    'claimed': {'delivered', 'expired', 'open'},      # open: the claim timed out (section 18), or was released
    'delivered': {'completed', 'rejected', 'disputed'},
    'disputed': {'completed', 'refunded'},
}
# maxWorkers > 1 (section 3 "Multi-worker jobs", 11): the status follows the active claims; a rejection
# (or a dispute lost by the worker) frees a slot while the deadline has not passed; at the deadline the job
# ends `completed` if any worker was paid, else `expired` (expiry sweep), `rejected` (last delivery rejected)
# or `refunded` (last dispute decided for the requester).
MULTI_WORKER_MOVES = {
    'open': {'claimed', 'delivered', 'cancelled', 'expired', 'completed'},
    'claimed': {'open', 'delivered', 'expired', 'completed'},
    'delivered': {'open', 'claimed', 'disputed', 'completed', 'rejected'},
    'disputed': {'open', 'claimed', 'delivered', 'completed', 'refunded'},
}
ESCROW_MOVES = {'locked': {'released', 'refunded'}}
# Claims (section 3): claimed -> delivered -> approved | rejected | disputed; disputed -> approved | rejected;
# claimed -> expired; any active claim -> superseded when another claim wins the job.
CLAIM_MOVES = {
    'claimed': {'delivered', 'expired', 'superseded'},
    'delivered': {'approved', 'rejected', 'disputed', 'superseded'},
    'disputed': {'approved', 'rejected', 'superseded'},
}
DISPUTE_MOVES = {'open': {'resolved'}}

START = datetime(2030, 1, 1, 12, 0, tzinfo=timezone.utc)   # a fixed clock: runs are reproducible
UNITS = {'USDC': 10 ** 4, 'USD': 1}                         # base units in one cent
N_REQUESTERS, N_WORKERS, N_ARBITRATORS = 2, 5, 7
TRUSTED = (0, 3, 5, 6)  # the arbitrators an admin trusted (5 and 6 are not active: they decide nothing)
NOT_ACTIVE = {5: 'pending', 6: 'suspended'}     # never drawn for a panel, never voting, never deciding
MAX_LIVE_JOBS = 4

# Hypothesis draws the first values of a sampled_from most often: the first ones here are those whose all-paid
# shares leave a remainder (10.03 / 3, / 2 or / 4), and all-paid comes first among the modes.
ODD_AMOUNTS = ['10.03', '0.01', '0.07', '33.33', '99.99', '0.02', '0.03', '0.10', '1.00', '25.00', '1000000.00']
amounts = st.one_of(st.sampled_from(ODD_AMOUNTS), st.integers(1, 500_000).map(mp.format_cents))
MODES = ['all-paid', 'best-wins', 'first-wins']


# The machine -------------------------------------------------------------------------------------------

class PanelDraw:
    """Panels drawn the same way in a run and in its replay (what a rule may pick, a panel member, must not change
    between them, or hypothesis cannot replay a run: FlakyStrategyDefinition): a seeded random over the eligible
    arbitrators in the order they were registered (their ids are random)."""

    def __init__(self, db):
        self.db, self.random = db, random.Random(1)

    def sample(self, eligible, size):
        order = {row['id']: row['rowid'] for row in self.db.rows('SELECT rowid, id FROM arbitrators')}
        return self.random.sample(sorted(eligible, key=order.get), size)


class MarketMachine(RuleBasedStateMachine):
    """One fresh service per run; FEE_PERCENT and REQUIRED_VOTES are its settings."""

    FEE_PERCENT = '0'
    REQUIRED_VOTES = 3
    STRIPE = False          # the stripe rail for real, on the fake Stripe API (USD jobs paid through Checkout)

    def __init__(self):
        super().__init__()
        # a memory file system when there is one: SQLite syncs every commit, and a run makes hundreds
        self.tmp = tempfile.mkdtemp(prefix='marketplace-props-', dir='/dev/shm' if os.path.isdir('/dev/shm') else None)
        self.app = None

    @initialize()
    def start_service(self):
        mp.CLOCK.set(START)
        mp.PANEL_DRAW = None        # set once the database is there (PanelDraw)
        self.fee = Decimal(self.FEE_PERCENT)
        stripe = {}
        if self.STRIPE:
            self.fake = stripe_fake()
            self.fake.clock = lambda: mp.now().timestamp()      # Stripe's time is the machine's fixed clock
            stripe = {'stripe_secret_key': self.fake.secret_key, 'stripe_webhook_secret': self.fake.webhook_secret,
                      'stripe_api_base': self.fake.url, 'allow_simulated_rails': True}    # USDC stays simulated
        settings_ = mp.Settings(db=os.path.join(self.tmp, 'props.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                public_url='http://market.test', allow_private_webhooks=True,
                                fee_percent=self.fee, required_votes=self.REQUIRED_VOTES, **stripe)
        self.app = wiring.make_app(settings_)
        self.db = self.app.service.db
        mp.PANEL_DRAW = PanelDraw(self.db)
        self.client = Client(self.app)
        requesters = [make_account(self.client, f'requester-{n}') for n in range(N_REQUESTERS)]
        self.requester_keys = [key for _, key in requesters]
        self.workers = []           # (agent, key)
        worker_accounts = []
        for n in range(N_WORKERS):
            account, key = make_account(self.client, f'worker-{n}')
            agent, _ = make_agent(self.client, key, name=f'worker-{n}')
            self.workers.append((agent, key))
            worker_accounts.append((account, key))
        self.payouts_waiting = set()    # stripe mode: workers whose connected account cannot take transfers yet
        if self.STRIPE:     # every agent onboarded; workers 0-3 finish at Stripe now, 4 later (a rule)
            for n, (agent, key) in enumerate(self.workers):
                answer = self.client.post(f'/api/agents/{agent["id"]}/stripe/onboarding', key=key)
                assert answer.status == 200, answer
                if n < 4:
                    self.stripe_event('account.updated', self.fake.enable_payouts(answer.json['accountId']),
                                      account=answer.json['accountId'])
                else:
                    self.payouts_waiting.add(n)
        # Three independent arbitrators, then one owned by worker 0's account and one by requester 0's: those
        # two are parties to some disputes, where they are never drawn and may neither vote nor decide (403
        # conflict_of_interest). The admin activates those five (panels of three always fill) and trusts
        # arbitrators 0 and 3 (3 is worker 0's): only their owners may decide a dispute alone. Two more, trusted
        # too, stay pending (5) or are suspended (6): they are never drawn, never vote and never decide.
        owners = [make_account(self.client, f'arbiter-{n}') for n in range(3)]
        owners += [worker_accounts[0], requesters[0]]
        owners += [make_account(self.client, f'arbiter-{n}') for n in (5, 6)]
        self.arbitrators = []       # (arbitrator, key of its owner)
        for n, (account, key) in enumerate(owners):
            answer = self.client.post('/api/arbitrators', {'name': f'arbiter {n}', 'walletAddress': random_wallet(),
                                                           'accountId': account['id']}, key=ADMIN_KEY)
            assert (answer.status, answer.json['arbitrator']['status']) == (201, 'pending'), answer
            change = {'trusted': n in TRUSTED} | ({} if NOT_ACTIVE.get(n) == 'pending' else
                                                 {'status': NOT_ACTIVE.get(n, 'active')})
            answer = self.client.patch(f'/api/arbitrators/{answer.json["arbitrator"]["id"]}', change, key=ADMIN_KEY)
            assert answer.status == 200, answer
            self.arbitrators.append((answer.json['arbitrator'], key))
        self.job_ids, self.claim_ids, self.dispute_ids = [], [], []     # in creation order
        self.requester_of = {}      # job id -> requester key
        self.worker_of = {}         # claim id -> worker index
        self.job_of = {}            # claim id -> job id
        self.seen_jobs = {}         # job id -> (status, escrowStatus) at the last check
        self.seen_claims = {}       # claim id -> status
        self.seen_disputes = {}     # dispute id -> (status, outcome)

    def teardown(self):
        try:
            if self.app is not None:
                self.app.service.close()
        finally:
            mp.CLOCK.set(None)
            mp.PANEL_DRAW = PANEL_DRAW
            shutil.rmtree(self.tmp, ignore_errors=True)

    # Helpers -----------------------------------------------------------------------------------------

    def call(self, method, path, body=None, key=None, ok=200, expected=None):
        """One request. A 5xx fails; a refusal must be a JSON 4xx error. `expected` (True or False), when
        given, is whether the contract says this call must succeed."""
        answer = self.client.request(method, path, body, key=key)
        if method != 'GET':
            code = f' {answer.json.get("code")}' if answer.status >= 400 and isinstance(answer.json, dict) else ''
            note(f'  {method} {path} -> {answer.status}{code}')
        assert answer.status < 500, f'{method} {path}: server error {answer}'
        if answer.status != ok:
            assert 400 <= answer.status < 500, f'{method} {path}: unexpected {answer}'
            error = answer.json
            assert isinstance(error, dict), f'{method} {path}: error is not JSON: {answer}'
            assert isinstance(error.get('error'), str) and error['error'].strip(), error
            assert isinstance(error.get('code'), str) and error['code'], error
            assert error.get('status') == answer.status, error
        if expected is not None:
            assert (answer.status == ok) == expected, \
                f'{method} {path}: expected {"success" if expected else "a refusal"}, got {answer}'
        return answer

    def now_iso(self):
        return mp.iso(mp.now())

    def stripe_event(self, kind, thing, account=None):
        """Stripe tells the service something (a signed webhook event); the answer's JSON."""
        payload, signature = self.fake.event(kind, thing, account)
        answer = self.client.post('/api/stripe/webhook', payload,
                                  headers={'Stripe-Signature': signature, 'Content-Type': 'application/json'})
        assert answer.status == 200, answer
        return answer.json

    def job_row(self, job_id):
        return self.db.row('SELECT * FROM jobs WHERE id = :id', {'id': job_id})

    def claim_row(self, claim_id):
        return self.db.row('SELECT * FROM claims WHERE id = :id', {'id': claim_id})

    def count_claims(self, job_id, statuses, but=None):
        marks = ', '.join(f"'{s}'" for s in statuses)
        return self.db.value(f'SELECT count(*) FROM claims WHERE job_id = :job AND status IN ({marks}) '
                             'AND id != coalesce(:but, \'\')', {'job': job_id, 'but': but})

    def advance_to(self, moment):
        """Move the clock forward (never back) to `moment`."""
        if moment > mp.now():
            mp.CLOCK.set(moment)

    # Rules -------------------------------------------------------------------------------------------
    # Each rule picks its job, claim or dispute from the machine's own records (in creation order, so
    # that a run replays exactly): usually one the operation can succeed on, sometimes any of them, so
    # that refusals are exercised too.

    def pick(self, data, what, records, usable):
        """One of `records` (a list): three times in four one for which `usable` holds, if any (hypothesis
        draws and shrinks towards 0: towards a usable one)."""
        preferred = [record for record in records if usable(record)]
        any_one = data.draw(st.integers(0, 3), label=f'{what}: any (3) or a usable one (0-2)?') == 3
        pool = preferred if preferred and not any_one else records
        if what in ('job', 'claim', 'dispute'):     # drawn by label (job#3), the same in every replay
            by_label = {self.label(what, record): record for record in pool}
            return by_label[data.draw(st.sampled_from(list(by_label)), label=what)]
        return data.draw(st.sampled_from(pool), label=what)

    def slots_taken(self, row):
        taken = self.count_claims(row['id'], ACTIVE)
        if row['competition_mode'] == 'all-paid':     # each all-paid share is paid once: a paid slot stays taken
            taken += self.count_claims(row['id'], ('approved',))
        return taken

    def claimable(self, job_id):
        row = self.job_row(job_id)
        return (row['status'] not in FINAL and row['deadline'] > self.now_iso()
                and self.slots_taken(row) < row['max_workers'])

    def claim_is(self, *statuses):
        return lambda claim_id: self.claim_row(claim_id)['status'] in statuses

    def dispute_is_open(self, dispute_id):
        return self.db.value('SELECT status FROM disputes WHERE id = :id', {'id': dispute_id}) == 'open'

    def panel(self, dispute_id):
        return {row['arbitrator_id'] for row in self.db.rows(
            'SELECT arbitrator_id FROM dispute_panels WHERE dispute_id = :id', {'id': dispute_id})}

    def parties(self, dispute_id):
        """The accounts a dispute is between (CONTRACT.md 11): the job's requester and the worker's owner."""
        row = self.db.row('''SELECT j.requester_id, a.account_id FROM disputes d JOIN jobs j ON j.id = d.job_id
                             JOIN claims c ON c.id = d.claim_id JOIN agents a ON a.id = c.agent_id
                             WHERE d.id = :id''', {'id': dispute_id})
        return {row['requester_id'], row['account_id']}

    def label(self, kind, record_id):
        """job#3, claim#5, dispute#0: the record's index in creation order (for the printed steps)."""
        records = {'job': self.job_ids, 'claim': self.claim_ids, 'dispute': self.dispute_ids}[kind]
        return f'{kind}#{records.index(record_id)}'

    @precondition(lambda self: self.db.value(
        "SELECT count(*) FROM jobs WHERE status NOT IN ('completed', 'rejected', 'refunded', 'expired', 'cancelled')")
        < MAX_LIVE_JOBS)    # a few jobs at a time, so that the steps go deep into their lives
    @rule(requester=st.integers(0, N_REQUESTERS - 1),
          mode=st.sampled_from(MODES), max_workers=st.sampled_from([3, 2, 1, 4]),
          amount=amounts, currency=st.sampled_from(['USDC', 'USD']), deadline_hours=st.sampled_from([240, 1, 24, 72, 720]),
          window_hours=st.integers(1, 48), claim_hours=st.sampled_from([24, 1, 720, 6]))
    def post_job(self, requester, mode, max_workers, amount, currency, deadline_hours, window_hours, claim_hours):
        body = {'title': 'Property job', 'description': 'Made by the state machine.', 'category': 'code',
                'paymentAmount': amount, 'paymentCurrency': currency, 'competitionMode': mode,
                'maxWorkers': max_workers, 'verificationWindowHours': window_hours, 'claimTimeoutHours': claim_hours,
                'deadline': mp.iso(mp.now() + timedelta(hours=deadline_hours))}
        if self.STRIPE:     # hypothesis draws the first currency most: in stripe mode let that be USD, by card
            currency = body['paymentCurrency'] = {'USDC': 'USD', 'USD': 'USDC'}[currency]
        cents = int(Decimal(amount) * 100)
        by_card = self.STRIPE and currency == 'USD'
        share_ok = not (mode == 'all-paid' and cents < max_workers)     # no all-paid share of 0.00
        # by card: the deadline after the Checkout Session's 60 minutes, and at least Stripe's 0.50
        card_ok = not by_card or (deadline_hours > 1 and cents >= mp.STRIPE_MIN_CENTS)
        answer = self.call('POST', '/api/jobs', body, key=self.requester_keys[requester], ok=201,
                           expected=share_ok and card_ok)
        if not share_ok:
            assert answer.json['fields'] == {'paymentAmount': 'must be at least 0.01 per worker in all-paid mode '
                                             f'({mp.format_cents(max_workers)} for {max_workers} workers)'}
            return
        if not card_ok:
            assert set(answer.json['fields']) == {'deadline' if deadline_hours == 1 else 'paymentAmount'}, answer
            return
        job = answer.json['job']
        if by_card:         # pending until paid: the requester pays at Checkout, and Stripe's event opens it
            assert (job['status'], job['escrowStatus'], answer.json['checkoutUrl'][:4]) == \
                ('pending_payment', 'pending', 'http'), job
            session = self.db.value('SELECT stripe_session_id FROM jobs WHERE id = :id', {'id': job['id']})
            assert self.stripe_event('checkout.session.completed', self.fake.complete(session))['outcome'] == 'opened'
            job = self.call('GET', f'/api/jobs/{job["id"]}').json['job']
        assert (job['status'], job['escrowStatus'], job['paymentAmount']) == ('open', 'locked', amount), job
        self.requester_of[job['id']] = self.requester_keys[requester]
        self.job_ids.append(job['id'])
        note(f'-> job#{len(self.job_ids) - 1}')

    # Each rule runs only when it has something to work on (a live job, a claimed or delivered claim, an
    # open dispute), so that the steps go deep; one pick in four still takes any record, to exercise refusals.
    def exists(self, sql):
        return self.db.value(f'SELECT EXISTS ({sql})', {'now': self.now_iso()})

    @precondition(lambda self: self.exists(
        "SELECT 1 FROM jobs WHERE deadline > :now AND status IN ('open', 'claimed', 'delivered', 'disputed')"))
    @rule(data=st.data())
    def claim(self, data):
        job = self.pick(data, 'job', self.job_ids, self.claimable)
        # an agent that holds a claim, was paid, or let a claim time out may not claim the job again
        holders = {row['agent_id'] for row in self.db.rows(
            '''SELECT agent_id FROM claims WHERE job_id = :id
               AND status IN ('claimed', 'delivered', 'disputed', 'approved', 'expired')''', {'id': job})}
        worker = self.pick(data, 'worker', list(range(N_WORKERS)), lambda n: self.workers[n][0]['id'] not in holders)
        agent, key = self.workers[worker]
        row = self.job_row(job)
        takes = ('open', 'claimed', 'delivered', 'disputed') if row['max_workers'] > 1 else ('open', 'claimed')
        holds = self.db.value('''SELECT count(*) FROM claims WHERE job_id = :job AND agent_id = :agent
                                 AND status IN ('claimed', 'delivered', 'disputed', 'approved', 'expired')''',
                              {'job': job, 'agent': agent['id']})
        expected = (row['status'] in takes and row['deadline'] > self.now_iso() and not holds
                    and self.slots_taken(row) < row['max_workers'])
        note(f'claim {self.label("job", job)} by worker {worker}')
        answer = self.call('POST', f'/api/jobs/{job}/claim', {'agentId': agent['id']}, key=key, ok=201,
                           expected=expected)
        if answer.status == 201:
            claim = answer.json['claim']
            assert claim['status'] == 'claimed', claim
            self.worker_of[claim['id']] = worker
            self.job_of[claim['id']] = job
            self.claim_ids.append(claim['id'])
            note(f'-> claim#{len(self.claim_ids) - 1}')

    @precondition(lambda self: self.exists("SELECT 1 FROM claims WHERE status = 'claimed'"))
    @rule(data=st.data())
    def deliver(self, data):
        claim = self.pick(data, 'claim', self.claim_ids, self.claim_is('claimed'))
        job = self.job_of[claim]
        _, key = self.workers[self.worker_of[claim]]
        expected = self.claim_row(claim)['status'] == 'claimed' and self.job_row(job)['deadline'] > self.now_iso()
        note(f'deliver {self.label("claim", claim)}')
        self.call('POST', f'/api/jobs/{job}/deliver',
                  {'claimId': claim, 'deliverable': {'type': 'url', 'url': 'https://example.com/out'}},
                  key=key, expected=expected)

    def claim_due(self, claim):
        """When a claim times out (section 18): claimTimeoutHours after it was made."""
        row = self.claim_row(claim)
        return mp.parse_time(row['created_at']) + timedelta(hours=self.job_row(row['job_id'])['claim_timeout_hours'])

    @precondition(lambda self: self.exists("SELECT 1 FROM claims WHERE status = 'claimed'"))
    @rule(data=st.data())
    def release(self, data):
        """The requester (or an admin) ends a claim that timed out without delivering; 409 before."""
        claim = self.pick(data, 'claim', self.claim_ids, self.claim_is('claimed'))
        job = self.job_of[claim]
        key = ADMIN_KEY if data.draw(st.integers(0, 4), label='by the admin (4)?') == 4 else None
        if data.draw(st.booleans(), label='first wait for the timeout?'):
            self.advance_to(self.claim_due(claim))
        expected = self.claim_row(claim)['status'] == 'claimed' and self.claim_due(claim) <= mp.now()
        note(f'release {self.label("claim", claim)}{" (admin)" if key else ""}')
        answer = self.call('POST', f'/api/jobs/{job}/claims/{claim}/release', key=key or self.requester_of[job],
                           expected=expected)
        if answer.status == 200:
            assert answer.json['claim']['status'] == 'expired', answer
        else:
            assert answer.json['code'] in ('claim_not_overdue', 'claim_not_claimed'), answer

    @precondition(lambda self: self.exists("SELECT 1 FROM claims WHERE status = 'delivered'"))
    @rule(data=st.data())
    def verify(self, data):
        claim = self.pick(data, 'claim', self.claim_ids, self.claim_is('delivered'))
        approved = data.draw(st.booleans(), label='approved')
        key = ADMIN_KEY if data.draw(st.integers(0, 4), label='by the admin (4)?') == 4 else None
        job = self.job_of[claim]
        row = self.job_row(job)
        expected = self.claim_row(claim)['status'] == 'delivered'
        if approved and row['competition_mode'] != 'all-paid' and self.count_claims(job, ('disputed',), but=claim):
            expected = False        # the price is spoken for by another claim's open dispute (409 dispute_open)
        note(f'{"approve" if approved else "reject"} {self.label("claim", claim)}{" (admin)" if key else ""}')
        answer = self.call('POST', f'/api/jobs/{job}/verify', {'claimId': claim, 'approved': approved},
                           key=key or self.requester_of[job], expected=expected)
        if answer.status == 200:
            assert answer.json['claim']['status'] == ('approved' if approved else 'rejected'), answer

    @precondition(lambda self: self.STRIPE and self.exists(
        "SELECT 1 FROM claims c JOIN jobs j ON j.id = c.job_id WHERE c.status = 'delivered' AND j.payment_intent"))
    @rule(data=st.data(), outage=st.sampled_from(['lost answer', 500, 'drop']))
    def verify_through_a_stripe_outage(self, data, outage):
        """Stripe mode: the requester decides a delivery while the next call to Stripe fails (an answer lost after
        the transfer or refund was made, a 500, a dropped connection). The answer still says what was decided,
        the payment waits pending, and the sweeps pay it exactly once."""
        paid_by_card = [claim for claim in self.claim_ids if self.job_row(self.job_of[claim])['payment_intent']]
        claim = self.pick(data, 'claim', paid_by_card, self.claim_is('delivered'))
        job, approved = self.job_of[claim], data.draw(st.booleans(), label='approved')
        expected = self.claim_row(claim)['status'] == 'delivered' and not (
            approved and self.job_row(job)['competition_mode'] != 'all-paid'
            and self.count_claims(job, ('disputed',), but=claim))
        note(f'{"approve" if approved else "reject"} {self.label("claim", claim)}; Stripe outage: {outage}')
        self.fake.fail_next(1, 'drop' if outage == 'drop' else 500, after=outage == 'lost answer')
        self.call('POST', f'/api/jobs/{job}/verify', {'claimId': claim, 'approved': approved},
                  key=self.requester_of[job], expected=expected)
        self.stripe_retries()

    def stripe_retries(self):
        """The sweeps after an outage: each sends what is due (a failure ends its round); the next one retries."""
        self.fake.clear_failures()
        for _ in range(2):
            mp.send_stripe_payments(self.db, self.app.service.settings)

    @precondition(lambda self: self.exists("SELECT 1 FROM claims WHERE status = 'delivered'"))
    @rule(data=st.data())
    def dispute(self, data):
        claim = self.pick(data, 'claim', self.claim_ids, self.claim_is('delivered'))
        job = self.job_of[claim]
        row = self.job_row(job)
        expected = self.claim_row(claim)['status'] == 'delivered' and not self.db.value(
            'SELECT count(*) FROM disputes WHERE claim_id = :id', {'id': claim})
        if row['competition_mode'] != 'all-paid' and self.db.value(
                "SELECT count(*) FROM disputes WHERE job_id = :id AND status = 'open'", {'id': job}):
            expected = False        # one open dispute at a time on a one-price job (409 dispute_open)
        note(f'dispute {self.label("claim", claim)}')
        answer = self.call('POST', f'/api/jobs/{job}/dispute', {'claimId': claim, 'reason': 'It does not build.'},
                           key=self.requester_of[job], ok=201, expected=expected)
        if answer.status == 201:
            assert answer.json['dispute']['status'] == 'open', answer
            assert answer.json['job']['status'] == 'disputed', answer
            self.dispute_ids.append(answer.json['dispute']['id'])
            note(f'-> dispute#{len(self.dispute_ids) - 1}')

    @precondition(lambda self: self.exists("SELECT 1 FROM disputes WHERE status = 'open'"))
    @rule(data=st.data())
    def vote(self, data):
        dispute = self.pick(data, 'dispute', self.dispute_ids, self.dispute_is_open)
        choice = data.draw(st.sampled_from(['worker', 'requester']), label='vote')
        voted = {row['arbitrator_id'] for row in self.db.rows(
            'SELECT arbitrator_id FROM votes WHERE dispute_id = :id', {'id': dispute})}
        parties, panel = self.parties(dispute), self.panel(dispute)
        # mostly a panel member; sometimes anyone else who has not voted (off the panel, pending, suspended)
        on_panel = data.draw(st.integers(0, 3), label='a panel member (0-2)?') < 3
        number = self.pick(data, 'arbitrator', list(range(N_ARBITRATORS)),
                           lambda n: self.arbitrators[n][0]['id'] not in voted
                           and (self.arbitrators[n][0]['id'] in panel) == on_panel)
        judge, key = self.arbitrators[number]
        expected = (self.dispute_is_open(dispute) and judge['id'] in panel - voted
                    and judge['accountId'] not in parties)
        note(f'arbitrator {number} votes {choice} on {self.label("dispute", dispute)}')
        self.call('POST', f'/api/disputes/{dispute}/vote',
                  {'arbitratorId': judge['id'], 'vote': choice, 'reasoning': 'I read the deliverable.'},
                  key=key, ok=201, expected=expected)

    @precondition(lambda self: self.exists("SELECT 1 FROM disputes WHERE status = 'open'"))
    @rule(data=st.data())
    def resolve(self, data):
        dispute = self.pick(data, 'dispute', self.dispute_ids, self.dispute_is_open)
        outcome = data.draw(st.sampled_from(['worker', 'requester']), label='outcome')
        # the admin, or the owner of a trusted, active arbitrator that is not a party's (CONTRACT.md 18)
        decider = data.draw(st.sampled_from(['admin'] + list(range(N_ARBITRATORS))), label='decided by')
        expected = self.dispute_is_open(dispute)
        if decider != 'admin':
            expected = expected and decider in TRUSTED and decider not in NOT_ACTIVE and \
                self.arbitrators[decider][0]['accountId'] not in self.parties(dispute)
        note(f'{"admin" if decider == "admin" else f"arbitrator {decider}"} decides '
             f'{self.label("dispute", dispute)} for the {outcome}')
        answer = self.call('PATCH', f'/api/disputes/{dispute}',
                           {'outcome': outcome, 'resolution': f'Decided for the {outcome}.'},
                           key=ADMIN_KEY if decider == 'admin' else self.arbitrators[decider][1], expected=expected)
        if answer.status == 200:
            assert answer.json['dispute']['outcome'] == outcome, answer

    # cancel and time_passes end jobs. They take one argument more than the rules above: hypothesis orders
    # rules by their number of arguments (then by name), and in our runs that made them come up less often.
    @precondition(lambda self: self.exists(     # only while some job could be cancelled
        "SELECT 1 FROM jobs j WHERE status = 'open' AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.job_id = j.id)"))
    @rule(data=st.data(), by_admin=st.booleans())
    def cancel(self, data, by_admin):
        job = self.pick(data, 'job', self.job_ids, lambda job_id: True)     # any job: most have claims by now
        row = self.job_row(job)
        expected = (row['status'] == 'open' and not self.count_claims(job, ACTIVE)
                    and not self.count_claims(job, ('approved',)))
        note(f'cancel {self.label("job", job)}{" (admin)" if by_admin else ""}')
        answer = self.call('POST', f'/api/jobs/{job}/cancel', {}, key=ADMIN_KEY if by_admin else self.requester_of[job],
                           expected=expected)
        if answer.status == 200:
            assert (answer.json['job']['status'], answer.json['job']['escrowStatus']) == ('cancelled', 'refunded')

    @rule(worker=st.integers(0, N_WORKERS - 1))
    def change_wallet(self, worker):
        """A worker moves its agent to a new wallet: refused (409 wallet_locked) while the agent holds an open claim
        or dispute (section 20), so a dispute is judged on the wallet it opened with."""
        agent, key = self.workers[worker]
        held = self.db.value('''SELECT count(*) FROM claims c WHERE c.agent_id = :id AND (c.status IN
                                    ('claimed', 'delivered', 'disputed') OR EXISTS (SELECT 1 FROM disputes d
                                    WHERE d.claim_id = c.id AND d.status = 'open'))''', {'id': agent['id']})
        note(f'worker {worker} changes its wallet ({held} open claim(s))')
        answer = self.call('PATCH', f'/api/agents/{agent["id"]}', {'walletAddress': random_wallet()}, key=key,
                           expected=not held)
        if answer.status != 200:
            assert (answer.status, answer.json['code']) == (409, 'wallet_locked'), answer

    @invariant()
    def open_disputes_keep_their_ties(self):
        """Section 20: an open dispute's stored parties are those of its job and claim, the worker's wallet included."""
        for row in self.db.rows('''SELECT d.id, d.requester_account, d.worker_account, d.worker_wallet, d.payer_wallet,
                                          j.requester_id, j.refund_address, a.account_id, a.wallet_address
                                   FROM disputes d JOIN jobs j ON j.id = d.job_id JOIN claims c ON c.id = d.claim_id
                                   JOIN agents a ON a.id = c.agent_id WHERE d.status = 'open' '''):
            assert (row['requester_account'], row['worker_account'], row['worker_wallet'], row['payer_wallet']) == \
                (row['requester_id'], row['account_id'], row['wallet_address'], row['refund_address']), row

    @precondition(lambda self: self.job_ids)
    @rule(data=st.data(), action=st.sampled_from(['expire', 'auto-verify', 'wait']))
    def time_passes(self, data, action):
        """expire: the clock moves to a job's deadline (or later) and the admin runs the expiry sweep;
        auto-verify: the clock moves past a job's verification window and the admin runs auto-verify;
        wait: time passes without a sweep (claims and deliveries after a deadline get refused)."""
        if action == 'expire':
            job = self.pick(data, 'job', self.job_ids, lambda job_id: self.job_row(job_id)['status'] not in FINAL)
            late = data.draw(st.sampled_from([0, 1, 59, 3600, 86400]), label='seconds late')
            note(f'expire {self.label("job", job)} +{late} s')
            self.advance_to(mp.parse_time(self.job_row(job)['deadline']) + timedelta(seconds=late))
            self.call('POST', '/api/jobs/expire', key=ADMIN_KEY, expected=True)
            # Section 4: every job in open or claimed whose deadline has passed is settled by the sweep.
            left = self.db.rows("SELECT id, status FROM jobs WHERE deadline <= :now AND status IN ('open', 'claimed')",
                                {'now': self.now_iso()})
            assert left == [], f'the expiry sweep left overdue jobs: {left}'
            # Section 18: no claim is still `claimed` claimTimeoutHours after it was made.
            late = [claim for claim in self.claim_ids if self.claim_is('claimed')(claim)
                    and self.claim_due(claim) <= mp.now()]
            assert late == [], f'the expiry sweep left timed-out claims: {late}'
        elif action == 'auto-verify':
            # the window of a delivered claim if there is one, else of a job from now
            delivered = [claim for claim in self.claim_ids if self.claim_is('delivered')(claim)]
            extra = data.draw(st.sampled_from([0, 1, 90]), label='minutes more')
            if delivered:
                claim = self.pick(data, 'claim', delivered, lambda claim_id: True)
                row = self.job_row(self.job_of[claim])
                start = mp.parse_time(self.claim_row(claim)['delivered_at'])
                note(f'auto-verify after the window of {self.label("claim", claim)} '
                     f'({row["verification_window_hours"]} h) +{extra} min')
            else:
                row = self.job_row(self.pick(data, 'job', self.job_ids, lambda job_id: True))
                start = mp.now()
                note(f'auto-verify {row["verification_window_hours"]} h +{extra} min from now')
            self.advance_to(start + timedelta(hours=row['verification_window_hours'], minutes=extra))
            self.call('POST', '/api/jobs/auto-verify', key=ADMIN_KEY, expected=True)
            # Section 4: every delivered claim not under dispute whose window has passed is approved (a
            # one-price job whose other delivery is under dispute waits for the dispute).
            for row in self.db.rows('''SELECT c.id, c.job_id, c.delivered_at, j.verification_window_hours AS hours,
                                              j.competition_mode AS mode
                                       FROM claims c JOIN jobs j ON j.id = c.job_id WHERE c.status = 'delivered' '''):
                if mp.parse_time(row['delivered_at']) + timedelta(hours=row['hours']) > mp.now():
                    continue
                waits = row['mode'] != 'all-paid' and self.count_claims(row['job_id'], ('disputed',), but=row['id'])
                assert waits, f'auto-verify left claim {row["id"]} delivered past its verification window'
        else:
            minutes = data.draw(st.sampled_from([1, 30, 600, 3000]), label='minutes')
            note(f'wait {minutes} min')
            mp.CLOCK.advance(minutes=minutes)

    # Invariants --------------------------------------------------------------------------------------

    @invariant()
    def ledger_balances(self):
        assert mp.ledger_problems(self.db) == []

    @invariant()
    def no_account_is_negative(self):
        for row in self.db.rows('SELECT account, currency, sum(amount) AS balance FROM ledger_entries '
                                'GROUP BY account, currency'):
            if row['account'].startswith('funding:'):
                # where a requester's money comes from: it can only have given, never gained
                assert row['balance'] <= 0, row
            else:
                assert row['account'].split(':')[0] in ('escrow', 'worker', 'fees'), row
                assert row['balance'] >= 0, row

    @invariant()
    def statuses_are_allowed_values(self):
        for row in self.db.rows('SELECT id, status, escrow_status FROM jobs'):
            assert row['status'] in JOB_STATUSES, row
            assert row['escrow_status'] in ESCROW_STATUSES, row
        for row in self.db.rows('SELECT id, status FROM claims'):
            assert row['status'] in CLAIM_STATUSES, row
        for row in self.db.rows('SELECT id, status, outcome FROM disputes'):
            assert row['status'] in DISPUTE_STATUSES, row
            assert (row['outcome'] is None) == (row['status'] == 'open'), row
            assert row['outcome'] in (None, 'worker', 'requester'), row

    @invariant()
    def changes_are_allowed_transitions(self):
        for row in self.db.rows('SELECT id, status, escrow_status, max_workers FROM jobs'):
            old = self.seen_jobs.get(row['id'])
            if old is not None:
                (status, escrow), moves = old, MULTI_WORKER_MOVES if row['max_workers'] > 1 else SINGLE_WORKER_MOVES
                if row['status'] != status:
                    assert row['status'] in moves.get(status, set()), \
                        f'job {row["id"]} (maxWorkers {row["max_workers"]}): {status} -> {row["status"]}'
                if row['escrow_status'] != escrow:
                    assert row['escrow_status'] in ESCROW_MOVES.get(escrow, set()), \
                        f'job {row["id"]} escrow: {escrow} -> {row["escrow_status"]}'
            self.seen_jobs[row['id']] = (row['status'], row['escrow_status'])
        for row in self.db.rows('SELECT id, status FROM claims'):
            old = self.seen_claims.get(row['id'])
            if old is not None and row['status'] != old:
                assert row['status'] in CLAIM_MOVES.get(old, set()), f'claim {row["id"]}: {old} -> {row["status"]}'
            self.seen_claims[row['id']] = row['status']
        for row in self.db.rows('SELECT id, status, outcome FROM disputes'):
            old = self.seen_disputes.get(row['id'])
            if old is not None and (row['status'], row['outcome']) != old:
                assert old[0] == 'open' and row['status'] in DISPUTE_MOVES['open'], \
                    f'dispute {row["id"]}: {old} -> {(row["status"], row["outcome"])}'
            self.seen_disputes[row['id']] = (row['status'], row['outcome'])

    @invariant()
    def final_jobs_are_settled(self):
        for row in self.db.rows('SELECT id, status, escrow_status FROM jobs'):
            active = self.count_claims(row['id'], ACTIVE)
            if row['status'] in FINAL:
                # section 3: completed = released to a worker; rejected, refunded, expired, cancelled = refunded
                want = 'released' if row['status'] == 'completed' else 'refunded'
                assert row['escrow_status'] == want, row
                assert active == 0, f'final job {row["id"]} ({row["status"]}) keeps {active} active claim(s)'
            else:
                assert row['escrow_status'] == 'locked', row

    @invariant()
    def job_status_follows_its_claims(self):
        """Section 3's meanings: a live job is `disputed` while a dispute is open, `delivered` while a delivery
        waits, `claimed` when every worker slot is taken, else `open`; and no job holds more active claims
        than maxWorkers (all-paid: active plus paid, each share being paid once)."""
        for row in self.db.rows('SELECT * FROM jobs'):
            active = self.count_claims(row['id'], ACTIVE)
            taken = self.slots_taken(row)
            assert active <= row['max_workers'] and taken <= row['max_workers'], (dict(row), active, taken)
            if row['status'] in FINAL:
                continue
            if self.count_claims(row['id'], ('disputed',)):
                allowed = {'disputed', 'delivered'} if self.count_claims(row['id'], ('delivered',)) else {'disputed'}
            elif self.count_claims(row['id'], ('delivered',)):
                allowed = {'delivered'}
            else:
                allowed = {'claimed'} if taken >= row['max_workers'] else {'open'}
            assert row['status'] in allowed, (row['id'], row['status'], allowed)

    @invariant()
    def disputes_match_their_claims(self):
        for row in self.db.rows('''SELECT d.id, d.status, d.outcome, d.required_votes, c.status AS claim,
                                          (SELECT count(*) FROM votes v WHERE v.dispute_id = d.id) AS votes
                                   FROM disputes d JOIN claims c ON c.id = d.claim_id'''):
            want = {None: 'disputed', 'worker': 'approved', 'requester': 'rejected'}[row['outcome']]
            assert row['claim'] == want, row
            if row['status'] == 'open':
                assert row['votes'] < row['required_votes'], row

    @invariant()
    def panels_are_full_and_unlinked(self):
        """Five active arbitrators, at most two linked to a dispute: every panel fills, with no party's
        arbitrator and no pending or suspended one, and only panel members' votes are counted."""
        not_active = {self.arbitrators[n][0]['id'] for n in NOT_ACTIVE}
        for row in self.db.rows('SELECT id, required_votes, needs_admin FROM disputes'):
            panel = self.panel(row['id'])
            owners = {a['accountId'] for a, _ in self.arbitrators if a['id'] in panel}
            assert (len(panel), row['needs_admin']) == (row['required_votes'], 0), row
            assert not owners & self.parties(row['id']) and not panel & not_active, row
            voters = {v['arbitrator_id'] for v in self.db.rows('SELECT arbitrator_id FROM votes WHERE dispute_id = :id',
                                                                 {'id': row['id']})}
            assert voters <= panel, row

    @invariant()
    def payments_add_up_per_job(self):
        """From GET /api/jobs/:id: escrow = released + fee + refunded + still held, and the held part is
        the ledger's escrow balance; plus claimCount = active claims."""
        for job_id in self.requester_of:
            answer = self.call('GET', f'/api/jobs/{job_id}', expected=True)
            job, payments = answer.json['job'], answer.json['payments']
            total = {kind: sum((Decimal(p['amount']) for p in payments if p['type'] == kind), Decimal(0))
                     for kind in ('escrow', 'release', 'fee', 'refund')}
            assert [p['amount'] for p in payments if p['type'] == 'escrow'] == [job['paymentAmount']], payments
            held = total['escrow'] - total['release'] - total['fee'] - total['refund']
            ledger_held = mp.escrow_balance(self.db, job_id)
            assert held * 100 * UNITS[job['paymentCurrency']] == ledger_held, (job, payments, ledger_held)
            assert held >= 0, (job, payments)
            if job['status'] in FINAL:
                assert held == 0, (job, payments)
            assert (job['escrowStatus'] == 'locked') == (held > 0), (job, payments)
            assert job['claimCount'] == sum(c['status'] in ACTIVE for c in answer.json['claims']), answer.json

    @invariant()
    def approved_claims_are_paid_their_share_once(self):
        rows = self.db.rows('''
            SELECT c.id, c.job_id, c.status, j.amount_cents, j.max_workers, j.competition_mode AS mode, j.currency,
                   count(CASE p.type WHEN 'release' THEN 1 END) AS releases,
                   coalesce(sum(CASE p.type WHEN 'release' THEN p.amount END), 0) AS released,
                   count(CASE p.type WHEN 'fee' THEN 1 END) AS fees,
                   coalesce(sum(CASE p.type WHEN 'fee' THEN p.amount END), 0) AS fee
            FROM claims c JOIN jobs j ON j.id = c.job_id LEFT JOIN payments p ON p.claim_id = c.id
            GROUP BY c.id''')
        approved_per_job = {}
        for row in rows:
            if row['status'] != 'approved':
                assert row['releases'] == 0 and row['fees'] == 0, f'unapproved claim was paid: {row}'
                continue
            approved_per_job[row['job_id']] = approved_per_job.get(row['job_id'], 0) + 1
            share_cents = row['amount_cents'] // (row['max_workers'] if row['mode'] == 'all-paid' else 1)
            unit = UNITS[row['currency']]
            assert row['releases'] == 1 and row['fees'] <= 1, f'approved claim paid more than once: {row}'
            assert row['released'] + row['fee'] == share_cents * unit, f'wrong share: {row}'
            assert row['fee'] % unit == 0 and 0 <= row['fee'] <= share_cents * unit, row
        # Fees are carried across a job's shares (CONTRACT.md 20): all of a job's fees are its fee percentage of
        # all it released, rounded down to the cent once.
        for row in self.db.rows('''SELECT j.id, j.currency, coalesce(sum(p.amount), 0) AS gross,
                                          coalesce(sum(CASE p.type WHEN 'fee' THEN p.amount END), 0) AS fees
                                   FROM jobs j JOIN payments p ON p.job_id = j.id AND p.type IN ('release', 'fee')
                                   GROUP BY j.id'''):
            unit = UNITS[row['currency']]
            exact_fee = Decimal(row['gross'] // unit) * self.fee / 100         # in cents
            assert row['fees'] % unit == 0, row
            assert exact_fee - 1 < Decimal(row['fees'] // unit) <= exact_fee, f'fees are not {self.fee}% to the cent: {row}'
        for job_id, approved in approved_per_job.items():
            job = self.job_row(job_id)
            limit = job['max_workers'] if job['competition_mode'] == 'all-paid' else 1
            assert approved <= limit, f'job {job_id} ({job["competition_mode"]}) paid {approved} claims'

    @invariant()
    def reputation_follows_the_claims(self):
        """Section 4 and 11: one reputation change per settled claim (approved +1.00, dispute won +1.50,
        rejected -0.25, dispute lost -1.00, expired undelivered -0.50), none for the others; the score is
        the changes replayed from 0 with a floor at 0.00, and each change records the score after it."""
        outcome_of = {row['claim_id']: row['outcome'] for row in self.db.rows('SELECT claim_id, outcome FROM disputes')}
        events = {}
        for row in self.db.rows('SELECT claim_id, delta, reason FROM reputation_events ORDER BY rowid'):
            events.setdefault(row['claim_id'], []).append((row['delta'], row['reason']))
        for row in self.db.rows('SELECT id, status FROM claims'):
            want = {
                'approved': [(150, 'dispute won')] if outcome_of.get(row['id']) == 'worker' else [(100, 'delivery approved')],
                'rejected': [(-100, 'dispute lost')] if outcome_of.get(row['id']) == 'requester' else [(-25, 'delivery rejected')],
                'expired': [(-50, 'claim expired without delivery')],
            }.get(row['status'], [])
            assert events.get(row['id'], []) == want, (row, events.get(row['id']))
        for agent, _ in self.workers:
            score = 0
            for row in self.db.rows('SELECT delta, score_after FROM reputation_events WHERE agent_id = :id ORDER BY rowid',
                                    {'id': agent['id']}):
                score = max(0, score + row['delta'])
                assert row['score_after'] == score, (agent['id'], row)
            assert self.db.value('SELECT reputation FROM agents WHERE id = :id', {'id': agent['id']}) == score

    @precondition(lambda self: self.STRIPE and self.payouts_waiting)
    @rule(data=st.data(), outage=st.sampled_from([None, 500, 'drop', 'lost answer']))
    def payouts_enabled(self, data, outage):
        """A worker finishes onboarding at Stripe; the waiting transfers go out, through an outage of Stripe
        (a 500, a dropped connection, or an answer lost after the transfer was made) and the sweeps' retries."""
        worker = data.draw(st.sampled_from(sorted(self.payouts_waiting)), label='worker')
        self.payouts_waiting.discard(worker)
        account = self.db.value('SELECT stripe_account_id FROM agents WHERE id = :id',
                                {'id': self.workers[worker][0]['id']})
        note(f'worker {worker} can take transfers now; Stripe outage: {outage}')
        self.stripe_event('account.updated', self.fake.enable_payouts(account), account=account)
        if outage:
            self.fake.fail_next(1, 'drop' if outage == 'drop' else 500, after=outage == 'lost answer')
        mp.send_stripe_payments(self.db, self.app.service.settings)
        self.stripe_retries()

    @invariant()
    def stripe_money_moves_once(self):
        """Stripe mode: every confirmed transfer or refund is one object at Stripe, of its record's amount, to the
        worker's connected account (or of the job's PaymentIntent); Stripe made nothing else; a release waits
        pending only for a worker who cannot take transfers yet."""
        if not self.STRIPE:
            return
        records = self.db.rows('''SELECT p.*, j.payment_intent, a.stripe_account_id, a.stripe_payouts_enabled
            FROM payments p JOIN jobs j ON j.id = p.job_id LEFT JOIN claims c ON c.id = p.claim_id
            LEFT JOIN agents a ON a.id = c.agent_id
            WHERE j.payment_intent IS NOT NULL AND p.type IN ('release', 'refund')''')
        made = {**{t['id']: ('release', t['amount'], t['destination']) for t in self.fake.transfer_list()},
                **{r['id']: ('refund', r['amount'], r['payment_intent']) for r in self.fake.refund_list()}}
        confirmed = {}
        for record in records:
            if record['status'] == 'confirmed':
                assert record['reference'] not in confirmed, record
                to = record['stripe_account_id'] if record['type'] == 'release' else record['payment_intent']
                confirmed[record['reference']] = (record['type'], record['amount'], to)
            else:
                assert record['status'] == 'pending', record
                assert record['type'] == 'release' and not record['stripe_payouts_enabled'], record
        assert confirmed == made

    @invariant()
    def job_counts_are_exact(self):
        counted = self.db.rows('SELECT category, status, count(*) AS jobs FROM jobs GROUP BY 1, 2 ORDER BY 1, 2')
        kept = self.db.rows('SELECT category, status, jobs FROM job_counts WHERE jobs > 0 ORDER BY 1, 2')
        assert kept == counted


# One test case per settings: no fee; a 2.5 % fee; an odd fee with a single vote deciding disputes.

class NoFeeMachine(MarketMachine):
    FEE_PERCENT = '0'
    REQUIRED_VOTES = 3


class FeeMachine(MarketMachine):
    FEE_PERCENT = '2.5'
    REQUIRED_VOTES = 3


class OddFeeOneVoteMachine(MarketMachine):
    FEE_PERCENT = '33.33'
    REQUIRED_VOTES = 1


class StripeFeeMachine(MarketMachine):
    FEE_PERCENT = '2.5'
    REQUIRED_VOTES = 3
    STRIPE = True


STRIPE_FAKE = []        # the one fake Stripe API of the stripe machine's runs, started on first use


def stripe_fake():
    """The fake Stripe API (tests/fake_stripe.py), emptied for a new run."""
    if not STRIPE_FAKE:
        STRIPE_FAKE.append(FakeStripe().start())
    STRIPE_FAKE[0].reset()
    return STRIPE_FAKE[0]


TestLedgerNoFee = NoFeeMachine.TestCase
TestLedgerFee = FeeMachine.TestCase
TestLedgerOddFeeOneVote = OddFeeOneVoteMachine.TestCase
TestLedgerStripe = StripeFeeMachine.TestCase
TestLedgerNoFee.settings = TestLedgerFee.settings = TestLedgerOddFeeOneVote.settings = settings.get_profile(PROFILE)
# The stripe machine takes more runs, to reach deeper into jobs paid by card (ci: 20 → 40; make fuzz: 500)
TestLedgerStripe.settings = settings(settings.get_profile(PROFILE),
                                     max_examples=max(40, settings.get_profile(PROFILE).max_examples))


# Fees carried across shares (CONTRACT.md 20) -----------------------------------------------------------------

def test_any_split_of_a_jobs_releases_pays_the_fee_of_one_release_of_their_sum(tmp_path):
    """However a job's releases are split (100 shares of 0.39, or odd amounts), its fees add up to the fee of one
    release of their sum, each share pays at most itself, and the ledger balances."""
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'fees.db'), rate_limits='off', admin_key=ADMIN_KEY))
    client = Client(app)
    db = app.service.db
    _, key = make_account(client, 'requester')
    agent = {'id': 'the-worker', 'wallet_address': random_wallet(), 'stripe_account_id': None}

    def released(shares, currency):
        """A job of the shares' sum released in these shares: the fee of each release, in cents."""
        body = job_body(paymentAmount=mp.format_cents(sum(shares)), paymentCurrency=currency)
        answer = client.post('/api/jobs', body, key=key)
        assert answer.status == 201, answer
        job = mp.get_job(db, answer.json['job']['id'])
        unit = 10 ** (mp.DECIMALS[currency] - 2)
        fees = []
        with db.transaction():
            for share in shares:
                records = mp.release_to_worker(db, app.service.settings, job, {'id': None}, agent, share * unit)
                paid = {record['type']: record['amount'] for record in records}
                assert paid['release'] + paid.get('fee', 0) == share * unit, records
                fees.append(paid.get('fee', 0) // unit)
            mp.set_job_status(db, job['id'], 'completed', 'released')
        return fees

    @settings(settings.get_profile(PROFILE), max_examples=40 if PROFILE == 'ci' else 300)
    @given(fee=st.sampled_from(['2.5', '33.33', '0.01', '99.99', '100']),
           shares=st.one_of(st.lists(st.integers(1, 2_000), min_size=1, max_size=30),
                            st.integers(2, 100).map(lambda count: [39] * count)),
           currency=st.sampled_from(['USDC', 'USD']))
    def check(fee, shares, currency):
        app.service.settings.fee_percent = Decimal(fee)
        in_pieces = released(shares, currency)
        [at_once] = released([sum(shares)], currency)
        assert sum(in_pieces) == at_once == sum(shares) * int(Decimal(fee) * 100) // 10_000, (in_pieces, at_once)
        assert mp.ledger_problems(db) == []

    try:
        check()
    finally:
        app.service.close()


def test_a_hundred_shares_of_39_cents_pay_the_fee_of_39_00(tmp_path):
    """The hole closed: at 2.5 %, each 0.39 share on its own rounds its fee (0.00975) down to nothing."""
    app = wiring.make_app(mp.Settings(db=str(tmp_path / 'fees.db'), rate_limits='off', admin_key=ADMIN_KEY,
                                  fee_percent=Decimal('2.5')))
    client = Client(app)
    _, requester_key = make_account(client, 'requester')
    answer = client.post('/api/jobs', job_body(paymentAmount='39.00', maxWorkers=100, competitionMode='all-paid'),
                         key=requester_key)
    assert answer.status == 201, answer
    job = answer.json['job']
    for n in range(100):
        _, key = make_account(client, f'worker-{n}')
        agent, _ = make_agent(client, key, name=f'worker-{n}')
        claim = client.post(f'/api/jobs/{job["id"]}/claim', {'agentId': agent['id']}, key=key).json['claim']
        delivered = client.post(f'/api/jobs/{job["id"]}/deliver', {'claimId': claim['id'], 'deliverable': {
            'type': 'url', 'url': 'https://example.com/out'}}, key=key)
        assert delivered.status == 200, delivered
        verified = client.post(f'/api/jobs/{job["id"]}/verify', {'claimId': claim['id'], 'approved': True},
                               key=requester_key)
        assert verified.status == 200, verified
    shown = client.get(f'/api/jobs/{job["id"]}').json
    fees = [Decimal(p['amount']) for p in shown['payments'] if p['type'] == 'fee']
    releases = [Decimal(p['amount']) for p in shown['payments'] if p['type'] == 'release']
    assert (shown['job']['status'], len(releases), sum(fees), sum(releases)) == \
        ('completed', 100, Decimal('0.97'), Decimal('38.03'))      # 2.5 % of 39.00 = 0.975, down to 0.97
    assert mp.ledger_problems(app.service.db) == []
    app.service.close()
